"""The JAX twin of compare: the torch side's plan, verdict rules and report over JAX runs."""

import json
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("jax.numpy")  # a submodule, not "jax": see conftest
pytest.importorskip("optax")

from mixprec.comparison.verdict import judge  # noqa: E402
from mixprec.jax.comparison import compare  # noqa: E402


@pytest.fixture(scope="module")
def tracks():
    return compare("jax_tasks:make_task", ("bf16-mixed", "fp16-mixed"), steps=40)


def test_plan_is_the_torch_sides(tracks):
    roles = [(r.recipe, r.seed, r.role) for r in tracks.runs]
    assert roles == [("fp32", 0, "reference"), ("fp32", 1, "noise"), ("fp32", 2, "noise"),
                     ("bf16-mixed", 0, "candidate"), ("fp16-mixed", 0, "candidate")]
    assert all(r.steps == 40 and np.isfinite(r.loss).all() for r in tracks.runs)
    assert tracks.runs[0].loss[-1] < 0.1 * tracks.runs[0].loss[0]  # it trains


def test_verdicts_are_the_torch_rules_applied_to_jax_runs(tracks):
    assert {k: v.status for k, v in tracks.verdicts.items()} == {"bf16-mixed": "TRACKS", "fp16-mixed": "TRACKS"}
    for run in tracks.runs[3:]:
        assert judge(run, tracks.band) == tracks.verdicts[run.recipe]
    fp16 = tracks.run_for("fp16-mixed")
    assert fp16.loss_scaling == "dynamic" and fp16.scale[0] == 2.0**16 and fp16.policy == "p=f32,c=f16,o=f32"


def test_json_is_the_torch_sides_plus_the_backend(tracks):
    data = json.loads(tracks.to_json())
    assert data["mixprec_compare"] == 1 and data["backend"] == "jax" and data["jax"]
    assert set(data["verdicts"]) == {"bf16-mixed", "fp16-mixed"} and data["rule"]["text"].startswith("Loss curves")


def test_fp16_forward_overflow_is_non_finite_and_bf16_tracks():
    result = compare("jax_tasks:make_task", ("bf16-mixed", "fp16-mixed"), steps=20, task_kwargs={"kind": "overflow16"})
    fp16, bf16 = result.verdicts["fp16-mixed"], result.verdicts["bf16-mixed"]
    assert fp16.status == "NON-FINITE" and fp16.first_step == 1 and "loss scale" in fp16.message
    assert bf16.status == "TRACKS"
    assert not result.ok


def test_bf16_cancellation_diverges_through_the_cli(tmp_path, capsys):
    from mixprec.cli import main

    rc = main(["compare", "--backend", "jax", "--task", "jax_tasks:make_task", "--task-arg", "kind=cancel",
               "--recipes", "bf16-mixed", "--steps", "40", "--json", "--quiet", "--out", str(tmp_path / "r")])
    data = json.loads(capsys.readouterr().out)
    assert rc == 1 and data["verdicts"]["bf16-mixed"]["status"] == "DIVERGES"
    assert sorted(p.name for p in (tmp_path / "r").iterdir()) == ["compare.csv", "compare.html", "compare.json", "compare.png"]


def test_cli_errors_exit_2(tmp_path, capsys):
    from mixprec.cli import main

    assert main(["compare", "--backend", "jax", "--recipes", "bf16-true-kahan", "--out", str(tmp_path / "r")]) == 2
    assert "only the torch side implements" in " ".join(capsys.readouterr().err.split())
    assert main(["compare", "--backend", "jax", "--task", "mixprec.tasks.charlm:make_task", "--out", str(tmp_path / "s")]) == 2
    assert "needs a mixprec.jax.JaxTask" in " ".join(capsys.readouterr().err.split())


def test_mixprec_jax_compare_is_the_function_after_its_module_is_imported():
    import mixprec.jax as mpj
    import mixprec.jax.comparison  # noqa: F401  (a submodule named compare would have replaced the function)

    assert mpj.compare is compare


def test_bf16_rounding_near_1000_diverges_with_excess_precision_off():
    """Targets near 1000, where bf16's spacing is 4: a bf16 prediction is off by up to 2. XLA's CPU default
    keeps the add in f32 and bf16 would TRACK; compare compiles without excess precision and says so."""
    result = compare("jax_tasks:make_task", ("bf16-mixed",), steps=40, task_kwargs={"kind": "offset1000"})
    v = result.verdicts["bf16-mixed"]
    assert v.status == "DIVERGES", v.message
    bf16, fp32 = result.run_for("bf16-mixed"), result.reference
    assert bf16.loss[-10:].mean() > 1.0 > 0.2 > fp32.loss[-10:].mean()  # bf16's rounding error (~4^2/12) vs the noise
    assert "excess precision off" in result.device
    assert json.loads(result.to_json())["xla"] == {"xla_allow_excess_precision": False}


