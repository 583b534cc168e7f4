"""What runs fastest on this machine, measured once and remembered: the choices ``auto`` makes on a CPU.

A CPU's flags say what it can do, not what is faster: AMX makes bf16 matmuls several times
faster, yet torch's bf16 attention kernel is slower than its fp32 one there (docs/bench.md). So
``auto`` measures:

- **bf16 autocast or fp32** (``compute_choice``): a Linear the size of the reference block's MLP
  (512 x 256 -> 1024), forward and backward, under bf16 autocast (the weight's cast included) and
  in fp32, interleaved. bf16-mixed when it is at least ``MIN_GAIN`` faster, else fp32.
- **attention under bf16 autocast** (``attention_choice``, for ``Recipe.attention="fastest"``,
  which ``auto`` sets): ``F.scaled_dot_product_attention`` forward and backward in bf16, or in fp32
  on fp32 copies of q, k, v (what ``mixprec.attention`` runs), per attention shape (batch and
  sequence lengths rounded up to powers of two), the first time a prepared model meets that shape.

**The cache.** A JSON file, ``$MIXPREC_CACHE_DIR/autotune.json`` (default
``$XDG_CACHE_HOME/mixprec``, else ``~/.cache/mixprec``). Each entry is keyed by the machine (CPU
model, its SIMD flags, torch's CPU kernel level, torch version, torch threads; the GPU's name and
capability on CUDA) and by what was measured: another torch, another thread count or another CPU
measures again, it never reuses a number taken elsewhere. Each entry names the version of the
measuring method (``METHOD``): an entry of another method, or of none, is measured again with one
warning, never reused. Writes go to a temporary file in the same
directory, then replace the cache (``os.replace``: atomic; a process killed mid-write leaves the old
file). A file that is not valid JSON, or not this schema, is ignored with one warning (and replaced
at the next write), never a crash; so is an entry whose times are not positive numbers (measured
again). A cache that cannot be written is said once, and ``mp.recipe.reason`` says "not cached".
Two processes measuring at once each write a whole file (the last one wins; an entry the other
wrote meanwhile may be lost, and is measured again at its next use). A measurement taken while the machine is busier than it has CPUs
(the 1-minute load average) decides for that process only and is not cached: on a shared machine
it may measure the others more than this one. Each arm's time is its fastest of several
interleaved rounds (interference only adds time). ``MIXPREC_AUTOTUNE=off`` measures nothing (``auto`` then follows
the CPU's flags and says so in its reason); ``=refresh`` measures again and overwrites.
"""

from __future__ import annotations

import json
import os
import platform
import time
import uuid
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from mixprec._files import write_aside

