"""--fix: the MP201 rewrites are exact, parse, re-lint clean, and leave alone what they cannot do."""

from __future__ import annotations

import ast
import textwrap
import warnings

import pytest

from mixprec.lint import fix_source, lint_source


def fixed(source: str) -> tuple[str, int]:
    return fix_source(textwrap.dedent(source))


@pytest.mark.parametrize(
    "before, after",
    [
        (
            "import torch\ns = torch.cuda.amp.GradScaler()\n",
            'import torch\ns = torch.amp.GradScaler("cuda")\n',
        ),
        (
            "import torch\ns = torch.cuda.amp.GradScaler(1024.0, enabled=use_amp)\n",
            'import torch\ns = torch.amp.GradScaler("cuda", 1024.0, enabled=use_amp)\n',
        ),
        (
            "import torch as t\nwith t.cuda.amp.autocast(True, t.float16):\n    pass\n",
            'import torch as t\nwith t.autocast("cuda", enabled=True, dtype=t.float16):\n    pass\n',
        ),
        (
            "import torch\nwith torch.cpu.amp.autocast(dtype=torch.bfloat16):\n    pass\n",
            'import torch\nwith torch.autocast("cpu", dtype=torch.bfloat16):\n    pass\n',
        ),
        (
            "import torch\nimport torch.cuda.amp as camp\nwith camp.autocast():\n    pass\n",
            'import torch\nimport torch.cuda.amp as camp\nwith torch.autocast("cuda"):\n    pass\n',
        ),
        (
            "from torch.cuda.amp import GradScaler, autocast as ac\ns = GradScaler()\nwith ac(dtype=x):\n    pass\n",
            'from torch.amp import GradScaler, autocast as ac\ns = GradScaler("cuda")\nwith ac("cuda", dtype=x):\n    pass\n',
        ),
        (
            "import torch\n@torch.cuda.amp.custom_fwd\ndef f(x):\n    return x\n",
            'import torch\n@torch.amp.custom_fwd(device_type="cuda")\ndef f(x):\n    return x\n',
        ),
        (
            "import torch\n@torch.cuda.amp.custom_fwd(\n    cast_inputs=torch.float32,\n)\ndef f(x):\n    return x\n",
            'import torch\n@torch.amp.custom_fwd(\n    cast_inputs=torch.float32, device_type="cuda",\n)\ndef f(x):\n    return x\n',
        ),
        (
            'import torch\nnote = "é"; s = torch.cuda.amp.GradScaler()  # é\n',
            'import torch\nnote = "é"; s = torch.amp.GradScaler("cuda")  # é\n',
        ),
    ],
    ids=["scaler", "scaler-args", "autocast-positional", "cpu", "module-alias", "from-import", "decorator", "multiline", "unicode"],
)
def test_fix_rewrites_deprecated_amp_exactly(before, after):
    text, count = fix_source(before)
    assert text == after
    assert count >= 1
    ast.parse(text)
    assert [f for f in lint_source(text) if f.code == "MP201"] == []


@pytest.mark.parametrize(
    "source",
    [
        "import torch\nctx = torch.cuda.amp.autocast\n",  # a reference, not a call
        "import torch\nargs = ()\nwith torch.cuda.amp.autocast(*args):\n    pass\n",  # positional meaning unknown
        "import torch.cuda.amp as camp\nwith camp.autocast():\n    pass\n",  # no name bound to torch
        "from torch.cuda.amp import autocast\nctx = autocast\n",  # a use that is not a call
        "from torch.cuda.amp import autocast, common\n",  # common has no torch.amp twin
    ],
    ids=["reference", "starred", "no-torch-name", "import-used-as-value", "mixed-import"],
)
def test_fix_leaves_what_it_cannot_rewrite_exactly_and_still_reports_it(source):
    text, count = fix_source(source)
    assert (text, count) == (source, 0)
    assert any(f.code == "MP201" and not f.fixable for f in lint_source(source))


def test_fix_does_not_touch_a_try_except_fallback_import():
    source = "try:\n    from torch.amp import GradScaler\nexcept ImportError:\n    from torch.cuda.amp import GradScaler\ns = GradScaler()\n"
    assert fix_source(source) == (source, 0)
    assert lint_source(source) == []


def test_fix_skips_a_line_silenced_with_noqa():
    source = "import torch\na = torch.cuda.amp.GradScaler()  # noqa: MP201\nb = torch.cuda.amp.GradScaler()\n"
    text, count = fix_source(source)
    assert count == 1
    assert text.splitlines()[1:] == ["a = torch.cuda.amp.GradScaler()  # noqa: MP201", 'b = torch.amp.GradScaler("cuda")']


