"""The binding of a name that reaches a statement, along the code path (MP111 reads it)."""

from __future__ import annotations

import ast
import textwrap

import pytest

from mixprec.lint.bindings import Bindings


def reaching(source: str, name: str = "ckpt") -> list[str] | None:
    """What ``name`` may hold at the call ``use(name)`` of the (only) function or the module."""
    tree = ast.parse(textwrap.dedent(source))
    scope = next((n for n in tree.body if isinstance(n, ast.FunctionDef)), tree)
    use = next(
        n for n in ast.walk(scope)
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "use"
    )
    values = Bindings(scope).values(name, use.args[0])
    return None if values is None else [ast.unparse(v) for v in values]


@pytest.mark.parametrize(
    "source, expected",
    [
        ("ckpt = load()\nckpt = None\nckpt = {'a': 1}\nuse(ckpt)\n", ["{'a': 1}"]),
        ("ckpt = load()\nif c:\n    ckpt = {'a': 1}\nuse(ckpt)\n", ["load()", "{'a': 1}"]),
        ("if c:\n    ckpt = load()\n    del ckpt\nckpt = {'a': 1}\nuse(ckpt)\ndel ckpt\n", ["{'a': 1}"]),
        ("ckpt = None\nfor e in r:\n    ckpt = {'e': e}\n    use(ckpt)\n    del ckpt\n", ["{'e': e}"]),
        ("ckpt = None\nfor e in r:\n    use(ckpt)\n    ckpt = {'e': e}\n", ["None", "{'e': e}"]),
        ("ckpt = 1\nif c:\n    ckpt = 2\n    return\nuse(ckpt)\n", ["1"]),
        ("ckpt = 1\ntry:\n    ckpt = 2\n    work()\nexcept E:\n    use(ckpt)\n", ["1", "2"]),
        ("ckpt = 1\nwhile c:\n    if d:\n        ckpt = 2\n        continue\n    ckpt = 3\nuse(ckpt)\n", ["1", "2", "3"]),
        ("ckpt = 1\nmatch x:\n    case 1:\n        ckpt = 2\nuse(ckpt)\n", ["1", "2"]),
    ],
    ids=["last-assignment", "if-without-else", "del", "loop-body", "loop-head", "return-arm", "try-handler",
         "continue", "match"],
)
def test_the_binding_that_reaches_the_statement(source, expected):
    body = "def f(c, d, r, x):\n" + textwrap.indent(source, "    ")
    assert reaching(body) == expected


@pytest.mark.parametrize(
    "source",
    [
        "def f(ckpt):\n    use(ckpt)\n",  # a parameter
        "def f(r):\n    for ckpt in r:\n        use(ckpt)\n",  # a loop target
        "def f(p):\n    ckpt, other = p\n    use(ckpt)\n",  # unpacking
        "def f(p):\n    ckpt = {}\n    ckpt |= p\n    use(ckpt)\n",  # augmented assignment
        "def f(p):\n    with open(p) as ckpt:\n        use(ckpt)\n",
        "def f(p):\n    if (ckpt := p):\n        use(ckpt)\n",  # walrus
        "def f(p):\n    global ckpt\n    ckpt = {}\n    use(ckpt)\n",
        "def f(p):\n    import ckpt\n    use(ckpt)\n",
    ],
    ids=["parameter", "loop-target", "unpacking", "augmented", "with-as", "walrus", "global", "import"],
)
def test_bindings_it_cannot_see_through_give_no_answer(source):
    assert reaching(source) is None


def test_a_name_the_scope_never_binds_is_not_local():
    assert reaching("def f():\n    use(ckpt)\n") == []
    assert reaching("ckpt = {'a': 1}\ndef f():\n    use(ckpt)\n") == []  # the module's, not f's


def test_module_level_code_is_a_scope_too():
    source = "ckpt = None\nwhile True:\n    if s:\n        ckpt = {'m': 1}\n        use(ckpt)\n"
    assert reaching(source) == ["{'m': 1}"]
