"""``mixprec memory --world-size N --parallel fsdp|ddp``: the per-rank plan against a measured 2-rank CPU run."""

import json
import subprocess
import sys

import pytest

from mixprec.memory import ParamCounts, facts_from_recipe, plan
from mixprec.memory.measure import count_params
from mixprec.recipes import get_recipe
from mixprec.tasks import charlm
from mixprec_test_env import src_env

# the worker's task (workers.TASK on 2 ranks)
TASK = charlm.make_task(batch_size=4, seq_len=16, d_model=32, n_layer=2, n_head=4)
PERSISTENT = ("weights", "masters", "optimizer state", "gradients", "step-time fp32")


def _tensors(recipe):
    model = TASK.build_model()
    return model, count_params(model, get_recipe(recipe))


@pytest.mark.parametrize("mode", ["fsdp", "ddp"])
@pytest.mark.parametrize("recipe", ["bf16-mixed", "bf16-true"])
def test_the_per_rank_plan_matches_a_measured_two_rank_step(match_run, mode, recipe):
    model, counts = _tensors(recipe)
    p = plan(counts, facts_from_recipe(get_recipe(recipe)), "adamw", world_size=2, parallel=mode)
    tensors = list(model.parameters())
    # what the plan cannot know: FSDP2 pads dimension 0 of each tensor to a multiple of the world
    # size (at most one row of each per rank), and AdamW keeps a 4-byte step count per tensor
    pad = sum(t[0].numel() * 4 for t in tensors) if mode == "fsdp" else 0
    slack = {"weights": pad, "gradients": pad, "optimizer state": 2 * pad + 4 * len(tensors)}
    for rank in match_run:
        got = rank["memory"][f"{mode}/{recipe}"]["bytes"]
        for comp in PERSISTENT:
            assert 0 <= got[comp] - p.bytes[comp] <= slack.get(comp, 0), (comp, got[comp], p.bytes[comp])


def test_fsdp_divides_what_persists_by_the_world_size_and_not_the_compute_copies():
    counts = ParamCounts(7_000_000_000)
    one = plan(counts, facts_from_recipe(get_recipe("bf16-mixed")), "adamw")
    four = plan(counts, facts_from_recipe(get_recipe("bf16-mixed")), "adamw", world_size=4, parallel="fsdp")
    assert four.bytes["optimizer state"] * 4 == one.bytes["optimizer state"] == 56e9
    assert four.bytes["weights"] * 4 == one.bytes["weights"] and four.bytes["gradients"] * 4 == one.bytes["gradients"]
    assert four.bytes["autocast weight copies"] == one.bytes["autocast weight copies"]
    true4 = plan(counts, facts_from_recipe(get_recipe("bf16-true")), "adamw", world_size=4, parallel="fsdp")
    assert true4.bytes["masters"] == 0 and true4.bytes["weights"] == 7e9  # the fp32 shards are the masters
    ddp = plan(counts, facts_from_recipe(get_recipe("bf16-mixed")), "adamw", world_size=4, parallel="ddp")
    assert ddp.bytes == one.bytes


def test_the_memory_command_plans_per_rank():
    out = subprocess.run([sys.executable, "-m", "mixprec", "memory", "--params", "7B", "--recipe", "bf16-mixed",
                          "--world-size", "8", "--parallel", "fsdp", "--json"], capture_output=True, text=True,
                         env=src_env(), timeout=120)
    assert out.returncode == 0, out.stderr
    p = json.loads(out.stdout)["plans"][0]
    assert p["bytes"]["optimizer state"] == 7e9 * 8 / 8 and p["world_size"] == 8 and p["parallel"] == "fsdp"
    bad = subprocess.run([sys.executable, "-m", "mixprec", "memory", "--params", "7B", "--parallel", "fsdp"],
                         capture_output=True, text=True, env=src_env(), timeout=120)
    assert bad.returncode == 2 and "--world-size" in bad.stderr


def test_no_fsdp_plan_is_made_for_a_recipe_prepare_refuses_under_fsdp(capsys):
    from mixprec.cli import main
    from mixprec.distributed.fsdp import unsupported
    from mixprec.recipes import list_recipes

    refused = [r.name for r in list_recipes() if unsupported(r)]
    assert "bf16-true-kahan" in refused and "fp16-pure" in refused
    with pytest.raises(ValueError, match="no FSDP2 plan for recipe 'bf16-true-kahan'"):
        plan(ParamCounts(10**9), facts_from_recipe(get_recipe("bf16-true-kahan")), "adamw", world_size=8,
             parallel="fsdp")
    assert plan(ParamCounts(10**9), facts_from_recipe(get_recipe("bf16-true-kahan")), "adamw", world_size=8,
                parallel="ddp").recipe == "bf16-true-kahan"  # DDP runs it
    assert main(["memory", "--params", "7B", "--recipe", "all", "--world-size", "8", "--parallel", "fsdp",
                 "--json"]) == 0
    captured = capsys.readouterr()
    planned = [p["recipe"] for p in json.loads(captured.out)["plans"]]
    assert planned and not set(planned) & set(refused) and "bf16-true" in planned
    assert f"not planned under --parallel fsdp (prepare(parallel='fsdp') refuses them): {', '.join(refused)}" \
        in captured.err
