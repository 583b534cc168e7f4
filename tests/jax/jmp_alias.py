"""A pytest plugin (``-p jmp_alias``) that makes ``from jmp._src import policy, loss_scale`` import
mixprec.jax's modules, so jmp's own test files run against them unchanged."""

import sys
import types

import mixprec.jax.loss_scale as loss_scale
import mixprec.jax.policy as policy

_jmp = types.ModuleType("jmp")
_src = types.ModuleType("jmp._src")
_src.policy, _src.loss_scale = policy, loss_scale
_jmp._src = _src
sys.modules.update({"jmp": _jmp, "jmp._src": _src, "jmp._src.policy": policy, "jmp._src.loss_scale": loss_scale})