def test_fix_only_applies_selected_codes():
    source = "import torch\na = torch.cuda.amp.GradScaler()\n"
    assert fix_source(source, codes={"MP101"}) == (source, 0)


def test_fix_is_idempotent():
    once, _ = fixed(
        """
        import torch
        from torch.cuda.amp import autocast
        scaler = torch.cuda.amp.GradScaler()
        with autocast():
            loss = model(x)
        """
    )
    assert fix_source(once) == (once, 0)


def test_fixed_code_behaves_like_the_original_without_deprecation_warnings():
    """Run the rewritten CPU code under torch: same autocast state, no FutureWarning."""
    torch = pytest.importorskip("torch")
    before = textwrap.dedent(
        """
        import torch
        from torch.cpu.amp import autocast
        scaler = torch.cpu.amp.GradScaler(init_scale=256.0)
        with autocast(True, torch.bfloat16):
            state = (torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"))
        with torch.cpu.amp.autocast(enabled=False):
            off = torch.is_autocast_enabled("cpu")
        """
    )
    after, count = fix_source(before)
    assert count == 3
    old: dict = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        exec(compile(before, "before", "exec"), old)
    new: dict = {}
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        exec(compile(after, "after", "exec"), new)
    assert new["state"] == old["state"] == (True, torch.bfloat16)
    assert new["off"] is old["off"] is False
    assert new["scaler"].get_scale() == old["scaler"].get_scale() == 256.0


def test_fix_through_lint_paths_rewrites_the_file_and_reports_it(tmp_path):
    from mixprec.lint import lint_paths

    script = tmp_path / "train.py"
    script.write_text("import torch\ns = torch.cuda.amp.GradScaler()\nwith torch.cuda.amp.autocast():\n    pass\n")
    result = lint_paths([script], fix=True)
    assert result.fixed == {str(script): 2}
    assert result.findings == []
    assert "torch.cuda.amp" not in script.read_text()


def test_fix_uses_a_torch_import_guarded_by_try():
    source = "try:\n    import torch\nexcept ImportError:\n    torch = None\ns = torch.cuda.amp.GradScaler()\n"
    text, count = fix_source(source)
    assert count == 1
    assert text.endswith('s = torch.amp.GradScaler("cuda")\n')


def test_fix_leaves_old_torch_fallback_arms_untouched():
    from pathlib import Path

    source = (Path(__file__).parent / "cases" / "mp201_ok_version_fallbacks.py").read_text()
    assert "torch.cuda.amp.GradScaler" in source
    assert fix_source(source) == (source, 0)


@pytest.mark.parametrize(
    "source",
    [
        "import torch\ns = torch.amp.GradScaler('cuda') if TORCH_2_4 else torch.cuda.amp.GradScaler()\n",
        "import torch\nif hasattr(torch, 'autocast'):\n    c = torch.autocast('cuda')\nelse:\n    c = torch.cuda.amp.autocast()\n",
        "import torch\ntry:\n    s = torch.amp.GradScaler(device='cuda')\nexcept (AttributeError, TypeError):\n    s = torch.cuda.amp.GradScaler()\n",
        # the from-import that only the fallback arm uses is the fallback's too
        "import torch\nfrom torch.cuda.amp import GradScaler\ns = torch.amp.GradScaler('cuda') if is_torch_version('>=', '2.4') else GradScaler()\n",
    ],
    ids=["conditional-expression", "if-else-hasattr", "except-handler", "from-import-for-the-fallback"],
)
def test_old_torch_fallbacks_are_neither_reported_nor_rewritten(source):
    assert lint_source(source) == []
    assert fix_source(source) == (source, 0)


def test_a_from_import_used_by_a_fallback_and_elsewhere_is_reported_but_not_rewritten():
    source = (
        "import torch\nfrom torch.cuda.amp import GradScaler\n"
        "s = torch.amp.GradScaler('cuda') if TORCH_2_4 else GradScaler()\nt = GradScaler()\n"
    )
    (finding,) = lint_source(source)
    assert finding.code == "MP201" and finding.line == 2 and not finding.fixable
    assert fix_source(source) == (source, 0)


def test_the_same_deprecated_call_outside_a_fallback_is_still_rewritten():
    source = "import torch\ns = torch.amp.GradScaler('cuda') if use_new else torch.cuda.amp.GradScaler()\n"
    text, count = fix_source(source)
    assert count == 1 and text.endswith("else torch.amp.GradScaler(\"cuda\")\n")
