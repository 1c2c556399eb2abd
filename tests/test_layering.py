"""The import rule of docs/ARCHITECTURE.md: app imports neither worker package; tasks and gpu_worker
meet only through Redis and the database, so neither imports the other."""

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
FORBIDDEN = {"app": {"tasks", "gpu_worker"}, "tasks": {"gpu_worker"}, "gpu_worker": {"tasks"}}


def imported_packages(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_package_imports_respect_the_layering(package: str) -> None:
    offenders = {str(p.relative_to(REPO)): imported_packages(p) & FORBIDDEN[package]
                 for p in (REPO / package).rglob("*.py")}
    assert {p: bad for p, bad in offenders.items() if bad} == {}
