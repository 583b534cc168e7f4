"""The range buffer behind the NaN guard: measurements against direct reductions, its cache, and
the lazily built ranges."""

from __future__ import annotations

import math

import pytest
import torch

from mixprec.diagnostics._stats import Ranges, StatsBuffer, _dense_view
from mixprec.diagnostics.guard import find_producer
from mixprec.diagnostics._trace import Record, _scan


def _direct(t: torch.Tensor) -> tuple[float, float]:
    lo, hi = torch.aminmax(t.detach().contiguous())
    return float(lo), float(hi)


@pytest.mark.parametrize("make", [
    lambda: torch.randn(7, 5),
    lambda: torch.randn(5, 7).t(),                      # a transpose: measured through its dense view
    lambda: torch.randn(2, 3, 4).permute(2, 0, 1),
    lambda: torch.randn(6, 8)[:, ::2],                  # not dense: measured as it is
    lambda: torch.randn(4, 4).to(torch.bfloat16).t(),
    lambda: torch.tensor([[1.0, float("nan")], [3.0, 4.0]]).t(),
    lambda: torch.tensor([[1.0, float("-inf")], [3.0, 4.0]]).t(),
])
def test_ranges_equal_a_direct_reduction_for_any_layout(make):
    t = make()
    buf = StatsBuffer()
    i = buf.add(t)
    r = buf.read()[i]
    lo, hi = _direct(t)
    assert r.dtype == t.dtype and r.shape == tuple(t.shape)
    if math.isnan(lo):
        assert r.nan
    else:
        assert (r.min, r.max) == (lo, hi)


def test_dense_view_reorders_a_transpose_and_leaves_a_strided_slice():
    t = torch.randn(5, 7).t()
    v = _dense_view(t)
    assert v.is_contiguous() and v.data_ptr() == t.data_ptr()
    s = torch.randn(6, 8)[:, ::2]
    assert _dense_view(s) is s


def test_cache_answers_the_same_tensor_once_and_remeasures_after_an_in_place_change():
    buf = StatsBuffer()
    t = torch.tensor([1.0, 2.0])
    a, b = buf.add(t), buf.add(t)
    assert a == b and len(buf) == 1
    t.mul_(10)  # bumps the version counter: a new measurement
    c = buf.add(t)
    assert c != a
    ranges = buf.read()
    assert (ranges[a].max, ranges[c].max) == (2.0, 20.0)
    with torch.inference_mode():  # no version counter: measured every time, never cached
        u = torch.ones(3)
    assert buf.add(u) != buf.add(u)
    assert buf.add(torch.empty(0)) is None


def test_ranges_are_built_lazily_and_index_like_a_list():
    flat = [0.0, 1.0, float("nan"), 2.0, float("-inf"), 3.0, 4.0, float("inf"), -1.0, 1.0]
    meta = [(torch.float32, torch.Size([i + 1])) for i in range(5)]
    r = Ranges(flat, meta)
    assert len(r) == 5 and not r._built
    assert r.nonfinite == {1: (True, False), 2: (False, True), 3: (False, True)}
    assert not r.all_finite and not r._built  # the flags need no range objects
    assert r[-1].min == -1.0 and r[4] is r[-1]
    assert [x.max for x in r[1:3]] == [2.0, 3.0] and r[1].nan
    assert [x.shape for x in r] == [(1,), (2,), (3,), (4,), (5,)]
    with pytest.raises(IndexError):
        r[5]
    assert Ranges([0.0, 1.0], [(torch.float16, torch.Size([]))]).all_finite


def test_find_producer_gives_the_same_answer_from_a_plain_list_of_ranges():
    buf = StatsBuffer()
    x = torch.tensor([0.0, 1.0])
    y = x.log()  # -inf from finite inputs: the producer
    z = y * 2
    recs = [Record("forward", None, "log", None, (buf.add(x),), (buf.add(y),), False, False, None),
            Record("forward", None, "mul", None, (buf.add(y),), (buf.add(z),), False, False, None)]
    ranges = buf.read()
    lazy = find_producer(recs, ranges)
    plain = find_producer(recs, list(ranges))
    assert lazy == plain and lazy[0].op == "log" and lazy[1:] == ("inf", "producer")


def test_scan_finds_float_tensors_in_order_and_the_floats_asked_for():
    a, b, c = torch.ones(1), torch.ones(2), torch.ones(3)
    ints = torch.ones(2, dtype=torch.long)
    tensors, nan, inf = _scan((a, [b, ints, (c, 2.0)]), {"out": torch.ones(4), "value": float("-inf")})
    assert [t.numel() for t in tensors] == [1, 2, 3] and (nan, inf) == (False, True)
    assert _scan((a,), {"out": [float("nan")]})[1:] == (True, False)  # floats under out= still count
    assert _scan((), {}) == ([], False, False)


