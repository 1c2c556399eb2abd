"""The CLI's `--local` commands work on the service's own database, so they refuse to start on one that
is not there: a default SQLite file (beside `WAVEFARM_ARTIFACT_ROOT`, `./var/artifacts`, relative to the
folder a command runs in) that does not exist is not created, and a database without wavefarm's tables
is not written to. Either way the message says which database it looked for and what to set.
"""

from __future__ import annotations

from pathlib import Path

from sqlalchemy import inspect
from sqlalchemy.engine import Engine, make_url

from app.errors import BadInput
from app.settings import Settings

WHAT_TO_SET = ("run the command in the folder the services run in, or set WAVEFARM_DATABASE_URL and "
               "WAVEFARM_ARTIFACT_ROOT to theirs")


def check_database_file(settings: Settings) -> None:
    """BadInput, before anything connects (which would create the file), when the database is a SQLite
    file that does not exist."""
    url = make_url(settings.database_url)
    if url.get_backend_name() != "sqlite" or not url.database or url.database == ":memory:":
        return
    if not Path(url.database).is_file():
        raise BadInput(f"--local: no wavefarm database at {Path(url.database).resolve()} (from "
                       f"{'WAVEFARM_DATABASE_URL' if _set_database(settings) else 'the default'}); "
                       f"{WHAT_TO_SET}")


def check_tables(engine: Engine) -> None:
    """BadInput when the database has no jobs table: a database wavefarm's services never started on."""
    if not inspect(engine).has_table("jobs"):
        where = engine.url.render_as_string(hide_password=True)
        raise BadInput(f"--local: the database {where} has no wavefarm tables (run `wavefarm db upgrade`, "
                       f"or start a service on it); {WHAT_TO_SET}")


def _set_database(settings: Settings) -> bool:
    return "database_url" in settings.model_fields_set
