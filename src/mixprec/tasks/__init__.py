"""The task protocol: what ``mixprec compare`` and ``mixprec doctor`` need to train your model.

A task factory is a function, named as ``"package.module:function"``, that returns a ``Task``::

    def make_task() -> mixprec.tasks.Task:
        return Task(
            name="my-mlp",
            build_model=lambda: MyModel(),           # a fresh fp32 model; called after seeding
            get_batch=lambda step: (x[step], y[step]),  # the same batch for a step in every run
            loss_fn=torch.nn.functional.cross_entropy,  # (outputs, targets) -> scalar loss
        )

The runner seeds torch before ``build_model``, moves batches to the device, and trains with
``MixedPrecision``. ``get_batch`` must not depend on global random state: every recipe must see
the same data.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import nn


def _default_optimizer(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-3)


@dataclasses.dataclass
class Task:
    """A model, its data and its loss, as ``compare`` and ``doctor`` consume them.

    Attributes:
        name: shown in reports.
        build_model: returns a fresh fp32 ``nn.Module`` on the CPU; called after ``torch.manual_seed``.
        get_batch: ``step -> (inputs, targets)``; deterministic in ``step``. Tensors (or nests of them)
            on the CPU; the runner moves them to the device.
        loss_fn: ``(outputs, targets) -> scalar loss``.
        build_optimizer: ``params -> optimizer`` (default AdamW, lr 1e-3).
        steps: default number of optimizer steps for a comparison.
        max_grad_norm: clip at this norm (None: no clipping).
        forward: ``(model, inputs) -> outputs`` (default ``model(inputs)``).
        description: one line for reports.
    """

    name: str
    build_model: Callable[[], nn.Module]
    get_batch: Callable[[int], tuple[Any, Any]]
    loss_fn: Callable[[Any, Any], torch.Tensor]
    build_optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer] = _default_optimizer
    steps: int = 200
    max_grad_norm: float | None = 1.0
    forward: Callable[[nn.Module, Any], Any] | None = None
    description: str = ""

    def run_forward(self, model: nn.Module, inputs: Any) -> Any:
        return self.forward(model, inputs) if self.forward is not None else model(inputs)


class TaskError(ValueError):
    """A task path or factory that cannot be used; the message says what to do."""


def to_device(obj: Any, device: torch.device) -> Any:
    """Move tensors in a nest of lists/tuples/named tuples/mappings to ``device``.

    A mapping keeps its type where its constructor takes a dict (a Hugging Face ``BatchEncoding``, an
    ``OrderedDict``), else it becomes a dict; a named tuple stays that named tuple."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device, non_blocking=True)
    if isinstance(obj, Mapping):
        moved = {k: to_device(v, device) for k, v in obj.items()}
        if type(obj) is dict:
            return moved
        try:
            return type(obj)(moved)
        except Exception:  # a mapping type that cannot be rebuilt from a dict: its contents, moved
            return moved
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # a named tuple takes its fields as arguments
        return type(obj)(*(to_device(v, device) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_device(v, device) for v in obj)
    return obj


BUILTIN = "mixprec.tasks.charlm:make_task"
#: Tasks shipped with mixprec, by short name (``--task fragile``): the default, and one where unsafe
#: recipes visibly fail (``mixprec.tasks.fragile``).
BUILTINS = {"charlm": BUILTIN, "fragile": "mixprec.tasks.fragile:make_task"}


def load_task(spec: str | Task | Callable[..., Task] | None = None, **kwargs: Any) -> Task:
    """Resolve a task: None (the built-in char-level GPT), a ``Task``, a factory, ``"module:function"``,
    or the short name of a built-in task (``BUILTINS``: ``"charlm"``, ``"fragile"``).

    Keyword arguments go to the factory. Raises ``TaskError`` with what went wrong and how to fix it.
    """
    if isinstance(spec, Task):
        return spec
    if spec is None:
        spec = BUILTIN
    if isinstance(spec, str):
        spec = BUILTINS.get(spec, spec)
    task, label = call_factory(spec, kwargs, "a task", "a Task")
    if not isinstance(task, Task):
        raise TaskError(
            f"task factory {label} returned {type(task).__name__}, expected mixprec.tasks.Task "
            "(with build_model, get_batch and loss_fn); see 'mixprec compare --help'"
        )
    for field in ("build_model", "get_batch", "loss_fn", "build_optimizer"):
        if not callable(getattr(task, field)):
            raise TaskError(f"task {task.name!r} from {label}: {field} must be callable")
    if not isinstance(task.steps, int) or task.steps < 1:
        raise TaskError(f"task {task.name!r} from {label}: steps must be a positive integer, got {task.steps!r}")
    return task


def call_factory(spec: Any, kwargs: dict[str, Any], what: str, ready: str,
                 explain_errors: bool = True) -> tuple[Any, str]:
    """Call the task factory ``spec`` names (``"module:function"`` or a callable) with ``kwargs``:
    (what it returned, its label). Arguments it does not take are a ``TaskError``; with
    ``explain_errors``, so is an error of the factory's own, naming the arguments that went in.
    ``what``/``ready`` name the kind of task in the messages (``"a task"``, ``"a Task"``)."""
    if isinstance(spec, str):
        factory, label = import_factory(spec), spec
    elif callable(spec):
        factory, label = spec, getattr(spec, "__qualname__", repr(spec))
    else:
        raise TaskError(f"{what} is a 'module:function' string, a factory or {ready}; got {type(spec).__name__}")
    try:
        return factory(**kwargs), label
    except TypeError as e:
        if not _accepts(factory, kwargs):
            raise TaskError(f"task factory {label} does not accept arguments {sorted(kwargs)}: {e}") from None
        if not explain_errors:
            raise
        raise _factory_error(label, kwargs, e) from e
    except Exception as e:  # the factory's own code: name it and the arguments that went in (the traceback is the cause)
        if not explain_errors:
            raise
        raise _factory_error(label, kwargs, e) from e


def _factory_error(label: str, kwargs: dict[str, Any], e: Exception) -> TaskError:
    if not kwargs:
        return TaskError(f"task factory {label} raised {type(e).__name__}: {e}")
    given = ", ".join(f"{k}={v!r} ({type(v).__name__})" for k, v in kwargs.items())
    return TaskError(
        f"task factory {label} raised {type(e).__name__} with the arguments {given}: {e}. Check those "
        "values (--task-arg parses Python literals: d_model=64 is an int, d_model=abc a string)"
    )


def _accepts(fn: Callable[..., Any], kwargs: dict[str, Any]) -> bool:
    try:
        inspect.signature(fn).bind(**kwargs)
        return True
    except TypeError:
        return False


def import_factory(spec: str) -> Callable[..., Task]:
    if ":" not in spec:
        raise TaskError(f"task {spec!r} must look like 'package.module:function' (a colon before the function name), "
                        f"or be a built-in task: {', '.join(BUILTINS)}")
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise TaskError(f"task {spec!r} must look like 'package.module:function'")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        raise TaskError(
            f"cannot import module {module_name!r} for task {spec!r} ({e}); is it installed, or on "
            "PYTHONPATH (run from the directory that holds it)?"
        ) from None
    factory = module
    for part in attr.split("."):
        if not hasattr(factory, part):
            raise TaskError(f"module {module_name!r} has no attribute {attr!r} (task {spec!r})")
        factory = getattr(factory, part)
    if not callable(factory):
        raise TaskError(f"{spec!r} is a {type(factory).__name__}, not a function returning a Task")
    return factory  # type: ignore[return-value]


__all__ = ["Task", "TaskError", "load_task", "import_factory", "to_device", "BUILTIN", "BUILTINS"]
