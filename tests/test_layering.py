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


@pytest.mark.parametrize("module", ["app.api.main", "app.api.client", "app.cli", "app.jobs", "app.voices"])
def test_the_api_and_the_client_import_no_model_code(module: str) -> None:
    """The API, the CLI and the services they call start without torch (or the tokenizer, or Celery for
    the client): a client command must start in well under a second, and the API never runs the model."""
    import subprocess
    import sys

    probe = (f"import sys, {module}; heavy = {{'torch', 'torchaudio', 's3tokenizer', 'gpu_worker'}}; "
             "print(sorted(m for m in heavy if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]"


def test_a_client_command_loads_no_database_code() -> None:
    """`wavefarm submit` and `wavefarm jobs` speak HTTP: SQLAlchemy and Alembic (about 0.4 s to import)
    are not loaded for them; the API's shapes (`app.api.schemas`) name the models for annotations only."""
    import subprocess
    import sys

    probe = ("import sys, app.cli, app.cli.jobs, app.api.client, app.api.schemas, app.cli.common; "
             "print(sorted(m for m in ('sqlalchemy', 'alembic', 'app.db.models') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]"


def test_the_model_imports_only_torch_math_and_the_shared_speech_facts() -> None:
    """gpu_worker/model is pure modules (docs/ARCHITECTURE.md): no files, Redis, database or device choice."""
    allowed = {"torch", "math", "dataclasses", "collections", "typing", "itertools", "__future__",
               "gpu_worker"}
    offenders = {}
    for path in (REPO / "gpu_worker" / "model").rglob("*.py"):
        modules = _imported_modules(path)
        outside = {m for m in modules if m.split(".")[0] not in allowed and m != "app.speech"}
        outside |= {m for m in modules if m.startswith("gpu_worker") and not m.startswith("gpu_worker.model")}
        if outside:
            offenders[str(path.relative_to(REPO))] = sorted(outside)
    assert offenders == {}


def _imported_modules(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
    return found
