"""``--jobs N``: candidate runs trained in N worker processes.

Each worker is a fresh interpreter running this module (``python -m ...workers``), not a
``multiprocessing`` child: those re-import the user's ``__main__`` (a script without the
``if __name__ == "__main__"`` guard would start the whole explanation again in every worker).
The parent writes the worker its setup (the parent's ``sys.path``, the task's name and
arguments, torch threads), then one job at a time, ``(function, args)``: the worker answers
each with ``function(task, *args)`` (the function travels by reference, module and name). All
messages are pickles behind an 8-byte length, on the worker's stdin and stdout (the worker's own
prints go to its stderr, which is kept in a file and quoted if the worker dies).

    python -m mixprec.comparison.explain.workers      (started by WorkerPool, not by hand)
"""

from __future__ import annotations

import os
import pickle
import queue
import struct
import subprocess
import sys
import tempfile
import threading
from typing import Any, BinaryIO

_LEN = struct.Struct("<Q")


def send(stream: BinaryIO, obj: Any) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(_LEN.pack(len(data)) + data)
    stream.flush()


def receive(stream: BinaryIO) -> Any:
    head = stream.read(_LEN.size)
    if len(head) < _LEN.size:
        raise EOFError("the other end closed the pipe")
    (n,) = _LEN.unpack(head)
    data = stream.read(n)
    if len(data) < n:
        raise EOFError("the other end closed the pipe mid-message")
    return pickle.loads(data)  # from our own parent or worker, over a private pipe


class WorkerPool:
    """``jobs`` worker processes; ``run((function, args))`` runs one job on whichever is free (thread-safe)."""

    def __init__(self, jobs: int, setup: dict[str, Any]) -> None:
        self._free: queue.Queue = queue.Queue()
        self._all: list[tuple[subprocess.Popen, Any]] = []
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)  # mixprec and the task, as the parent sees them
        for _ in range(jobs):
            log = tempfile.TemporaryFile()
            proc = subprocess.Popen([sys.executable, "-m", "mixprec.comparison.explain.workers"], stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE, stderr=log, env=env)
            send(proc.stdin, {**setup, "sys_path": list(sys.path)})  # type: ignore[arg-type]
            self._all.append((proc, log))
            self._free.put((proc, log))
        self._lock = threading.Lock()

    def run(self, job: tuple) -> Any:
        proc, log = self._free.get()
        try:
            send(proc.stdin, job)  # type: ignore[arg-type]
            kind, value = receive(proc.stdout)  # type: ignore[arg-type]
        except (EOFError, BrokenPipeError, OSError) as e:
            raise RuntimeError(f"an --explain worker process died ({e}); its last output:\n{_tail(log)}") from None
        finally:
            self._free.put((proc, log))
        if kind == "error":
            raise RuntimeError(f"an --explain worker failed: {value}")
        return value

    def close(self) -> None:
        for proc, log in self._all:
            try:
                send(proc.stdin, None)  # type: ignore[arg-type]
                proc.stdin.close()  # type: ignore[union-attr]
                proc.wait(timeout=30)
            except Exception:
                proc.kill()
                proc.wait()
            log.close()
        self._all = []


def _tail(log: Any, n: int = 2000) -> str:
    try:
        log.seek(0)
        return log.read().decode(errors="replace")[-n:]
    except OSError:
        return "(unreadable)"


def main() -> int:
    """One worker: setup, then jobs until a None."""
    stdin, out = sys.stdin.buffer, os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # prints (from the task, torch) go to stderr: stdout carries only our messages
    setup = receive(stdin)
    for p in reversed(setup["sys_path"]):
        if p not in sys.path:
            sys.path.insert(0, p)
    import torch

    from mixprec.tasks import load_task

    torch.set_num_threads(setup["threads"])
    task = load_task(setup["task"], **setup["task_kwargs"])
    while True:
        job = receive(stdin)
        if job is None:
            return 0
        fn, args = job
        try:
            send(out, ("ok", fn(task, *args)))
        except Exception as e:  # the parent reports it with the candidate
            send(out, ("error", f"{type(e).__name__}: {e}"))


if __name__ == "__main__":
    sys.exit(main())