@pytest.mark.parametrize("make", [
    lambda: torch.randn(7, 5),
    lambda: torch.randn(5, 7).t(),
    lambda: torch.randn(4, 4, dtype=torch.float64),
    lambda: torch.randn(4, 4).to(torch.bfloat16),
    lambda: torch.randn(4, 4).half() * 60000,  # its fp16 2-norm would overflow; the screen sums in fp32
    lambda: torch.tensor([[1.0, float("nan")], [3.0, 4.0]]),
    lambda: torch.tensor([[1.0, float("-inf")], [3.0, 4.0]]),
    lambda: torch.full((3,), 3e38),  # finite, but its 2-norm overflows: measured exactly, still finite
])
def test_lazy_ranges_equal_eager_ones(make):
    t = make()
    eager, lazy = StatsBuffer(), StatsBuffer(lazy=True)
    e, lz = eager.add(t), lazy.add(t)
    assert lazy._lazy and not eager._lazy
    a, b = eager.read(), lazy.read()
    assert a.all_finite == b.all_finite and a.nonfinite == b.nonfinite
    ra, rb = a[e], b[lz]
    assert (ra.nan, ra.inf) == (rb.nan, rb.inf)
    if not ra.nan:
        assert (ra.min, ra.max) == (rb.min, rb.max)


def test_a_lazy_value_forced_before_an_in_place_write_keeps_its_old_range():
    buf = StatsBuffer(lazy=True)
    t = torch.ones(3)
    i = buf.add(t)
    buf.force(t)  # what the tracer does before an in-place op
    t.mul_(float("inf"))
    j = buf.add(t)  # a new version: a new slot
    r = buf.read()
    assert i != j and r[i].finite and r[j].inf


def test_a_lazy_value_changed_behind_the_buffers_back_is_measured_as_it_is_now():
    buf = StatsBuffer(lazy=True)
    t = torch.ones(3)
    i = buf.add(t)
    t.mul_(float("nan"))  # not forced: its version moved
    assert buf.read()[i].nan


def _mixed_batch() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    sizes = [1, 7, 64, 4096, 4097, 20000]
    out = []
    for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
        out += [torch.randn(n, generator=g).to(dtype) for n in sizes]
    out.append(torch.randn(40, 30, generator=g).t())  # small, not contiguous
    return out


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_screen_names_exactly_the_non_finite_tensors_among_small_and_large_of_every_dtype(bad):
    from mixprec.diagnostics._stats import _screen

    batch = _mixed_batch()
    assert _screen(batch) == [True] * len(batch)
    for k in range(len(batch)):  # one bad value in one tensor at a time, small groups and large
        ts = [t.clone() for t in batch]
        ts[k][(-1,) * ts[k].dim()] = bad
        assert _screen(ts) == [i != k for i in range(len(ts))], (k, ts[k].dtype, ts[k].numel())
    ts = [t.clone() for t in batch]
    ts[0][0], ts[1][3] = float("inf"), float("-inf")  # two in one small group: a sum would give NaN
    assert _screen(ts) == [i > 1 for i in range(len(ts))]


def test_screen_counts_an_overflowing_sum_not_finite_and_the_buffer_then_measures_exactly():
    from mixprec.diagnostics._stats import _screen

    big = [torch.full((8,), 3e38) for _ in range(4)]  # finite values whose fp32 sum overflows
    assert not all(_screen(big))
    buf = StatsBuffer(lazy=True)
    idx = [buf.add(t) for t in big]
    ranges = buf.read()
    assert ranges.all_finite
    assert all((ranges[i].min, ranges[i].max) == (float(torch.tensor(3e38)),) * 2 for i in idx)


def test_screen_accumulates_fp16_in_fp32_and_bf16_in_its_own_range():
    from mixprec.diagnostics._stats import _accumulate, _screen

    # fp16 values of 300: the 2-norm (9487 for 1000, 76800 for 65536) or the sum leaves fp16's range,
    # not fp32's; screened in fp16 they would all read as not finite and be measured again, one by one.
    halves = [torch.full((n,), 300.0, dtype=torch.float16) for n in (8, 1000, 5000, 65536)]
    assert _screen(halves) == [True] * 4
    assert _accumulate(torch.float16) == {"dtype": torch.float32}
    assert _accumulate(torch.float32) == _accumulate(torch.bfloat16) == _accumulate(torch.float64) == {}
    # bf16 shares fp32's range: a bf16 norm overflows only where an fp32 one would, and then the
    # buffer measures the tensor exactly.
    big = torch.full((5000,), 1e37, dtype=torch.bfloat16)
    assert _screen([big, torch.ones(5000, dtype=torch.bfloat16)]) == [False, True]
    buf = StatsBuffer(lazy=True)
    i = buf.add(big)
    r = buf.read()
    assert r.all_finite and r[i].max == float(big[0])


def test_lazy_read_gives_finite_ranges_and_measures_the_bad_one_exactly():
    batch = _mixed_batch()
    batch[3][5] = float("nan")
    batch[9][0] = float("-inf")
    buf = StatsBuffer(lazy=True)
    idx = [buf.add(t) for t in batch]
    ranges = buf.read()
    assert set(ranges.nonfinite) == {idx[3], idx[9]}
    assert ranges.nonfinite[idx[3]] == (True, False) and ranges.nonfinite[idx[9]] == (False, True)
    for i, t in zip(idx, batch):  # every range, asked for, is the exact one
        lo, hi = _direct(t)
        if math.isnan(lo):
            assert ranges[i].nan
        else:
            assert (ranges[i].min, ranges[i].max) == (lo, hi)
