"""Hugging Face models with tied embeddings under ``parallel="fsdp"`` (2 gloo ranks), against one process.

GPT-2's default config ties ``wte`` and ``lm_head``; FSDP2 lets a parameter belong to one group
only, so the modules sharing it are one group (gathered in fp32, as one process holds an
embedding; autocast still computes ``lm_head`` in 16 bits). GPT-2's blocks are HF ``Conv1D``s, an
``addmm``: gathered in the compute dtype like ``nn.Linear``.

Each case trains one SGD step on the same global batch (``hf_workers.py``). What is held:

- every parameter that is not tied: bitwise the one-process one (each rank computes what one
  process computes on its micro-batch; the two ranks' sum is exact), fp16 recipes at the same
  loss scale (the one-process reference backpropagates loss/2 at twice the scale);
- a tied parameter: its gradient is a sum over its uses and the micro-batches, which autograd and
  FSDP2 may add in another order. Two orders of a sum of m terms differ by at most
  2 gamma_(m-1) sum|terms| (gamma_k = k u / (1 - k u), u = 2**-24); the terms are measured on a copy
  with the ties cut; the update lr * g then rounds once on each side (``worst``: the largest
  difference over that bound);
- T5 under the fp16 recipes is the exception: every parameter differs from one process by about
  one fp16 rounding of its gradient (the same at ATEN_CPU_CAPABILITY=default, and without
  resharding; with ``lm_head`` untied most of it goes). The cause was not found; it is held to
  4 u_fp16 (2**-11) of each tensor's update, and docs/distributed.md says so.
"""

import pytest

from dist_helpers import HERE, spawn

transformers = pytest.importorskip("transformers")

MODELS = ("gpt2", "llama", "t5")
RECIPES = ("bf16-mixed", "fp16-mixed", "bf16-true", "fp16-true")
DEFAULT = ("gpt2/bf16-mixed",)
SLOW = tuple(f"{m}/{r}" for m in MODELS for r in RECIPES if f"{m}/{r}" not in DEFAULT)
U, U16 = 2.0**-24, 2.0**-11


def _spawn(cases, out):
    return spawn(",".join(cases), out, script=HERE / "hf_workers.py", timeout=600)


@pytest.fixture(scope="module")
def hf_default(tmp_path_factory):
    return _spawn(DEFAULT, tmp_path_factory.mktemp("dist-hf"))


@pytest.fixture(scope="module")
def hf_slow(tmp_path_factory):
    return _spawn(SLOW, tmp_path_factory.mktemp("dist-hf-slow"))


def _check(ranks, case):
    model, recipe = case.split("/")
    loose = model == "t5" and recipe.startswith("fp16")
    for rank in ranks:
        r = rank[case]
        assert r["fsdp"]["loss"] == r["one"]["loss"]
        assert not r["fsdp"]["skipped"] and not r["one"]["skipped"]
        assert r["fsdp"]["groups"][0] == ["", "fp32"]  # the tie group first (gathered in fp32)
        for name, cell in r["cells"].items():
            if loose:
                assert cell["max_diff"] <= 4 * U16 * cell["update"] + 2 * U * cell["size"], (name, cell)
            elif name in r["tied"]:
                assert cell["worst"] <= 1.0, f"{name}: {cell['worst']:.2f}x the reassociation bound"
            else:
                assert cell["max_diff"] == 0.0, f"{name} differs from one process by {cell['max_diff']}"
        compute = "bfloat16" if recipe.startswith("bf16") else "float16"
        seen = r["fsdp"]["seen"]
        assert seen["lm_head"] == "float32"  # tied: gathered as one process holds it; autocast casts for the matmul
        if model == "gpt2":  # HF Conv1D: gathered in 16 bits (was fp32: twice the bytes)
            assert seen["transformer.h.0.attn.c_attn"] == seen["transformer.h.0.mlp.c_fc"] == compute
            assert seen["transformer.wte"] == "float32"


@pytest.mark.parametrize("case", DEFAULT)
def test_tied_gpt2_trains_under_fsdp_like_one_process(hf_default, case):
    _check(hf_default, case)


@pytest.mark.slow
@pytest.mark.parametrize("case", SLOW)
def test_tied_hf_models_train_under_fsdp_like_one_process(hf_slow, case):
    _check(hf_slow, case)


# ---------------------------------------------------------------------------- the grouping, on one process


def _gpt2():
    cfg = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=96, n_positions=16)
    return transformers.GPT2LMHeadModel(cfg)


def test_the_modules_sharing_a_parameter_are_found():
    from mixprec.distributed.fsdp import tied

    assert tied(_gpt2()) == [["transformer.wte", "lm_head"]]
    t5 = transformers.T5ForConditionalGeneration(transformers.T5Config(d_model=16, d_ff=32, d_kv=4, num_layers=1,
                                                                       num_heads=2, vocab_size=32))
    assert tied(t5) == [["shared", "encoder.embed_tokens", "decoder.embed_tokens", "lm_head"]]
    untied = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, vocab_size=32))
    assert tied(untied) == []


@pytest.mark.parametrize("recipe", ["bf16-mixed", "bf16-true"])
def test_hf_conv1d_is_a_matmul_module_and_gathers_in_the_compute_dtype(recipe):
    from mixprec.distributed.fsdp import fp32_modules, is_matmul
    from mixprec.recipes import get_recipe

    model = _gpt2()
    conv = [n for n, m in model.named_modules() if type(m).__name__ == "Conv1D"]
    assert conv and all(is_matmul(model.get_submodule(n)) for n in conv)
    r = get_recipe(recipe)
    fp32 = fp32_modules(model, r, r.fp32_params)
    assert not set(conv) & fp32  # compute: 16-bit all-gathers
    assert {"transformer.wte", "transformer.h.0.ln_1", "transformer.ln_f"} <= fp32
