"""The memory planner's arithmetic: the seed's 7B figure, bytes per parameter per recipe, parsing."""

from __future__ import annotations

import subprocess
import sys

import pytest
from mixprec._env import KEEP_LIMIT_BYTES
from mixprec_test_env import src_env

from mixprec.memory import (
    OPTIMIZER_STATE_BYTES, ParamCounts, StorageFacts, TransformerShape, activation_bytes, facts_from_recipe,
    parse_count, plan,
)
from mixprec.recipes import get_recipe


def test_seven_billion_params_with_adamw_need_56_gb_of_optimizer_state():
    # the seed: "For a 7B parameter model, FP32 optimizer states for Adam consume about 56GB"
    for recipe in ("fp32", "bf16-mixed", "bf16-true", "bf16-true-sr"):
        p = plan(ParamCounts(7_000_000_000), facts_from_recipe(get_recipe(recipe)), "adamw")
        assert p.bytes["optimizer state"] == 7e9 * 2 * 4 == 56e9


# persistent (weights + masters + optimizer state) and peak bytes per parameter with AdamW and no
# activations, every parameter stored the recipe's way, for a model of one bucket:
#   fp32        4 + 0 + 8 = 12; peak + 4 fp32 grads                          = 16
#   bf16-mixed  4 + 0 + 8 = 12; peak + 4 grads + 2 autocast copies            = 18
#   bf16-true   2 + 4 + 8 = 14; peak + max(2 bf16 grads, 4 fp32 master grads) = 18
#   kahan       2 + 2 + 8 = 12; peak + 8 at the step (fp32 grad and value)    = 20
#   remainder   2 + 2 + 8 = 12; peak + 8                                      = 20
#   sr, pure    2 + 0 + 8 = 10; peak + 8                                      = 18
# Without a loss scaler the 16-bit storage recipes step one bucket (2**24 parameters) at a time
# and make a bucket's fp32 gradients only in its turn: for a large model their step holds the
# 16-bit gradients (2) of the other buckets plus one bucket's fp32 gradient (4), rebuilt value (4,
# the compact strategies) and temporaries. fp16-true has a loss scaler: fp32 gradients for all.
@pytest.mark.parametrize(
    "recipe, persistent, peak, large",
    [("fp32", 12, 16, 16), ("bf16-mixed", 12, 18, 18), ("bf16-true", 14, 18, 16), ("fp16-true", 14, 18, 16),
     ("bf16-true-kahan", 12, 20, 14), ("bf16-true-remainder", 12, 20, 14), ("bf16-true-sr", 10, 18, 12),
     ("bf16-pure", 10, 18, 12)],
)
def test_bytes_per_parameter_by_recipe(recipe, persistent, peak, large):
    facts = facts_from_recipe(get_recipe(recipe))
    p = plan(ParamCounts(1000), facts, "adamw")
    # plus, at the step, the temporaries of one bucket of the master-weight step (here the whole model)
    temps = 1000 * facts.step_temp_bytes
    assert (p.persistent / 1000, p.peak / 1000) == (persistent, peak + temps / 1000 if temps else peak)
    big = plan(ParamCounts(7_000_000_000), facts, "adamw")  # a bucket is 2**24 parameters at most
    bucket = min(7_000_000_000, facts.bucket_numel)
    if facts.defers_grads:
        per_bucket = facts.step_bytes + facts.step_value_bytes + facts.step_temp_bytes
        step = 7_000_000_000 * persistent + (7_000_000_000 - bucket) * 2 + bucket * per_bucket
        assert big.peak == step and round(big.peak / 7e9) == large
    else:
        assert big.peak == 7_000_000_000 * peak + bucket * facts.step_temp_bytes


def test_compact_strategies_lower_the_peak_of_a_large_model_below_fp32_masters():
    # what the bucketed step buys: 7B parameters, AdamW, no activations
    peaks = {r: plan(ParamCounts(7_000_000_000), facts_from_recipe(get_recipe(r)), "adamw").peak / 1e9
             for r in ("bf16-true", "bf16-true-kahan", "bf16-true-sr")}
    assert peaks["bf16-true-sr"] < peaks["bf16-true-kahan"] < peaks["bf16-true"]
    assert round(peaks["bf16-true"]) == 112 and round(peaks["bf16-true-sr"]) == 84


@pytest.mark.parametrize("optimizer, state", [("adamw", 8), ("adam", 8), ("sgd", 0), ("sgd-momentum", 4),
                                              ("adagrad", 4), ("rmsprop", 4)])
def test_optimizer_state_bytes_per_parameter(optimizer, state):
    p = plan(ParamCounts(10), facts_from_recipe(get_recipe("bf16-true")), optimizer)
    assert p.bytes["optimizer state"] == 10 * state
    assert OPTIMIZER_STATE_BYTES[optimizer] == state


def test_unknown_optimizer_lists_the_known_ones():
    with pytest.raises(ValueError, match="adamw, adam, sgd, sgd-momentum, adagrad, rmsprop"):
        plan(ParamCounts(10), StorageFacts("x", 4, 4), "lion")


def test_fp32_kept_parameters_are_counted_at_4_bytes_without_masters():
    p = plan(ParamCounts(1000, fp32_kept=100), facts_from_recipe(get_recipe("bf16-true")), "sgd")
    assert p.bytes["weights"] == 900 * 2 + 100 * 4
    assert p.bytes["masters"] == 900 * 4
    assert p.bytes["step-time fp32"] == 900 * 4


