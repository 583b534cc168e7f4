"""Running a module on N local ranks through torch's own launcher (``torch.distributed.run``, torchrun),
for the tools that train data-parallel themselves (``mixprec compare --nproc N``).

``launch`` starts ``python -m torch.distributed.run --standalone --nproc_per_node N -m MODULE ARGS``
in a session of its own, hands every line rank 0 prints that starts with ``tag`` to ``on_line``,
and, past ``timeout`` seconds, kills that session (the launcher and every rank it started).
``init_from_env`` is the rank's side: the process group torchrun's environment describes, gloo on
CPU, nccl on CUDA (one device per local rank).
"""

from __future__ import annotations

import collections
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch


class LaunchError(RuntimeError):
    """The ranks failed or ran out of time; the message ends with the tail of their output."""


def launch(module: str, args: Sequence[str], nproc: int, *, tag: str = "", on_line: Callable[[str], None] | None = None,
           timeout: float | None = None, env: dict[str, str] | None = None) -> None:
    """Run ``module`` on ``nproc`` local ranks (see the module docstring); raises ``LaunchError``."""
    if not isinstance(nproc, int) or nproc < 1:
        raise ValueError(f"nproc must be a positive integer, got {nproc!r}")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           "-m", module, *args]
    full_env = dict(os.environ if env is None else env)
    full_env.setdefault("OMP_NUM_THREADS", "1")  # (torchrun's default too, said here so it does not warn)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=full_env,
                            start_new_session=True)
    tail: collections.deque[str] = collections.deque(maxlen=60)
    timed_out = threading.Event()

    def watchdog() -> None:
        if _wait(proc, timeout) is None:
            timed_out.set()
            _kill_session(proc)

    if timeout is not None:
        threading.Thread(target=watchdog, daemon=True).start()
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            text = line.rstrip("\n")
            if tag and on_line is not None and tag in text:
                on_line(text[text.index(tag) + len(tag):].strip())
            else:
                tail.append(text)
        rc = proc.wait()
    except BaseException:  # KeyboardInterrupt: take the ranks down with us
        _kill_session(proc)
        raise
    if timed_out.is_set():
        raise LaunchError(f"{module} on {nproc} ranks did not finish within {timeout:g} s (killed):\n" + "\n".join(tail))
    if rc != 0:
        raise LaunchError(f"{module} on {nproc} ranks failed (exit {rc}):\n" + "\n".join(tail))


def _wait(proc: subprocess.Popen, timeout: float | None) -> int | None:
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        return None


def _kill_session(proc: subprocess.Popen) -> None:
    """Kill the launcher and every process below it, then its session.

    torchrun starts each rank in a session of its own, so the launcher's session alone is not the
    whole tree: the descendants are found through ``/proc`` (parent links) while the launcher is
    stopped, so that none is re-parented out of sight or started after the snapshot.
    """
    tree = [proc.pid]
    try:
        os.kill(proc.pid, signal.SIGSTOP)  # spawns nothing more while the tree is read
    except (ProcessLookupError, PermissionError):
        pass
    for _ in range(5):  # a child forked between two reads is found by the next
        found = [p for p in _descendants(proc.pid) if p not in tree]
        if not found:
            break
        for pid in found:
            try:
                os.kill(pid, signal.SIGSTOP)
            except (ProcessLookupError, PermissionError):
                pass
        tree += found
    for pid in reversed(tree):  # the leaves first
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    deadline = time.monotonic() + 10
    while proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)


def _descendants(root: int) -> list[int]:
    """Every live process below ``root`` (Linux ``/proc``; elsewhere none are found and the session kill is all)."""
    children: dict[int, list[int]] = collections.defaultdict(list)
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for name in entries:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children[ppid].append(int(name))
    out, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), ()):
            out.append(child)
            todo.append(child)
    return out


def init_from_env(device: str | torch.device | None = None, timeout_s: float = 300.0) -> tuple[int, int, torch.device]:
    """On a rank torchrun started: init the default process group; returns (rank, world size, device)."""
    import datetime

    import torch.distributed as dist

    local = int(os.environ.get("LOCAL_RANK", "0"))
    dev = torch.device(device) if device is not None else torch.device("cpu")
    if dev.type == "cuda":
        dev = torch.device("cuda", local)
        torch.cuda.set_device(dev)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if dev.type == "cuda" else "gloo", timeout=datetime.timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size(), dev


def emit(tag: str, payload: Any) -> None:
    """Print one line the parent's ``on_line`` receives (rank 0 only)."""
    import json

    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_rank() == 0:
        print(f"{tag} {json.dumps(payload)}", flush=True)
