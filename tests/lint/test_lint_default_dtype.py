"""MP106 for a model built while ``torch.set_default_dtype`` (or ``set_default_tensor_type``) makes new tensors
16-bit: its parameters are 16-bit with no cast in sight, and an optimizer over them keeps no fp32 masters."""

from __future__ import annotations

import textwrap

from mixprec.lint import lint_source


def hits(source: str) -> list[tuple[int, str]]:
    return [(f.line, f.message) for f in lint_source(textwrap.dedent(source)) if f.code == "MP106"]


def test_a_model_built_under_a_16_bit_default_dtype_and_trained_is_reported():
    found = hits("""
    import torch

    torch.set_default_dtype(torch.bfloat16)
    model = Transformer(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    """)
    assert len(found) == 1 and found[0][0] == 4
    assert "torch.set_default_dtype(torch.bfloat16)" in found[0][1] and "model is built under it (line 5)" in found[0][1]


def test_the_tensor_type_spellings_and_a_run_time_dtype():
    for spelling in ("torch.set_default_tensor_type(torch.cuda.HalfTensor)",
                     "torch.set_default_tensor_type('torch.cuda.HalfTensor')", "torch.set_default_dtype(torch.half)"):
        assert [line for line, _ in hits(f"""
        import torch

        {spelling}
        net = Net()
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        """)] == [4], spelling
    found = hits("""
    import torch

    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.precision]
    torch.set_default_dtype(dtype)
    net = Net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    """)
    assert len(found) == 1 and "when dtype is 16-bit" in found[0][1]


def test_the_pattern_of_building_in_16_bits_inside_a_loader_then_resetting_is_reported():
    # the model is built while the default is bf16; resetting it afterwards does not change its parameters
    found = hits("""
    import torch

    def main():
        torch.set_default_dtype(torch.bfloat16)
        model = Transformer.from_name(name)
        torch.set_default_dtype(torch.float32)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        train(model, optimizer)
    """)
    assert [line for line, _ in found] == [5]


def test_clean_when_the_model_is_built_in_fp32_or_cast_back_or_never_trained():
    sources = [
        # reset before the model is built
        """
        import torch
        torch.set_default_dtype(torch.bfloat16)
        table = torch.zeros(4)
        torch.set_default_dtype(torch.float32)
        model = Net()
        opt = torch.optim.AdamW(model.parameters())
        """,
        # built before the default changed
        """
        import torch
        model = Net()
        torch.set_default_dtype(torch.bfloat16)
        opt = torch.optim.AdamW(model.parameters())
        """,
        # cast back to fp32, rebound or in place
        """
        import torch
        torch.set_default_dtype(torch.bfloat16)
        model = Net()
        model = model.float()
        opt = torch.optim.AdamW(model.parameters())
        """,
        """
        import torch
        torch.set_default_dtype(torch.float16)
        model = Net()
        model.to(torch.float32)
        opt = torch.optim.AdamW(model.parameters())
        """,
        # an inference helper elsewhere sets it; training builds its model in fp32
        """
        import torch

        def generate(prompt):
            torch.set_default_dtype(torch.bfloat16)
            lm = Transformer()
            return lm(prompt)

        def train():
            model = Net()
            opt = torch.optim.AdamW(model.parameters())
        """,
        # no optimizer: inference only
        """
        import torch
        torch.set_default_dtype(torch.bfloat16)
        model = Transformer()
        out = model(x)
        """,
        # a library that keeps fp32 masters itself
        """
        import torch
        import deepspeed
        torch.set_default_dtype(torch.bfloat16)
        model = Net()
        opt = torch.optim.AdamW(model.parameters())
        """,
    ]
    for source in sources:
        assert hits(source) == [], source
