"""Every ```python block in docs/bench.md runs, and the fp32-attention island it shows is one."""

import re
from pathlib import Path

import pytest
import torch

DOC = Path(__file__).resolve().parents[2] / "docs" / "bench.md"
BLOCKS = re.findall(r"```python\n(.*?)```", DOC.read_text(encoding="utf-8"), flags=re.S)


def test_the_doc_has_its_examples():
    assert BLOCKS, "docs/bench.md lost its python examples"


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_block_runs(index):
    exec(compile(BLOCKS[index], f"docs/bench.md block {index}", "exec"), {"__name__": "__bench_doc__"})


def test_the_attention_core_runs_in_fp32_inside_bf16_autocast(monkeypatch):
    import torch.nn.functional as F

    from mixprec.islands import island_names

    scope: dict = {"__name__": "__bench_doc__"}
    island = next(b for b in BLOCKS if "class AttentionCore" in b)
    exec(compile(island, "docs/bench.md island block", "exec"), scope)
    model, mp = scope["model"], scope["mp"]
    assert "core" in island_names(model)
    seen = {}
    real = F.scaled_dot_product_attention

    def sdpa(q, k, v, **kw):  # what the product itself is given (the island casts inside its forward)
        seen.update(q=q.dtype, autocast=torch.is_autocast_enabled("cpu"))
        return real(q, k, v, **kw)

    monkeypatch.setattr(F, "scaled_dot_product_attention", sdpa)
    hooks = [model.core.register_forward_hook(lambda m, args, out: seen.update(core=out.dtype)),
             model.proj.register_forward_hook(lambda m, args, out: seen.update(proj=out.dtype))]
    with mp.autocast():
        model(torch.randn(2, 16, 64))
    for h in hooks:
        h.remove()
    # inside the island: fp32 in, autocast off; what leaves it is bf16 again, and the projection after it runs in bf16
    assert seen == {"q": torch.float32, "autocast": False, "core": torch.bfloat16, "proj": torch.bfloat16}
