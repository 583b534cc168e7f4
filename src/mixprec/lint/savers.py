"""MP111 across the project: the functions that write checkpoints for their callers.

Two kinds of project function carry a checkpoint away from the code that owns the scaler:

* a *save helper* saves one of its parameters as it is (``def save_on_master(*args, **kw):
  torch.save(*args, **kw)``, ``def save_checkpoint(state, is_best, path): torch.save(state,
  path)``): each call of it is judged as a ``torch.save`` of its argument;
* a *checkpoint writer* builds the dict itself from what it is given and saves it
  (``def save_checkpoint(model, optimizer, lr, it, path): torch.save({"model": ...,
  "optimizer": optimizer.state_dict(), ...}, path)``) with no scaler among its parameters or
  names: a call of it from code that holds a live GradScaler, which it does not pass, writes a
  checkpoint without the scaler.

A checkpointer object in the fvcore/detectron2 style, ``Checkpointer(model, save_dir,
optimizer=optimizer)``, saves exactly the objects it is given: built with the optimizer but not
the scaler, next to a live scaler, it is the same trap. Both are found in the same file or,
through its imports, in the project (see ``workspace``).
"""

from __future__ import annotations

import ast

from mixprec.lint.names import Script, key_of

_CHECKPOINTER_SAFE = frozenset({"optimizer", "scheduler", "save_to_disk", "save_dir", "period", "max_iter"})


def definition_of(script: Script, call: ast.Call):
    """(def node, its Script) for a call of a function of this file or of the project."""
    func = call.func
    if isinstance(func, ast.Name) and func.id not in script.aliases and func.id not in script.relative:
        defs = script.functions.get(func.id, [])
        return (defs[0], script) if len(defs) == 1 else None
    if isinstance(func, ast.Attribute) and key_of(func.value) in ("self", "cls"):
        defs = script.methods.get(func.attr, [])
        return (defs[0], script) if len(defs) == 1 else None
    project = script.project
    if project is None or not isinstance(func, (ast.Name, ast.Attribute)):
        return None
    found = project.definition(script, func)
    if found is None or found.is_class:
        return None
    return found.node, found.script


def saves_in(script: Script, func) -> list[ast.Call]:
    """The ``torch.save`` calls written directly in ``func``'s body."""
    return [c for c in script.calls if script.qualname(c.func) == "torch.save" and c.args and script.owner(c) is func]


def mentions_scaler(script: Script, node: ast.AST) -> bool:
    """Whether ``node`` names a scaler: a known one, or any name or attribute like ``*scal*``."""
    for n in ast.walk(node):
        k = key_of(n) if isinstance(n, (ast.Name, ast.Attribute)) else None
        if k is not None and (script.is_scaler(k) or "scal" in k.rsplit(".", 1)[-1].lower()):
            return True
        if isinstance(n, ast.arg) and "scal" in n.arg.lower():
            return True
    return False


def checkpointer_without_scaler(script: Script, call: ast.Call) -> bool:
    """``*Checkpointer(model, dir, optimizer=opt)`` given nothing that could carry a scaler."""
    func = call.func
    name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
    if not name.endswith("Checkpointer") or not any(kw.arg == "optimizer" for kw in call.keywords):
        return False
    if any(kw.arg is None or kw.arg not in _CHECKPOINTER_SAFE for kw in call.keywords):
        return False  # trainer=..., **checkpointables: may carry the scaler
    return not any(mentions_scaler(script, a) for a in (*call.args, *(kw.value for kw in call.keywords)))
