"""mixprec.jax.policy: jmp's documented behaviour, and jmp's parsing bugs fixed (each bug test runs on
jmp too where it is installed, and must fail there: see conftest.impl)."""

import pytest

pytest.importorskip("jax.numpy")  # a submodule, not "jax": see conftest
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import mixprec.jax as mpj  # noqa: E402
from mixprec.jax import policy as mp_policy  # noqa: E402

# ---------------------------------------------------------------------------- jmp parity


@pytest.mark.parametrize(
    "text, expected",
    [
        ("c=f16", (jnp.float32, jnp.float16, jnp.float16)),  # compute follows params' default, output follows compute
        ("p=f16,c=f16", (jnp.float16, jnp.float16, jnp.float16)),
        ("p=f16,c=bf16", (jnp.float16, jnp.bfloat16, jnp.bfloat16)),
        ("params=float32,compute=bfloat16,output=float32", (jnp.float32, jnp.bfloat16, jnp.float32)),
        ("o=f32", (jnp.float32, jnp.float32, jnp.float32)),
        ("bf16", (jnp.bfloat16, jnp.bfloat16, jnp.bfloat16)),
        ("full", (jnp.float32, jnp.float32, jnp.float32)),
    ],
)
def test_get_policy_follows_jmps_grammar_and_defaults(text, expected):
    p = mpj.get_policy(text)
    assert (p.param_dtype, p.compute_dtype, p.output_dtype) == expected


def test_get_policy_returns_jax_scalar_types_as_jmp():
    p = mpj.get_policy("p=f32,c=bf16")
    assert p.param_dtype is jnp.float32 and p.compute_dtype is jnp.bfloat16


def test_half_follows_the_backend():
    assert mpj.half_dtype() == (jnp.bfloat16 if jax.local_devices()[0].platform == "tpu" else jnp.float16)
    assert mpj.get_policy("c=half").compute_dtype == mpj.half_dtype()


def test_str_is_jmps_spelling_and_parses_back_on_both_sides():
    p = mpj.get_policy("p=f32,c=bf16,o=f32")
    assert str(p) == "p=full,c=bf16,o=full"
    assert mpj.get_policy(str(p)) == p
    import mixprec

    torch_side = mixprec.get_policy(str(p))
    assert str(torch_side) == "p=f32,c=bf16,o=f32" == mp_policy.policy_label(p)


def test_casts_only_float_arrays_and_leave_everything_else_untouched():
    marker = object()
    tree = {"f32": np.ones(2, np.float32), "jf": jnp.ones(2), "i": jnp.arange(3), "b": np.array([True]),
            "py": 1.5, "np_scalar": np.float64(2.0), "obj": marker}
    out = mpj.get_policy("c=bf16").cast_to_compute(tree)
    assert out["f32"].dtype == jnp.bfloat16 and out["jf"].dtype == jnp.bfloat16
    assert out["i"].dtype == jnp.int32 and out["b"].dtype == np.bool_
    assert out["py"] == 1.5 and type(out["np_scalar"]) is np.float64 and out["obj"] is marker


def test_cast_to_full_and_half():
    tree = {"h": jnp.ones(2, jnp.float16), "f": jnp.ones(2), "i": jnp.ones(2, jnp.int16)}
    assert {k: v.dtype for k, v in mpj.cast_to_full(tree).items()} == {"h": jnp.float32, "f": jnp.float32, "i": jnp.int16}
    assert mpj.cast_to_half(tree)["f"].dtype == mpj.half_dtype()


def test_policy_is_frozen_and_with_output_dtype_derives_a_copy():
    p = mpj.get_policy("p=f32,c=bf16,o=f32")
    with pytest.raises(Exception):
        p.compute_dtype = jnp.float16
    q = p.with_output_dtype(jnp.bfloat16)
    assert q.output_dtype == jnp.bfloat16 and p.output_dtype == jnp.float32


def test_dtype_to_names_is_jmps_table():
    assert mpj.dtype_to_names[jnp.float32] == ("full", "f32", "float32")
    assert mpj.dtype_to_names[jnp.bfloat16][0] == "bf16" and mpj.dtype_to_names[np.float16][0] == "f16"


# ---------------------------------------------------------------------------- jmp's bugs, fixed


@pytest.mark.parametrize("text", ["p=f32, c=bf16", " p = f32 ,c=bf16 ", "P=F32,C=BF16", "Params=Float32,Compute=BFloat16"])
def test_whitespace_and_case_are_accepted(impl, text):
    p = impl.policy.get_policy(text)
    assert (p.param_dtype, p.compute_dtype, p.output_dtype) == (jnp.float32, jnp.bfloat16, jnp.bfloat16)


@pytest.mark.parametrize("text, dtype", [("fp32", jnp.float32), ("fp16", jnp.float16), ("float", jnp.float32),
                                          ("c=fp16", jnp.float16), ("c=BF16", jnp.bfloat16)])
def test_common_spellings_jmp_refuses_are_accepted(impl, text, dtype):
    assert impl.policy.get_policy(text).compute_dtype == dtype


@pytest.mark.parametrize(
    "text, token, allowed",
    [
        ("p=f32,", "trailing comma", "key=dtype"),
        ("p=f32,,c=bf16", "empty entry", "key=dtype"),
        ("p=f32=x", "'p=f32=x'", "exactly one '='"),
        ("p=f32,c=bf61", "'bf61'", "bf16"),
        ("x=f32", "'x'", "p, params, c, compute, o, output"),
        ("p=f32,params=f16", "'params'", "at most once"),
    ],
)
def test_parse_errors_name_the_token_the_input_and_what_is_allowed(impl, text, token, allowed):
    with pytest.raises(ValueError) as info:
        impl.policy.get_policy(text)
    msg = str(info.value)
    assert token in msg and repr(text) in msg and allowed in msg, msg


def test_unknown_dtype_message_keeps_jmps_prefix():
    with pytest.raises(ValueError, match="Unknown dtype 'compute_float16'"):
        mpj.get_policy("compute_float16")


@pytest.mark.parametrize("dtype", [np.dtype("float32"), np.dtype("float16"), jnp.dtype("bfloat16"), "float32"])
def test_str_of_numpy_dtypes(impl, dtype):
    p = impl.policy.Policy(dtype, dtype, dtype)
    key = {"float32": jnp.float32, "float16": jnp.float16, "bfloat16": jnp.bfloat16}[np.dtype(dtype).name]
    name = impl.policy.dtype_to_names[key][0]
    assert str(p) == f"p={name},c={name},o={name}"


def test_non_string_policy_is_a_type_error():
    with pytest.raises(TypeError, match="policy string"):
        mpj.get_policy(32)


def test_a_recipe_name_given_as_a_policy_says_where_its_policy_is():
    with pytest.raises(ValueError, match=r"'fp16-mixed' is a recipe, not a policy: its policy is "
                                         r"mixprec\.jax\.get_recipe\('fp16-mixed'\)\.policy"):
        mpj.get_policy("fp16-mixed")
