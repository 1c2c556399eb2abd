"""The import rule of docs/ARCHITECTURE.md: app imports neither worker package; tasks and gpu_worker
meet only through Redis and the database, so neither imports the other; the tools (bench) are apart from
the product, which imports nothing of them."""

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
FORBIDDEN = {"app": {"tasks", "gpu_worker", "bench"}, "tasks": {"gpu_worker", "bench"},
             "gpu_worker": {"tasks", "bench"}}


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


@pytest.mark.parametrize("module", ["app.api.main", "app.api.client", "app.cli", "app.submission.jobs",
                                    "app.voices.service"])
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


# The state of a job, a book, a chapter and a segment after its insert changes only in app/lifecycle/:
# the columns below, per model (counters such as a chapter's keys_done are the lifecycle's too, but an
# upgrade's backfill may set them; they are not listed).
STATE_COLUMNS = {
    "Job": {"status", "attempts", "worker", "lease_until", "ring_due_at", "rings", "started_at",
            "finished_at", "output_path", "error", "frames_done", "first_audio_at", "prep_path"},
    "Book": {"status", "error", "started_at", "finished_at", "parse_attempts", "parse_started_at",
             "parse_lane"},
    "BookChapter": {"scheduled_at", "ready_at", "rung_at", "checked_at", "assembled_at", "render_owner",
                    "render_until"},
    "Segment": {"job_id", "error", "quality_verdict", "quality_report", "quality_job_id", "quality_attempts"},
}
STATE_OWNER = "app/lifecycle"


def _updated_model(node: ast.AST) -> str | None:
    """The model an `update(Model)` call updates, if it is one of STATE_COLUMNS'."""
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "update"
            and node.args and isinstance(node.args[0], ast.Name) and node.args[0].id in STATE_COLUMNS):
        return node.args[0].id
    return None


def _state_updates(tree: ast.AST) -> list[tuple[int, str, set[str]]]:
    """Each function that builds an `update(Model)` of a stateful model: its line, the model and the
    state columns its `.values(...)` calls name (`**` names all), wherever the statement is kept
    meanwhile (`stmt = update(Job)...; stmt.values(...)`)."""
    found = []
    for func in ast.walk(tree):
        if not isinstance(func, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        for model in {m for node in ast.walk(func) if (m := _updated_model(node))}:
            names: set[str] = set()
            for node in ast.walk(func):
                if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                        and node.func.attr == "values"):
                    names |= {k.arg for k in node.keywords if k.arg is not None}
                    if any(k.arg is None for k in node.keywords):
                        names |= STATE_COLUMNS[model]  # **values: could be any of them
            found.append((func.lineno, model, names & STATE_COLUMNS[model]))
    return found


def test_only_the_lifecycle_package_changes_the_state_of_jobs_books_chapters_and_segments() -> None:
    """docs/ARCHITECTURE.md: routes, tasks, the GPU worker and the reconciler call `app.lifecycle`;
    nothing else writes those state columns."""
    offenders = {}
    for package in ("app", "tasks", "gpu_worker"):
        for path in (REPO / package).rglob("*.py"):
            rel = str(path.relative_to(REPO))
            if rel.startswith(STATE_OWNER + "/"):
                continue
            tree = ast.parse(path.read_text(), filename=rel)
            for line, model, names in _state_updates(tree):
                if names:
                    offenders[f"{rel}:{line}"] = (model, sorted(names))
    assert offenders == {}


@pytest.mark.parametrize("model", sorted(STATE_COLUMNS))
def test_the_state_check_sees_the_lifecycles_own_updates_of_each_model(model: str) -> None:
    """The check above would catch a writer: it finds the lifecycle's own updates of every model."""
    found = set()
    for path in (REPO / STATE_OWNER).glob("*.py"):
        found |= {m for _, m, names in _state_updates(ast.parse(path.read_text())) if names}
    assert model in found


def _app_imports(module: str) -> set[str]:
    """The `app.*` modules `module` imports (anywhere in it), as dotted names of files that exist."""
    path = REPO / (module.replace(".", "/") + ".py")
    if not path.exists():
        path = REPO / module.replace(".", "/") / "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if (isinstance(node, ast.ImportFrom) and node.module and node.level == 0
                and node.module.startswith("app")):
            names = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names if alias.name.startswith("app")]
        found |= {n for n in names if (REPO / (n.replace(".", "/") + ".py")).exists()
                  or (REPO / n.replace(".", "/") / "__init__.py").exists()}
    return found


def _closure(module: str) -> set[str]:
    seen, todo = set(), [module]
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo.extend(_app_imports(name) - seen)
    return seen


def test_jobs_do_not_import_books_and_text_imports_neither() -> None:
    """Text jobs and books share `app.text`; `app.books.service` builds on `app.submission.jobs`, never the
    reverse
    (the cycle jobs -> text_tokens -> books -> jobs is gone)."""
    assert not {m for m in _closure("app.submission.jobs") if m.startswith("app.books")}
    assert not {m for m in _closure("app.text") | _closure("app.text.tokens")
                if m.startswith(("app.books", "app.submission.jobs"))}
    assert "app.submission.jobs" in _closure("app.books.service")  # the check sees a real edge


GPU_WORKER_ENTRIES = ("gpu_worker.worker.process", "gpu_worker.worker.job", "gpu_worker.worker.recovery",
                      "gpu_worker.worker.runtime")


def test_the_gpu_worker_process_loads_no_book_code() -> None:
    """The GPU worker loads only what it runs: its entry modules (`celery -A gpu_worker.worker.process`)
    import the reconciler's dead-worker rules, never its book rules nor anything of `app.books`."""
    import subprocess
    import sys

    probe = (f"import sys, {', '.join(GPU_WORKER_ENTRIES)}; "
             "print(sorted(m for m in sys.modules if m == 'app.books' or m.startswith('app.books.')))")
    done = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]"


def test_no_gpu_worker_file_reaches_book_code_even_through_an_import_inside_a_function() -> None:
    """The same rule over every import in gpu_worker/ (one inside a function runs only when called, so
    the probe above would not see it): no `app.*` module a GPU worker file names reaches `app.books`."""
    offenders = {}
    for path in (REPO / "gpu_worker").rglob("*.py"):
        for module in {m for m in _imported_modules(path) if m.startswith("app")}:
            books = sorted(m for m in _closure(module) if m.startswith("app.books"))
            if books:
                offenders[f"{path.relative_to(REPO)}: {module}"] = books
    assert offenders == {}
    assert any(m.startswith("app.books") for m in _closure("app.reconcile.sweep"))  # the check sees books


def test_of_the_reconciler_only_its_book_rules_reach_book_code() -> None:
    """app/reconcile/ is job rules and book rules: only `app.reconcile.books` (and the sweep composing
    it) reach `app.books`, so the job rules load alone where books are not run."""
    modules = [f"app.reconcile.{p.stem}" for p in (REPO / "app" / "reconcile").glob("*.py")
               if p.stem not in {"__init__", "books", "sweep"}]
    reaching = {m: sorted(x for x in _closure(m) if x.startswith("app.books")) for m in modules}
    assert {m: books for m, books in reaching.items() if books} == {}
    assert "app.reconcile.dead_workers" in modules and any(
        m.startswith("app.books") for m in _closure("app.reconcile.books"))