SCHEMA = 1
# The version of the measuring method (the workloads of ``measure_compute``/``measure_attention`` and
# ``_timeit``'s rule). Bump it whenever either changes what a number means: an entry of another method
# (or of none: written before entries carried one) is measured again, with a note, never reused.
METHOD = 2
ENV_DIR, ENV_MODE = "MIXPREC_CACHE_DIR", "MIXPREC_AUTOTUNE"
MODES = ("on", "off", "refresh")
MIN_GAIN = 1.05  # a choice other than the plain one must win by this much (noise, and the casts it adds)
MAX_ENTRIES = 1000
# CPU features that decide 16-bit matmul speed on x86 (the /proc/cpuinfo flag names)
FEATURES = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_fp16", "amx_int8")


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_features() -> list[str]:
    """The ``FEATURES`` this CPU reports (empty where /proc/cpuinfo is not there)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = set(next((line for line in f if line.startswith("flags")), "").split())
    except OSError:
        return []
    return [f for f in FEATURES if f in flags]


def machine_key(device: torch.device) -> str:
    """What a measurement depends on: another value of any part is another machine."""
    parts = [device.type, cpu_name(), ",".join(cpu_features()) or "-", torch.backends.cpu.get_cpu_capability(),
             f"torch {torch.__version__}", f"threads {torch.get_num_threads()}"]
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        parts += [torch.cuda.get_device_name(index), "sm_%d%d" % torch.cuda.get_device_capability(index)]
    return " | ".join(parts)


def mode() -> str:
    value = os.environ.get(ENV_MODE, "on").strip().lower() or "on"
    if value not in MODES:
        raise ValueError(f"{ENV_MODE}={value!r} is not one of {', '.join(MODES)}: 'on' measures once and caches, "
                         "'off' measures nothing ('auto' then follows the CPU's flags), 'refresh' measures again")
    return value


def cache_path() -> Path:
    """Absolute: a relative ``MIXPREC_CACHE_DIR`` is taken from the working directory once, not per
    call; a relative ``XDG_CACHE_HOME`` is ignored (the XDG spec's rule), as it would follow the cwd."""
    xdg = os.environ.get("XDG_CACHE_HOME")
    if not xdg or not os.path.isabs(xdg):
        xdg = os.path.join(os.path.expanduser("~"), ".cache")
    base = os.path.expanduser(os.environ.get(ENV_DIR) or "") or os.path.join(xdg, "mixprec")
    return Path(os.path.abspath(base)) / "autotune.json"


_WARNED: set[tuple[str, str]] = set()  # (read / write, path): each problem said once
_MEMO: dict[tuple[str, str, str], dict[str, Any]] = {}  # (path, machine, what) -> entry, this process


def _read(path: Path) -> dict[str, Any]:
    """The cache's entries; an unreadable or foreign file is empty (with one warning)."""
    try:
        text = path.read_bytes()
    except (FileNotFoundError, NotADirectoryError):
        return {}
    except OSError as e:
        why = f"cannot be read ({e})"
    else:
        try:
            data = json.loads(text)
        except ValueError as e:
            why = f"is not valid JSON ({e})"
        else:
            if isinstance(data, dict) and data.get("schema") == SCHEMA and isinstance(data.get("entries"), dict):
                return data["entries"]
            why = f"is not a mixprec autotune cache of schema {SCHEMA}"
    if ("read", str(path)) not in _WARNED:
        _WARNED.add(("read", str(path)))
        warnings.warn(f"mixprec: ignoring the autotune cache {path}: it {why}; measuring again (the file is "
                      "replaced at the next write)", RuntimeWarning, stacklevel=4)
    return {}


def _write(path: Path, entries: dict[str, Any]) -> None:
    """Write aside, then replace: a reader never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps({"schema": SCHEMA, "entries": entries}, indent=1, sort_keys=True)
    write_aside(path, lambda f: f.write(text.encode("utf-8")), tmp_name=f".autotune-{uuid.uuid4().hex[:8]}.tmp")


def _positive(v: Any, finite: bool = True) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 and (not finite or v != float("inf"))


def _valid(result: Any, keys: dict[str, bool]) -> bool:
    """Does a cached ``result`` hold every key of ``keys`` as a time in seconds (> 0; finite where
    ``keys`` says True)? A hand-edited or foreign entry that does not is measured again."""
    return isinstance(result, dict) and all(_positive(result.get(k), finite) for k, finite in keys.items())


def lookup(what: str, device: torch.device, measure: Callable[[], dict[str, Any]],
           keys: dict[str, bool] | None = None) -> tuple[dict[str, Any], str]:
    """The cached result of ``measure`` for ``what`` on this machine, measuring (and caching) it
    when there is none; and where it came from ("cached", "measured", or why it was not cached).
    A cached entry whose result lacks a time of ``keys`` (name -> must be finite) is measured again,
    with one warning: a decision is never taken from a number that is not one."""
    path, machine = cache_path(), machine_key(device)
    key = f"{machine} || {what}"
    refresh = mode() == "refresh"
    hit = None if refresh else _MEMO.get((str(path), machine, what))
    if hit is None and not refresh:
        hit = _read(path).get(key)
        if hit is not None and not (isinstance(hit, dict) and _valid(hit.get("result"), keys or {})):
            if ("entry", str(path)) not in _WARNED:
                _WARNED.add(("entry", str(path)))
                warnings.warn(f"mixprec: ignoring a malformed entry of the autotune cache {path} ({what}: "
                              f"{str(hit)[:120]}); measuring again (the entry is replaced)", RuntimeWarning, stacklevel=4)
            hit = None
        if hit is not None and hit.get("method") != METHOD:
            if ("method", str(path)) not in _WARNED:
                _WARNED.add(("method", str(path)))
                warnings.warn(f"mixprec: the autotune cache {path} holds {what!r} measured by "
                              f"{_method_name(hit.get('method'))}; this mixprec measures by method {METHOD}, "
                              "so it measures again (the entry is replaced)", RuntimeWarning, stacklevel=4)
            hit = None
    if isinstance(hit, dict) and "result" in hit:
        _MEMO[(str(path), machine, what)] = hit
        return hit["result"], "cached"
    result = measure()
    entry = {"result": result, "method": METHOD, "measured": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "load": _load()}
    _MEMO[(str(path), machine, what)] = entry
    if entry["load"] is not None and entry["load"] > (os.cpu_count() or 1):
        # more runnable processes than CPUs: a number taken now may say more about the others than
        # about this machine, and a cached one would decide every later run. Used here, not kept.
        return result, f"measured on a busy machine (load {entry['load']:.1f} on {os.cpu_count()} CPUs), not cached"
    try:
        entries = {k: v for k, v in _read(path).items() if isinstance(v, dict)}  # (a foreign entry goes)
        entries[key] = entry
        if len(entries) > MAX_ENTRIES:  # the oldest go first
            for old in sorted(entries, key=lambda k: str(entries[k].get("measured")))[:len(entries) - MAX_ENTRIES]:
                del entries[old]
        _write(path, entries)
    except OSError as e:  # a read-only home: the choice holds for this process, and is said
        if ("write", str(path)) not in _WARNED:
            _WARNED.add(("write", str(path)))
            warnings.warn(f"mixprec: cannot write the autotune cache {path} ({e}); the measurement holds for this "
                          f"process only. Set {ENV_DIR} to a writable directory.", RuntimeWarning, stacklevel=3)
        return result, f"not cached: cannot write {path} ({e.strerror or e})"
    return result, "measured"


def _method_name(method: Any) -> str:
    return "an older method (the entry names none)" if method is None else f"method {str(method)[:20]}"


def _load() -> float | None:
    try:
        return float(os.getloadavg()[0])
    except (OSError, AttributeError):  # not on this platform
        return None


# ---------------------------------------------------------------- measurements


def _timeit(arms: dict[str, Callable[[], None]], device: torch.device, rounds: int = 9, budget_s: float = 0.5
            ) -> dict[str, float]:
    """The fastest seconds per call of each arm over interleaved rounds (the order rotated each
    round); stops early (3 rounds at least) when the budget is spent. The minimum, not the
    median: other processes only ever add time, so the least disturbed round is the truest."""
    names = list(arms)
    for fn in arms.values():  # warm-up: kernels chosen, memory allocated
        fn()
    times: dict[str, list[float]] = {n: [] for n in names}
    start = time.perf_counter()
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            arms[name]()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times[name].append(time.perf_counter() - t0)
        if r >= 2 and time.perf_counter() - start > budget_s:
            break
    return {n: min(v) for n, v in times.items()}


def measure_compute(device: torch.device) -> dict[str, Any]:
    """A Linear 512 x 256 -> 1024, forward and backward: under bf16 autocast and in fp32."""
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(512, 256, device=device, generator=g, requires_grad=True)
    w = torch.randn(1024, 256, device=device, generator=g, requires_grad=True)
    dy = torch.randn(512, 1024, device=device, generator=g)

    def fp32() -> None:
        torch.nn.functional.linear(x, w).backward(dy)
        x.grad = w.grad = None

    def bf16() -> None:
        with torch.autocast(device.type, dtype=torch.bfloat16):
            y = torch.nn.functional.linear(x, w)
        y.backward(dy.bfloat16())
        x.grad = w.grad = None

    with torch.enable_grad(), torch._C.DisableTorchFunction():
        try:
            t = _timeit({"fp32": fp32, "bf16": bf16}, device)
        except RuntimeError as e:  # a build whose bf16 kernels cannot run here: fp32 it is, and said
            return {"fp32_s": _timeit({"fp32": fp32}, device)["fp32"], "bf16_s": float("inf"),
                    "bf16_error": f"{type(e).__name__}: {str(e)[:200]}", "workload": "linear 512x256->1024 fwd+bwd"}
    return {"fp32_s": t["fp32"], "bf16_s": t["bf16"], "workload": "linear 512x256->1024 fwd+bwd"}


def measure_attention(sig: tuple, device: torch.device) -> dict[str, Any]:
    """SDPA forward and backward at the shape ``sig`` describes (``attention.signature``): in its
    16-bit dtype, and on fp32 copies of q, k, v cast back (as ``mixprec.attention`` runs it)."""
    dtype_name, batch, heads, kv_heads, tq, tk, e, ev, causal, mask, dropout, gqa = sig
    dtype = getattr(torch, dtype_name)
    g = torch.Generator(device=device).manual_seed(0)

    def make(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=device, generator=g).to(dtype).requires_grad_()

    q, k, v = make(batch, heads, tq, e), make(batch, kv_heads, tk, e), make(batch, kv_heads, tk, ev)
    dy = torch.randn(batch, heads, tq, ev, device=device, generator=g).to(dtype)
    attn_mask = None
    if mask == "bool":
        attn_mask = torch.ones(tq, tk, dtype=torch.bool, device=device).tril()
    elif mask == "float":
        attn_mask = torch.zeros(tq, tk, dtype=dtype, device=device)
    opts = {"is_causal": causal, "enable_gqa": gqa}
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def low() -> None:
        sdpa(q, k, v, attn_mask=attn_mask, **opts).backward(dy)
        q.grad = k.grad = v.grad = None

    def fp32() -> None:
        m = attn_mask.float() if attn_mask is not None and attn_mask.is_floating_point() else attn_mask
        sdpa(q.float(), k.float(), v.float(), attn_mask=m, **opts).to(dtype).backward(dy)
        q.grad = k.grad = v.grad = None

    with torch.enable_grad(), torch.autocast(device.type, enabled=False), torch._C.DisableTorchFunction():
        try:
            t = _timeit({dtype_name: low, "fp32": fp32}, device)
        except RuntimeError as e:  # a CPU build whose 16-bit kernel cannot run here (avx2 torch on AMX)
            return {"low_s": float("inf"), "fp32_s": _timeit({"fp32": fp32}, device)["fp32"],
                    "low_error": f"{type(e).__name__}: {str(e)[:200]}"}
    return {"low_s": t[dtype_name], "fp32_s": t["fp32"], "dropout_measured_as": 0.0 if dropout else None}


# Tests replace these to inject measurements (and count them).
MEASURE: dict[str, Callable[..., dict[str, Any]]] = {"compute": measure_compute, "attention": measure_attention}


# ---------------------------------------------------------------- decisions


def compute_choice(device: torch.device) -> tuple[str, str] | None:
    """("bf16-mixed" or "fp32", why) for ``auto`` on this CPU; None when measuring is off."""
    if mode() == "off":
        return None
    res, how = lookup("compute: bf16 autocast vs fp32, linear 512x256->1024 fwd+bwd", device,
                      lambda: MEASURE["compute"](device), keys={"fp32_s": True, "bf16_s": False})
    gain = res["fp32_s"] / res["bf16_s"]
    choice = "bf16-mixed" if gain >= MIN_GAIN else "fp32"
    where = f"cache: {cache_path()}" if how in ("measured", "cached") else how
    if res.get("bf16_error"):
        return "fp32", f"bf16 autocast could not run here ({res['bf16_error']}) ({where})"
    return choice, (f"bf16 autocast {'measured earlier' if how == 'cached' else 'measured'} {gain:.2f}x as fast "
                    f"as fp32 on a 512x256x1024 linear, forward and backward, at {torch.get_num_threads()} thread(s) "
                    f"({where})")


def attention_choice(sig: tuple, device: torch.device) -> str:
    """"fp32" or "recipe" (the recipe's 16-bit attention) for an attention shape: whichever this
    machine runs faster, measured (and cached) the first time. With measuring off: "recipe"."""
    if mode() == "off":
        return "recipe"
    res, _ = lookup(f"attention: sdpa {sig}", device, lambda: MEASURE["attention"](sig, device),
                    keys={"low_s": False, "fp32_s": True})
    return "fp32" if res["low_s"] / res["fp32_s"] >= MIN_GAIN else "recipe"


def cpu_auto(get_recipe: Callable[[str], Any], support: tuple[bool, str]) -> Any:
    """``auto``'s recipe on a CPU: bf16-mixed (with attention "fastest") where bf16 autocast is
    measured faster than fp32, else fp32; from the CPU's flags only when measuring is off."""
    import dataclasses

    has_bf16, found = support
    measured = compute_choice(torch.device("cpu"))
    if measured is None:
        name = "bf16-mixed" if has_bf16 else "fp32"
        why = f"{found}; {ENV_MODE}=off, so chosen from the CPU's flags, not measured"
    else:
        name, why = measured[0], f"{found}; {measured[1]}"
    extra = {"attention": "fastest"} if name == "bf16-mixed" else {}
    return dataclasses.replace(get_recipe(name), reason=f"auto: {why}", **extra)