def test_xla_cpu_keeps_excess_precision_by_default_and_the_option_removes_it():
    """What docs/jax.md says about a user's own jitted code on CPU: by default a bf16 add near 1000 comes
    back unrounded; compiled with xla_allow_excess_precision=False it is rounded to bf16's spacing of 4."""
    import jax
    import jax.numpy as jnp

    from mixprec.jax.comparison import COMPILER_OPTIONS

    def f(x):
        return (x.astype(jnp.bfloat16) + jnp.bfloat16(0.25)).astype(jnp.float32)

    x = jnp.full((4,), 1000.0, jnp.float32)
    assert float(jax.jit(f, compiler_options=COMPILER_OPTIONS)(x)[0]) == 1000.0
    if jax.default_backend() == "cpu":
        assert float(jax.jit(f)(x)[0]) == 1000.25  # XLA's CPU default: no bf16 rounding at all


def test_a_task_whose_init_ignores_its_key_is_refused_before_training():
    """The docs' old example: identical fp32 seeds, a band at its 1% floor, judged without a word."""
    import jax.numpy as jnp
    import optax

    from mixprec.jax import JaxTask
    from mixprec.tasks import TaskError

    def make():
        return JaxTask(name="zeros", init_params=lambda key: {"w": jnp.zeros((8, 4))},
                       get_batch=lambda step: (np.ones((4, 8), np.float32), np.ones((4, 4), np.float32)),
                       apply=lambda p, x, r: x @ p["w"], loss_fn=lambda o, y: jnp.mean((o - y) ** 2),
                       make_optimizer=lambda: optax.adam(0.1), steps=5)

    with pytest.raises(TaskError, match="identical parameters for the keys of seeds 0 and 1.*jax.random.normal"):
        compare(make, ("bf16-mixed",))


def test_the_report_describes_jax_not_torch(tracks, tmp_path):
    from mixprec.instruments.machine import describe

    machine = tracks.to_dict()["machine"]
    assert machine["jax"] and machine["backend"] and "cpu_capability" not in machine and "threads" not in machine
    line = describe(tracks.machine())
    assert "XLA" in line and "jax" in line and "torch" not in line
    html = (Path(tracks.write(str(tmp_path / "r"))["html"])).read_text()
    assert "XLA sizes its own CPU threads" in html and "torch threads" not in html and "jax 0." in html


def test_the_per_computation_option_is_the_flag_set_before_the_backend_starts():
    """compare sets excess precision off per compiled step; the same runs with the process-wide flag
    (XLA_FLAGS before jax starts, in a subprocess) and no per-step option give bitwise the same losses."""
    import os
    import subprocess
    import sys

    from mixprec_test_env import src_env

    code = ("import json, sys\n"
            "import mixprec.jax.comparison as C\n"
            "C.COMPILER_OPTIONS = {}\n"
            "r = C.compare('jax_tasks:make_task', ('bf16-mixed',), steps=8, task_kwargs={'kind': 'offset1000'})\n"
            "print(json.dumps(r.run_for('bf16-mixed').loss.tolist()))\n")
    env = src_env()
    env["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_allow_excess_precision=false").strip()
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parent), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    flagged = json.loads(proc.stdout.strip().splitlines()[-1])
    here = compare("jax_tasks:make_task", ("bf16-mixed",), steps=8, task_kwargs={"kind": "offset1000"})
    assert here.run_for("bf16-mixed").loss.tolist() == flagged


def test_two_names_of_one_recipe_are_said_to_run_once_as_on_the_torch_side():
    # found by qa: --backend jax --recipes fp8 fp8-current merged into one row without a word (the torch side warns)
    from mixprec.jax.comparison import _resolve_all

    with pytest.warns(UserWarning, match=r"'fp8' and 'fp8-current' name the same recipe \(fp8-current\): it runs once"):
        names = [r.name for r in _resolve_all(["fp8", "fp8-current", "bf16-mixed"])]
    assert names == ["fp8-current", "bf16-mixed"]


def test_a_task_whose_optimizer_is_already_skip_nonfinite_is_refused():
    """Found by a probe: compare wrapped it again; the gradient was unscaled twice, or (with a clip) the
    error blamed an optax.chain the user never wrote."""
    import jax
    import jax.numpy as jnp
    import optax

    import mixprec.jax as mpj
    from mixprec.jax import JaxTask
    from mixprec.tasks import TaskError

    def make():
        return JaxTask(name="wrapped", init_params=lambda key: {"w": jax.random.normal(key, (8, 4))},
                       get_batch=lambda step: (np.ones((4, 8), np.float32), np.ones((4, 4), np.float32)),
                       apply=lambda p, x, r: x @ p["w"], loss_fn=lambda o, y: jnp.mean((o - y) ** 2),
                       make_optimizer=lambda: mpj.skip_nonfinite(optax.adam(0.1), "fp16-mixed"), steps=5)

    with pytest.raises(TaskError, match="make_optimizer returns a skip_nonfinite.*return the bare optimizer"):
        compare(make, ("bf16-mixed",))
