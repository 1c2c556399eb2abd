"""Books are found as jobs are: `book list` pages them like `jobs`, and `book status`, `book cancel` and
GET /v1/books/{id} take a unique id prefix (an ambiguous one is refused with the candidates)."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from app.dev import SAMPLES
from tests.app.cli.helpers import TOKEN, run


def _render(server: str, tmp_path: Path, title: str, capsys: pytest.CaptureFixture[str]) -> str:
    source = tmp_path / f"{title}.md"
    source.write_text(f"# {title}\n\nThe boats came home at half past three.\n", encoding="utf-8")
    assert run("book", "render", str(source), "--voice", str(SAMPLES / "voice_a.wav"), "--api", server) == 0
    out = capsys.readouterr().out
    return next(word for word in out.split() if len(word) == 36 and word.count("-") == 4)


def test_book_list_pages_like_jobs_and_a_prefix_finds_a_book(server: str, tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    ids = [_render(server, tmp_path, f"Tale{i}", capsys) for i in range(3)]
    assert run("book", "list", "--api", server, "--limit", "2") == 0
    first = capsys.readouterr()
    shown = [line.split()[0] for line in first.out.splitlines()]
    assert shown == ids[::-1][:2], first.out  # newest first
    cursor = first.err.split("--after ")[1].split()[0]
    assert run("book", "list", "--api", server, "--limit", "2", "--after", cursor) == 0
    assert ids[0] in capsys.readouterr().out
    assert run("book", "list", "--api", server, "--all", "--limit", "1") == 0
    every = [line.split()[0] for line in capsys.readouterr().out.splitlines()]
    assert set(ids) <= set(every)
    assert run("book", "status", "--api", server, ids[1][:8]) == 0
    assert capsys.readouterr().out.startswith(ids[1])
    answer = httpx.get(f"{server}/v1/books/{ids[2][:8]}", headers={"Authorization": f"Bearer {TOKEN}"})
    assert answer.status_code == 200 and answer.json()["id"] == ids[2]
    assert run("book", "cancel", "--api", server, ids[0][:8]) == 0
    assert capsys.readouterr().out.strip() == f"book {ids[0]}: cancelled"


def test_a_prefix_no_book_has_is_a_404(server: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert run("book", "status", "--api", server, "ffffffff") == 2
    assert "no book ffffffff" in capsys.readouterr().err


def test_book_list_works_locally(cli_env: dict[str, str], tmp_path: Path,
                                 capsys: pytest.CaptureFixture[str]) -> None:
    source = tmp_path / "Local.md"
    source.write_text("# Local\n\nThe boats came home.\n", encoding="utf-8")
    assert run("book", "render", str(source), "--voice", str(SAMPLES / "voice_a.wav"), "--local") == 0
    capsys.readouterr()
    assert run("book", "list", "--local") == 0
    listed = capsys.readouterr().out
    assert listed.count("\n") >= 1 and "parsing" in listed, listed


def test_an_ambiguous_prefix_names_the_candidates() -> None:
    from app.errors import BadInput
    from app.storage.keys import one_by_prefix

    with pytest.raises(BadInput, match=r"book 'ab12' is ambiguous: it begins 2 book ids \(ab12-1, ab12-2\)"):
        one_by_prefix(["ab12-1", "ab12-2"], "ab12", "book")
    assert one_by_prefix(["ab12-1"], "ab12", "book") == "ab12-1" and one_by_prefix([], "ab12", "book") is None
