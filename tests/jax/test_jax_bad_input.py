"""Bad input on the JAX side, as a new user gives it: each a clear error that says what to do (exit 2 for the
CLI), or the right thing done. Table-driven, as tests/test_bad_input.py is for the torch side."""

import pytest

pytest.importorskip("jax.numpy")  # a submodule, not "jax": see conftest
pytest.importorskip("optax")

import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

import mixprec.jax as mpj  # noqa: E402
from mixprec.cli import main  # noqa: E402

# (argv, expected exit code, a fragment of the message on stderr); every case fails before any training
CLI_CASES = [
    (["compare", "--backend", "jax", "--task-arg", "d_embed=abc", "--out", ""], 2,
     "d_embed must be a positive integer, got 'abc'"),
    (["compare", "--backend", "jax", "--task-arg", "lr=-1", "--out", ""], 2, "lr must be a number > 0, got -1"),
    (["compare", "--backend", "jax", "--task", "fragile", "--out", ""], 2,
     "'fragile' is a built-in torch task and has no JAX version"),
    (["compare", "--backend", "jax", "--task", "charlm", "--out", ""], 2, "has no JAX version"),
    (["compare", "--backend", "jax", "--task", "nosuchtask", "--out", ""], 2, "must name a factory as 'package.module:function'"),
    (["compare", "--backend", "jax", "--recipes", "fp8-current", "--task", "jax_tasks:make_task", "--out", ""], 2,
     "computes no dot through recipe.dot_general"),
    (["compare", "--backend", "jax", "--recipes", "bf16-true-kahan", "--out", ""], 2, "only the torch side implements"),
    (["compare", "--backend", "jax", "--nproc", "2", "--out", ""], 2, "--backend jax has no data-parallel runs"),
]


@pytest.mark.parametrize("argv, code, fragment", CLI_CASES, ids=[" ".join(c[0][2:])[:60] for c in CLI_CASES])
def test_cli_bad_input_is_one_clear_error(argv, code, fragment, capsys):
    assert main(argv) == code
    captured = capsys.readouterr()
    assert fragment in " ".join(captured.err.split()), captured.err
    assert "Traceback" not in captured.err + captured.out


def test_compare_out_empty_writes_no_report_as_on_the_torch_side(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["compare", "--backend", "jax", "--task", "jax_tasks:make_task", "--recipes", "bf16-mixed", "--steps",
                 "3", "--out", "", "--quiet"]) in (0, 1)
    assert list(tmp_path.iterdir()) == []  # nothing written, nowhere (mixprec-report/ included)
    assert "report:" not in capsys.readouterr().out


# (call, exception type, a fragment of its message)
API_CASES = [
    (lambda: mpj.skip_nonfinite(optax.sgd(0.1), mpj.DynamicLossScale(jnp.inf)), ValueError,
     "must be finite and positive"),
    (lambda: mpj.skip_nonfinite(optax.sgd(0.1), mpj.StaticLossScale(0.0)), ValueError, "must be finite and positive"),
    (lambda: mpj.skip_nonfinite("adamw", "fp16-mixed"), TypeError, "skip_nonfinite(optax.adamw(learning_rate=3e-4)"),
    (lambda: mpj.skip_nonfinite(object()), TypeError, "wraps an optax GradientTransformation"),
    (lambda: mpj.skip_nonfinite(optax.sgd(0.1), every_k=0), ValueError, "every_k must be an integer >= 1"),
    (lambda: mpj.StaticLossScale("x"), TypeError, "loss_scale must be a number or a float array"),
    (lambda: mpj.DynamicLossScale(jnp.array([8.0, 4096.0]), max_loss_scale=1024.0), ValueError, "above max_loss_scale"),
    (lambda: mpj.get_recipe("fp8-current").matmul(jnp.ones((2, 16)), jnp.ones((16, 16, 1))), ValueError,
     "multiplies x (..., K) by a kernel (K, N)"),
    (lambda: mpj.cast_to_compute_varying("bf16", {}, "d"), TypeError, "takes a mixprec.jax Policy"),
    (lambda: mpj.audit(lambda x: x, jnp.ones(2), policy=3), TypeError, "policy= takes a Policy"),
]


@pytest.mark.parametrize("call, exc, fragment", API_CASES, ids=[str(i) for i in range(len(API_CASES))])
def test_api_bad_input_is_refused_with_what_to_do(call, exc, fragment):
    with pytest.raises(exc) as info:
        call()
    assert fragment in str(info.value)


def test_recipes_all_runs_only_what_computes_something_of_its_own(monkeypatch, capsys):
    """'all' on the JAX side: no -true recipe (its -mixed twin here), no torch-only scheme; an explicit -true
    recipe is run with a note that it is its twin."""
    import mixprec.jax.comparison as comparison

    seen = {}

    def fake_compare(task, recipes, **kwargs):
        seen["recipes"] = list(recipes)
        raise ValueError("stop here")

    monkeypatch.setattr(comparison, "compare", fake_compare)
    assert main(["compare", "--backend", "jax", "--recipes", "all", "--out", ""]) == 2
    assert seen["recipes"] == ["fp32", "bf16-mixed", "fp16-mixed", "fp8-current", "fp8-delayed", "fp8-unscaled"]
    capsys.readouterr()
    assert main(["compare", "--backend", "jax", "--recipes", "bf16-true", "--out", ""]) == 2
    assert "bf16-true computes exactly like bf16-mixed" in " ".join(capsys.readouterr().err.split())
