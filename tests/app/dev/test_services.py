"""The demo's local services (`app.dev.services`)."""

from __future__ import annotations

from app.dev.services import _read_pid


def test_a_pid_file_created_but_not_yet_written_is_not_a_pid(tmp_path) -> None:
    """redis-server creates its pid file, then writes the number: the demo waited for the file alone and
    read '' as an int once in a loaded run (ValueError); an empty or half-made file is 'not yet'."""
    pidfile = tmp_path / "redis.pid"
    assert _read_pid(pidfile) is None
    pidfile.write_text("")
    assert _read_pid(pidfile) is None
    pidfile.write_text("4242\n")
    assert _read_pid(pidfile) == 4242
