"""Alembic environment: URL and metadata come from the app, never from alembic.ini.

URL order: `-x url=...`, then the config's sqlalchemy.url (set by
`app.db.upgrade(url)`), then `Settings().database_url`. SQLite runs in batch
mode so ALTERs become table copies. Concurrent upgrades of one database
(services starting together) are serialised: an advisory lock on PostgreSQL,
a file lock beside a SQLite file.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging.config
from collections.abc import Iterator
from pathlib import Path

from alembic import context
from sqlalchemy import make_url, pool, text

from app.db.models import Base
from app.db.session import make_engine

config = context.config
if config.config_file_name is not None:
    logging.config.fileConfig(config.config_file_name, disable_existing_loggers=False)

target_metadata = Base.metadata
MIGRATION_LOCK_KEY = 0x77617665  # 'wave': one schema upgrade at a time per PostgreSQL database


def database_url() -> str:
    url = context.get_x_argument(as_dictionary=True).get("url") or config.get_main_option("sqlalchemy.url")
    if url:
        return url
    from app.settings import Settings

    return Settings().database_url


def run_migrations_offline() -> None:
    url = database_url()
    context.configure(
        url=url,
        target_metadata=target_metadata,
        literal_binds=True,
        render_as_batch=url.startswith("sqlite"),
    )
    with context.begin_transaction():
        context.run_migrations()


@contextlib.contextmanager
def sqlite_file_lock(url: str) -> Iterator[None]:
    """SQLite has no advisory locks: serialise upgrades of one database file with flock on a sibling file."""
    database = make_url(url).database
    if not database or database == ":memory:":
        yield
        return
    Path(database).parent.mkdir(parents=True, exist_ok=True)
    with open(f"{database}.migrate-lock", "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def run_migrations_online() -> None:
    url = database_url()
    is_sqlite = make_url(url).get_backend_name() == "sqlite"
    engine = make_engine(url, poolclass=pool.NullPool)
    try:
        with sqlite_file_lock(url) if is_sqlite else contextlib.nullcontext(), engine.connect() as connection:
            if is_sqlite:
                # Batch mode drops and renames tables; with foreign keys on, dropping a parent
                # table deletes (or refuses) its children. Off outside a transaction, checked after.
                connection.exec_driver_sql("PRAGMA foreign_keys=OFF")
                connection.commit()
            context.configure(
                connection=connection,
                target_metadata=target_metadata,
                render_as_batch=is_sqlite,
                compare_type=True,
            )
            with context.begin_transaction():
                if connection.dialect.name == "postgresql":
                    # Services upgrade on start: the second one waits here, then finds the schema at head.
                    connection.execute(
                        text("SELECT pg_advisory_xact_lock(:key)"), {"key": MIGRATION_LOCK_KEY}
                    )
                context.run_migrations()
            if is_sqlite:
                broken = connection.exec_driver_sql("PRAGMA foreign_key_check").fetchall()
                connection.commit()
                if broken:
                    raise RuntimeError(f"migration left rows with dangling foreign keys: {broken[:10]}")
    finally:
        engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
