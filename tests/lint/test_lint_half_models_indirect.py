"""MP106 for casts that do not look like ``model.half()``: per parameter in a loop, through ``model.apply``,
inside a helper of the file (OpenAI CLIP's ``convert_weights`` shape), and OpenAI CLIP's ``clip.load``, which
returns fp16 weights off the CPU (openai/CLIP#57: fine-tuning it with Adam as loaded does not train)."""

from __future__ import annotations

import textwrap

from mixprec.lint import lint_source


def hits(source: str) -> list[tuple[int, str]]:
    return [(f.line, f.message) for f in lint_source(textwrap.dedent(source)) if f.code == "MP106"]


def test_a_loop_that_casts_each_parameter_or_module():
    found = hits("""
    import torch

    model = Net()
    for p in model.parameters():
        p.data = p.data.to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters())

    enc = Encoder()
    for name, m in enc.named_modules():
        if isinstance(m, torch.nn.Linear):
            m.half()
    opt2 = torch.optim.AdamW(enc.parameters())
    """)
    assert [line for line, _ in found] == [6, 12]
    assert all("cast to 16 bits one by one" in m for _, m in found)


def test_apply_with_a_casting_function_and_a_helper_that_applies_it():
    found = hits("""
    import torch
    from torch import nn

    def convert_weights(model: nn.Module):
        def _convert_weights_to_fp16(l):
            if isinstance(l, (nn.Conv1d, nn.Conv2d, nn.Linear)):
                l.weight.data = l.weight.data.half()
                if l.bias is not None:
                    l.bias.data = l.bias.data.half()
        model.apply(_convert_weights_to_fp16)

    net = build_model(state_dict)
    convert_weights(net)
    opt = torch.optim.AdamW(net.parameters())

    small = Net()
    small.apply(lambda m: m.bfloat16())
    opt2 = torch.optim.SGD(small.parameters(), lr=0.1)
    """)
    assert [line for line, _ in found] == [14, 18]
    assert "net is cast to 16 bits by convert_weights" in found[0][1]
    assert "small is cast to 16 bits by small.apply" in found[1][1]


def test_clip_load_returns_fp16_weights_except_on_the_cpu():
    found = hits("""
    import clip
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model, preprocess = clip.load("ViT-B/32", device=device, jit=False)
    optimizer = torch.optim.Adam(model.parameters(), lr=5e-5)
    """)
    assert [line for line, _ in found] == [6] and "loaded with fp16 weights by clip.load" in found[0][1]


def test_clean_when_cast_back_before_the_optimizer_or_not_trained():
    sources = [
        """
        import clip, torch
        model, _ = clip.load("ViT-B/32", device="cpu")
        opt = torch.optim.Adam(model.parameters())
        """,
        """
        import clip, torch
        model, _ = clip.load("ViT-B/32")
        model.float()
        opt = torch.optim.Adam(model.parameters())
        """,
        """
        import torch
        half = Net().half()
        half.float()
        opt = torch.optim.SGD(half.parameters(), lr=0.1)
        """,
        """
        import torch
        model = Net()
        for p in model.parameters():
            p.data = p.data.half()
        out = model(x)
        """,
        """
        import torch
        model = Net()
        for p in model.parameters():
            p.requires_grad_(False)
            grads = p.data.float()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        """,
        """
        import torch
        model = Net()
        model.apply(init_weights)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        """,
    ]
    for source in sources:
        assert hits(source) == [], source
