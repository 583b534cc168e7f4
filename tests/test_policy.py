"""Policy and jmp's string grammar."""

import collections

import pytest
import torch

from mixprec import Policy, get_policy

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16


@pytest.mark.parametrize(
    "text,expected",
    [
        ("p=f32,c=bf16,o=f32", (F32, BF16, F32)),
        ("params=float32,compute=bfloat16,output=float32", (F32, BF16, F32)),
        ("c=f16", (F32, F16, F16)),  # params default f32, output defaults to compute
        ("p=bf16", (BF16, BF16, BF16)),  # compute defaults to params
        ("bf16", (BF16, BF16, BF16)),  # no '=': one dtype for all
        ("half", (F16, F16, F16)),
        (" p = f32 , c = bf16 ", (F32, BF16, BF16)),
    ],
)
def test_jmp_grammar_and_defaults(text, expected):
    p = get_policy(text)
    assert (p.param_dtype, p.compute_dtype, p.output_dtype) == expected


def test_str_round_trips_in_jmp_short_names():
    p = get_policy("params=float32,compute=bfloat16,output=float32")
    assert str(p) == "p=f32,c=bf16,o=f32" and get_policy(str(p)) == p


@pytest.mark.parametrize(
    "text,match",
    [
        ("p=f32,c=bf61", "Unknown dtype 'bf61' in policy 'p=f32,c=bf61'; expected one of"),
        ("p=f32,x=bf16", "Unknown key 'x' in policy"),
        ("p=f32,bf16", "Malformed part 'bf16'"),
        ("p=f32,p=bf16", "Key 'p' given twice"),
        ("", "Empty policy string"),
    ],
)
def test_bad_policies_name_the_bad_token_and_what_is_allowed(text, match):
    with pytest.raises(ValueError, match=match):
        get_policy(text)


def test_casts_only_floating_tensors_and_keeps_containers():
    Pair = collections.namedtuple("Pair", "a b")
    p = get_policy("p=f32,c=bf16,o=f32")
    tree = {"x": torch.ones(2), "i": torch.arange(3), "flag": torch.tensor(True), "n": 3, "s": "txt", "t": Pair(torch.ones(1), 1.5)}
    out = p.cast_to_compute(tree)
    assert out["x"].dtype == BF16 and out["i"].dtype == torch.int64 and out["flag"].dtype == torch.bool
    assert out["n"] == 3 and out["s"] == "txt" and isinstance(out["t"], Pair) and out["t"].b == 1.5
    assert out["t"].a.dtype == BF16
    assert p.cast_to_output(out)["x"].dtype == F32
    assert p.cast_to_param([torch.ones(1, dtype=F16)])[0].dtype == F32


def test_policy_is_frozen_and_accepts_names():
    p = Policy("f32", "bf16", "f32")
    assert p.compute_dtype == BF16
    with pytest.raises(Exception):
        p.compute_dtype = F16  # type: ignore[misc]
    assert p.with_output_dtype("bf16").output_dtype == BF16


def _prepared(module):
    from mixprec.policy import PreparedForward

    module.forward = PreparedForward(module, F32)
    return module


def test_the_prepared_output_cast_rebuilds_plain_containers_and_leaves_the_models_own_alone():
    class Returns(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.held = {"h": torch.ones(2, dtype=BF16), "ids": torch.arange(2)}

        def forward(self):
            return self.held

    m = _prepared(Returns())
    out = m()
    assert out is not m.held and out["h"].dtype == F32 and out["ids"].dtype == torch.int64
    assert m.held["h"].dtype == BF16  # a dict the model keeps is not cast in place
    assert _prepared(torch.nn.Identity())(torch.ones(2, dtype=BF16)).dtype == F32


def test_a_model_output_is_cast_in_place_keeping_its_type_and_its_other_entries():
    pytest.importorskip("transformers")
    from transformers.modeling_outputs import CausalLMOutputWithPast

    class LM(torch.nn.Module):
        def forward(self):
            h = (torch.ones(1, dtype=BF16), torch.ones(1, dtype=BF16))
            return CausalLMOutputWithPast(loss=torch.tensor(1.0), logits=torch.ones(2, dtype=BF16), hidden_states=h)

    out = _prepared(LM())()
    assert type(out) is CausalLMOutputWithPast and out.logits.dtype == F32 and out["logits"].dtype == F32
    assert [t.dtype for t in out.hidden_states] == [F32, F32] and out.past_key_values is None
    assert out.loss.dtype == F32 and list(out.keys()) == ["loss", "logits", "hidden_states"]


def test_a_recipe_name_given_as_a_policy_says_where_its_policy_is():
    # found by a probe: get_policy("bf16-mixed") listed dtype names only
    with pytest.raises(ValueError, match=r"'bf16-mixed' is a recipe, not a policy: its policy is "
                                         r"mixprec\.get_recipe\('bf16-mixed'\)\.policy"):
        get_policy("bf16-mixed")
    with pytest.raises(ValueError) as e:
        get_policy("bogus")
    assert "recipe" not in str(e.value)
