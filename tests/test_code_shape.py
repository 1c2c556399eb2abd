"""The code's shape, counted (docs/ARCHITECTURE.md, "Small pieces"): a call that needs many values takes
a request object, not a long keyword list; and no product file grows past 300 lines."""

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PRODUCT = ("app", "tasks", "gpu_worker")
MAX_PARAMETERS = 8  # a function taking more than this many is a request object's place
MAX_LONG_SIGNATURES = 3  # the model's own (the KV cache, the flow solver) and at most one more
MAX_LINES = 300


def parameter_count(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """Every parameter a caller may pass (positional, keyword-only, *args, **kwargs), self and cls
    excluded."""
    args = node.args
    names = [a.arg for a in (*args.posonlyargs, *args.args, *args.kwonlyargs)]
    if names and names[0] in ("self", "cls"):
        names = names[1:]
    return len(names) + (args.vararg is not None) + (args.kwarg is not None)


def long_signatures(source: str, where: str) -> list[str]:
    """'where:line name (count)' of each function in `source` over MAX_PARAMETERS."""
    return [f"{where}:{node.lineno} {node.name} ({parameter_count(node)})"
            for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
            and parameter_count(node) > MAX_PARAMETERS]


def test_parameters_are_counted_as_a_caller_sees_them() -> None:
    source = ("def f(a, /, b, *rest, c, **more): ...\n"
              "class K:\n    def m(self, a, b, c, d, e, f, g, h, i): ...\n")
    counts = {n.name: parameter_count(n) for n in ast.walk(ast.parse(source))
              if isinstance(n, ast.FunctionDef)}
    assert counts == {"f": 5, "m": 9}
    assert long_signatures(source, "k.py") == ["k.py:3 m (9)"]


def test_at_most_three_product_functions_take_over_eight_parameters() -> None:
    found = [hit for package in PRODUCT for path in sorted((REPO / package).rglob("*.py"))
             for hit in long_signatures(path.read_text(), str(path.relative_to(REPO)))]
    assert len(found) <= MAX_LONG_SIGNATURES, "\n".join(found)


@pytest.mark.parametrize("package", PRODUCT)
def test_no_product_file_is_over_300_lines(package: str) -> None:
    files = [p for p in sorted((REPO / package).rglob("*")) if p.suffix in (".py", ".js") and p.is_file()]
    assert files, f"no source files under {package}/"
    over = {str(p.relative_to(REPO)): n for p in files if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert over == {}
