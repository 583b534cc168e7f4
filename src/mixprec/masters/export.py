"""The fp32 export of a prepared model: what the same model trained in fp32 would save.

``mp.fp32_state_dict(model)`` is the state dict (the masters' fp32 values in place of 16-bit
weights, tied names sharing one tensor, buffers a pure recipe stored in 16 bits cast back up);
``mp.save_pretrained(model, dir)`` writes it with a Hugging Face model's own ``save_pretrained``
and a ``config.json`` that says ``"dtype": "float32"``, so ``from_pretrained(dir)`` loads it in
fp32 exactly. (transformers writes the dtype of the model's first parameter into the config and
loads every tensor in that dtype: a model whose first weight is stored in bf16 would reload in bf16,
its fp32 values rounded, with no word said.)
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from typing import Any

import torch
from torch import nn

_SIXTEEN = (torch.float16, torch.bfloat16)


def fp32_state_dict(mp: Any, model: nn.Module) -> dict[str, Any]:
    """``model.state_dict()`` in fp32 (see the module docstring)."""
    if mp.masters is None:
        out = {k: v.detach() for k, v in model.state_dict().items()}
    else:
        out = mp.masters.fp32_state_dict()
    if mp.recipe.pure:  # prepare stored the floating buffers in 16 bits too: an fp32 model holds them in fp32
        made: dict[int, torch.Tensor] = {}
        for key, value in out.items():
            if isinstance(value, torch.Tensor) and value.dtype in _SIXTEEN:
                out[key] = made.setdefault(id(value), value.to(torch.float32))
    return out


def save_pretrained(mp: Any, model: nn.Module, save_directory: str | os.PathLike, **kwargs: Any) -> None:
    """Write ``model`` (prepared by ``mp``) to ``save_directory`` as an fp32 Hugging Face model:
    its ``save_pretrained`` with the fp32 state dict, the config's ``dtype`` set to float32 (its
    sub-configs' too), each written file checked against the state dict before it replaces the old
    one in ``save_directory`` (other files there, a tokenizer's, stay). ``kwargs`` go to the model's
    ``save_pretrained`` (``max_shard_size``, ``variant``, ``is_main_process``...)."""
    if mp._dist is not None:
        if mp._dist.mode != "ddp":
            raise ValueError(
                f"mp.save_pretrained writes a whole model from one process; this one is sharded "
                f"({mp._dist.mode}). Save a sharded run with mixprec.distributed.save_checkpoint, or gather "
                "the model's full state dict first.")
        model = mp._dist.local_module(model)
    if not callable(getattr(model, "save_pretrained", None)) or getattr(model, "config", None) is None:
        raise TypeError(
            f"mp.save_pretrained needs a Hugging Face model (one with save_pretrained and a config); got a "
            f"{type(model).__name__}. For any other module save the fp32 state dict: "
            "torch.save(mp.fp32_state_dict(model), path)")
    for refused, why in (("state_dict", "mp.save_pretrained writes the fp32 state dict; for another one call "
                                        "model.save_pretrained(dir, state_dict=...) yourself"),
                         ("push_to_hub", "save to a folder, then upload it (huggingface_hub.upload_folder)")):
        if kwargs.get(refused) or (refused == "state_dict" and refused in kwargs):
            raise ValueError(f"mp.save_pretrained does not take {refused}=: {why}")
    if getattr(model, "_mixprec_recipe", None) is None:
        raise ValueError("mp.save_pretrained exports a prepared model: call model = mp.prepare(model) first, "
                         "or, for a model never prepared, model.save_pretrained(dir)")
    state = fp32_state_dict(mp, model)
    target = os.fspath(save_directory)
    if os.path.isfile(target):
        raise ValueError(f"save_directory {target!r} is a file; give a folder (it is made if missing)")
    parent = os.path.dirname(os.path.abspath(target))
    os.makedirs(parent, exist_ok=True)
    aside = tempfile.mkdtemp(prefix=f".{os.path.basename(os.path.abspath(target))}.mixprec-", dir=parent)
    try:
        _write(model, state, aside, kwargs)
        written = _check_written(aside, state)
        _publish(aside, target, written)
    finally:
        shutil.rmtree(aside, ignore_errors=True)


def _configs(config: Any) -> list[Any]:
    subs = [getattr(config, k, None) for k in getattr(config, "sub_configs", {}) or {}]
    return [config, *(c for c in subs if c is not None)]


def _write(model: nn.Module, state: dict[str, Any], folder: str, kwargs: dict[str, Any]) -> None:
    configs = _configs(model.config)  # type: ignore[arg-type]
    before = [getattr(c, "dtype", None) for c in configs]
    try:
        # a copy: save_pretrained empties the dict it is given as it writes the shards
        model.save_pretrained(folder, state_dict=dict(state), **kwargs)  # type: ignore[operator]
        # transformers wrote the dtype of the model's first parameter; the tensors it wrote are fp32
        for c in configs:
            c.dtype = torch.float32
        model.config.save_pretrained(folder)  # type: ignore[union-attr]
    finally:  # the live model's config says what it said before
        for c, d in zip(configs, before):
            c.dtype = d


def _check_written(folder: str, state: dict[str, Any]) -> list[str]:
    """The files written, after checking that every floating tensor in them is fp32, that those under
    a state dict key hold its value bit for bit (transformers may write some under their original
    names: ViT's q_proj as attention.query), and that the config says float32 (raises before
    anything is published)."""
    from safetensors.torch import load_file  # a transformers dependency

    files = sorted(os.listdir(folder))
    shards = [f for f in files if f.endswith(".safetensors")]
    if not shards:
        raise RuntimeError(f"save_pretrained wrote no .safetensors file (wrote {files}); nothing was published")
    for shard in shards:
        for key, value in load_file(os.path.join(folder, shard)).items():
            want = state.get(key)
            sixteen = value.is_floating_point() and value.dtype != torch.float32
            if sixteen or (isinstance(want, torch.Tensor) and (want.dtype != value.dtype or not torch.equal(want.cpu(), value))):
                raise RuntimeError(
                    f"the fp32 export wrote {key!r} in {shard} as {value.dtype}, not the fp32 state dict's value; "
                    "nothing was published (please report this)")
    with open(os.path.join(folder, "config.json")) as f:
        dtype = json.load(f).get("dtype")
    if dtype != "float32":
        raise RuntimeError(f"config.json says dtype {dtype!r}, not 'float32'; nothing was published")
    return files


def _publish(aside: str, target: str, files: list[str]) -> None:
    """Move the written files into ``target`` as one set, config.json last: the old files of those
    names, and weight files of an earlier save that this one did not write, are first moved into
    ``aside`` (config.json first), the new ones renamed in (the weights first, config.json last). A
    failure or a Ctrl-C part-way takes the new ones out and puts the old ones back, so ``target`` holds
    the old save whole or the new one, never new shards under an old config or index; the old files
    go with ``aside`` when the caller removes it."""
    os.makedirs(target, exist_ok=True)
    order = sorted(files, key=lambda f: (f == "config.json", f))
    for name in order:
        if os.path.isdir(os.path.join(target, name)):
            raise IsADirectoryError(f"{os.path.join(target, name)} is a directory, where save_pretrained writes a "
                                    "file; nothing was published")
    stem = {_WEIGHTS.sub("", f) for f in files if _WEIGHTS.search(f)}  # "model", or "model.<variant>"
    stale = sorted(n for n in os.listdir(target)
                   if n not in files and _WEIGHTS.search(n) and _WEIGHTS.sub("", n) in stem)
    old = os.path.join(aside, ".mixprec-old")  # (no name save_pretrained writes)
    os.makedirs(old)
    moved: list[str] = []
    placed: list[str] = []
    try:
        for name in [*reversed(order), *stale]:  # config.json first: no complete old save from here
            if os.path.isfile(os.path.join(target, name)):
                os.replace(os.path.join(target, name), os.path.join(old, name))
                moved.append(name)
        for name in order:
            os.replace(os.path.join(aside, name), os.path.join(target, name))
            placed.append(name)
    except BaseException:  # Ctrl-C too: the old save goes back
        for name in placed:
            try:
                os.remove(os.path.join(target, name))
            except OSError:
                pass
        for name in moved:
            try:
                os.replace(os.path.join(old, name), os.path.join(target, name))
            except OSError:
                pass
        raise


# a weights file save_pretrained writes: model.safetensors, model-00001-of-00002.safetensors, the index
_WEIGHTS = re.compile(r"(-\d{5}-of-\d{5})?\.safetensors(\.index\.json)?$")
