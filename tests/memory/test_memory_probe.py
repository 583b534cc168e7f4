"""Probes of ``mixprec memory``: the plan of a pure recipe's activations, and arguments that plan nothing."""

from __future__ import annotations

import pytest

from mixprec.cli import main
from mixprec.memory import TransformerShape, facts_from_recipe, plan
from mixprec.memory.measure import measure_step
from mixprec.recipes import get_recipe
from mixprec.tasks import load_task

CONFIG = dict(batch_size=4, seq_len=32, d_model=64, n_layer=2, n_head=4)
SHAPE = TransformerShape(batch=4, seq=32, d_model=64, layers=2, heads=4, vocab=96)


@pytest.mark.parametrize("recipe", ["fp16-pure", "bf16-pure"])
def test_a_pure_recipes_activations_match_one_measured_step(recipe):
    # fp16-pure keeps the residual stream and the norms in fp16 (no islands, fp16 embeddings): its norm
    # inputs are 2 bytes, not the 4 of every other recipe (planned so, it was 10% over on this model).
    # Within 1%, as the other recipes (tests/memory/test_memory_measure.py says what the formula leaves out).
    measured = measure_step(load_task(None, **CONFIG), recipe, "adamw", "cpu")
    p = plan(measured.counts, facts_from_recipe(get_recipe(recipe)), "adamw", SHAPE)
    assert measured.bytes["activations"] == pytest.approx(p.bytes["activations"], rel=0.01)


def test_the_shipped_facts_say_fp16_pure_norms_are_16_bit():
    from mixprec.memory import recipe_facts

    assert recipe_facts.FACTS[("fp16-pure", "cpu")]["norm_bytes"] == 2
    assert recipe_facts.FACTS[("bf16-pure", "cpu")]["norm_bytes"] == 4  # its norms and embeddings stay fp32


def test_a_negative_vocabulary_is_refused():
    with pytest.raises(ValueError, match="vocab >= 0"):
        TransformerShape(batch=1, seq=4, d_model=8, layers=1, heads=2, vocab=-5)


@pytest.mark.parametrize("argv, message", [
    (["--params", "7B", "--recipe", ""], "names no recipe"),
    (["--params", "7B", "--recipe", ","], "names no recipe"),
    (["--params", "7B", "--recipe", "", "--json"], "names no recipe"),
    (["--params", "7B", "--recipe", "fp32", "--batch", "1", "--seq", "4", "--d-model", "8", "--layers", "1",
      "--heads", "2", "--vocab", "-5"], "vocab >= 0"),
    (["--params", "7B", "--vocab", "32000"], "--vocab 32000 is part of the activation estimate"),  # else ignored
    (["--params", "7B", "--attention", "flash"], "--attention flash is part of the activation estimate"),  # else ignored
])
def test_arguments_that_plan_nothing_exit_2_with_one_line(argv, message, capsys):
    assert main(["memory", *argv]) == 2
    captured = capsys.readouterr()
    assert message in captured.err and "Traceback" not in captured.err and captured.out == ""
