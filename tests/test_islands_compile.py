"""fp32 islands under torch.compile, and the autocast state around them."""

import pytest
import torch
from torch import nn

from mixprec.islands import keep_fp32
from mixprec.training import MixedPrecision


class _Probe(nn.Module):
    """Records whether autocast was on while its forward ran, and the dtype it computed in."""

    def __init__(self, fail: bool = False) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.fail = fail
        self.seen: list[tuple[bool, torch.dtype]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        self.seen.append((torch.is_autocast_enabled("cpu"), y.dtype))
        if self.fail:
            raise RuntimeError("boom")
        return y


def test_island_turns_autocast_off_inside_and_back_on_after():
    net = nn.Sequential(nn.Linear(4, 4), _Probe())
    keep_fp32(net, ["1"])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = net(torch.randn(2, 4))
        assert torch.is_autocast_enabled("cpu")
    assert net[1].seen == [(False, torch.float32)]
    assert out.dtype == torch.bfloat16  # handed back in the dtype it received


def test_island_restores_autocast_when_its_module_raises():
    probe = _Probe(fail=True)
    keep_fp32(probe, ["_Probe"])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with pytest.raises(RuntimeError, match="boom"):
            probe(torch.randn(2, 4))
        assert torch.is_autocast_enabled("cpu")


def test_island_outside_autocast_leaves_it_off():
    probe = _Probe()
    keep_fp32(probe, ["_Probe"])
    probe(torch.randn(2, 4))
    assert not torch.is_autocast_enabled("cpu") and probe.seen == [(False, torch.float32)]


@pytest.mark.slow
def test_prepared_model_compiles_into_one_graph_and_matches_eager():
    from mixprec.bench.block import SHAPES, RefBlock, make_batches

    shape = SHAPES["tiny"]
    mp = MixedPrecision("bf16-mixed", "cpu")
    torch.manual_seed(0)
    eager = mp.prepare(RefBlock(shape))
    torch.manual_seed(0)
    model = MixedPrecision("bf16-mixed", "cpu").prepare(RefBlock(shape))
    compiled = torch.compile(model, fullgraph=True)  # fullgraph: an island may not break the graph
    x, _ = make_batches(shape, "cpu", count=1)[0]
    with mp.autocast():
        want, got = eager(x), compiled(x)
    assert got.dtype == want.dtype == torch.float32
    assert torch.equal(got, want)
    got.pow(2).mean().backward()
    want.pow(2).mean().backward()
    for p, q in zip(model.parameters(), eager.parameters()):
        assert torch.allclose(p.grad, q.grad, rtol=1e-2, atol=1e-5)


@pytest.mark.slow
def test_an_island_around_a_matmul_compiles_and_matches_eager():
    # Needs autocast off inside the graph: one graph, no break, on torch 2.11 and 2.13 (2.11's
    # dynamo cannot trace torch.set_autocast_enabled, which an earlier version switched in a hook).
    # (no elementwise op between the layers: inductor may fuse one into a matmul's epilogue and
    # skip a bf16 rounding that eager does, which is not what this test is about)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))
    x = torch.randn(16, 64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        all_bf16 = net(x)
    keep_fp32(net, ["1"])
    compiled = torch.compile(net, fullgraph=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want, got = net(x), compiled(x)
        assert torch.is_autocast_enabled("cpu")
    assert got.dtype == want.dtype == torch.bfloat16
    assert torch.equal(got, want)
    assert not torch.equal(got, all_bf16)  # the island's layer did run in fp32


def test_island_forward_wrapper_keeps_signature_survives_copies_and_is_removed():
    import copy
    import inspect
    import io

    from mixprec.islands import remove_fp32_islands

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8), nn.LayerNorm(8))
    keep_fp32(net, ["1", "norms"])
    assert net[1].__dict__["forward"].autocast_off  # a Linear: autocast must be off inside
    assert not net[2].__dict__["forward"].autocast_off  # a built-in norm: the casts are enough
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in net.modules())  # no hooks: the fast path
    assert list(inspect.signature(net[1].forward).parameters) == ["input"]
    x = torch.randn(4, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = net(x)
    buf = io.BytesIO()
    torch.save(net, buf)
    buf.seek(0)
    for other in (copy.deepcopy(net), torch.load(buf, weights_only=False)):
        assert other[1].forward.module is other[1]
        assert list(inspect.signature(other[1].forward).parameters) == ["input"]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert torch.equal(other(x), want)
    assert remove_fp32_islands(net) == 2
    assert "forward" not in net[1].__dict__ and "forward" not in net[2].__dict__
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert net[1](x).dtype == torch.bfloat16  # autocast lowers it again


def test_island_calls_an_instance_forward_the_module_already_had():
    from mixprec.islands import remove_fp32_islands

    probe = _Probe()
    own = probe.forward  # e.g. set by another library's wrapper
    calls = []

    def patched(x):
        calls.append(x.dtype)
        return own(x)

    probe.forward = patched
    keep_fp32(probe, ["_Probe"])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        probe(torch.randn(2, 4).bfloat16())
    assert calls == [torch.float32] and probe.seen == [(False, torch.float32)]
    remove_fp32_islands(probe)
    assert probe.forward is patched


@pytest.mark.slow
def test_a_storage_recipe_model_compiles_into_one_graph_outside_autocast_too():
    from mixprec.bench.block import SHAPES, RefBlock, make_batches

    shape = SHAPES["tiny"]
    mp = MixedPrecision("bf16-true", "cpu")
    torch.manual_seed(0)
    model = mp.prepare(RefBlock(shape))
    compiled = torch.compile(model, fullgraph=True)  # the autocast forward may not break the graph
    x, _ = make_batches(shape, "cpu", count=1)[0]
    with torch.no_grad():
        want = model(x)  # eager, outside any autocast
        got = compiled(x)
    assert torch.equal(got, want) and got.dtype == torch.float32