def test_activation_formula_for_a_gpt_block():
    # t = 2 * 8 = 16 tokens, h = 32, 4 heads: per layer 16*32*(14*2 + 2*4) + 16*16 + 4*8*16*2 = 19712
    # head (vocab 10): 16*32*(4+2) + 16*10*4 + 16*16 + 8*16 = 4096; two layers: 2*19712 + 4096
    shape = TransformerShape(batch=2, seq=8, d_model=32, layers=2, heads=4, vocab=10)
    assert activation_bytes(shape, facts_from_recipe(get_recipe("bf16-mixed"))) == 2 * 19712 + 4096
    flash = TransformerShape(2, 8, 32, 2, 4, 10, attention="flash")
    assert activation_bytes(flash, facts_from_recipe(get_recipe("bf16-mixed"))) == 2 * (19712 - 1024 + 256) + 4096


def test_bf16_compute_halves_the_compute_dtype_activations_of_fp32():
    shape = TransformerShape(4, 128, 256, 2, 8)
    fp32 = activation_bytes(shape, facts_from_recipe(get_recipe("fp32")))
    bf16 = activation_bytes(shape, facts_from_recipe(get_recipe("bf16-true")))
    assert 0.5 < bf16 / fp32 < 0.6  # the fp32 residual stream and norm inputs stay


@pytest.mark.parametrize("text, value", [("7e9", 7_000_000_000), ("7B", 7_000_000_000), ("125M", 125_000_000),
                                         ("1_000", 1000), ("1.5k", 1500)])
def test_parse_count_reads_common_spellings(text, value):
    assert parse_count(text) == value


def test_parse_count_says_what_it_expected():
    with pytest.raises(ValueError, match="7e9, 7B, 125M"):
        parse_count("seven")


def test_bad_shape_and_counts_are_refused():
    with pytest.raises(ValueError, match="heads >= 1"):
        TransformerShape(1, 1, 1, 1, 0)
    with pytest.raises(ValueError, match="fp32_kept <= total"):
        ParamCounts(10, fp32_kept=11)


def test_the_planner_module_does_not_import_torch():
    code = "import sys, mixprec.memory; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=src_env())
    assert out.stdout.strip() == "False"


def test_cuda_autocast_keeps_fp32_softmax_probabilities_and_their_16_bit_cast():
    cpu, cuda = (facts_from_recipe(get_recipe("bf16-mixed"), d) for d in ("cpu", "cuda"))
    assert (cpu.prob_bytes, cuda.prob_bytes) == (None, 6)
    assert facts_from_recipe(get_recipe("fp32"), "cuda").prob_bytes is None  # fp32: 4 B either way
    shape = TransformerShape(batch=2, seq=8, d_model=16, layers=3, heads=2)
    eager_probs = shape.layers * shape.heads * shape.seq * (shape.batch * shape.seq)
    assert activation_bytes(shape, cuda) - activation_bytes(shape, cpu) == eager_probs * (6 - 2)
    flash = TransformerShape(batch=2, seq=8, d_model=16, layers=3, heads=2, attention="flash")
    assert activation_bytes(flash, cuda) == activation_bytes(flash, cpu)


def test_a_tensor_larger_than_a_bucket_is_planned_as_a_bucket_of_its_own():
    facts = facts_from_recipe(get_recipe("bf16-true-sr"))
    head = 32000 * 4096  # an untied LM head: above 2**24 elements
    bare = plan(ParamCounts(7_000_000_000), facts, "adamw")
    known = plan(ParamCounts(7_000_000_000, largest=head), facts, "adamw")
    # no loss scaler: a bucket's fp32 gradients and values (8 B) are made in its turn, beside the
    # other buckets' 16-bit gradients (2 B)
    assert bare.bytes["step-time fp32"] == facts.bucket_numel * 8
    assert known.bytes["step-time fp32"] == head * 8
    assert known.peak - bare.peak == (head - facts.bucket_numel) * (8 + facts.step_temp_bytes - 2)
    assert any("bucket of its own" in n for n in bare.notes) and not any("planned in buckets" in n for n in known.notes)


def test_accumulation_adds_fp32_accumulators_for_16bit_storage_only():
    n = 7_000_000_000
    for recipe, extra in (("bf16-mixed", 0), ("bf16-true", 4), ("bf16-true-sr", 4)):
        facts = facts_from_recipe(get_recipe(recipe))
        one, acc = plan(ParamCounts(n), facts, "adamw"), plan(ParamCounts(n), facts, "adamw", accumulate=8)
        assert acc.bytes["fp32 grad accumulators"] == n * extra and one.bytes["fp32 grad accumulators"] == 0
        assert acc.forward_backward == one.forward_backward + n * extra
        assert acc.persistent == one.persistent
    # the compact strategies no longer defer: the step's fp32 gradients are the accumulators
    sr = facts_from_recipe(get_recipe("bf16-true-sr"))
    acc = plan(ParamCounts(n), sr, "adamw", accumulate=2)
    assert acc.bytes["step-time fp32"] == n * 4 + sr.bucket_numel * 4
    # (+ what the step keeps between steps on a CPU by default: one bucket's 8 B, capped at 64 MiB)
    kept = min(sr.bucket_numel * sr.kept_bytes, KEEP_LIMIT_BYTES)
    assert acc.peak == acc.persistent + max(acc.forward_backward, acc.step) and acc.forward_backward == n * 6 + kept
    assert any("accumulators" in note for note in acc.notes)
    with pytest.raises(ValueError, match="accumulate must be an integer >= 1"):
        plan(ParamCounts(n), sr, "adamw", accumulate=0)
