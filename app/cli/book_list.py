"""`wavefarm book list`: the books newest first, a page at a time, as `wavefarm jobs` pages jobs (--limit,
--after CURSOR, --all). Each line starts with the book's id; `book status` and `book cancel` take it or a
unique prefix of it (its first 8 characters, say), as the job commands do."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

from app.cli.common import client


def add_list_command(action: Callable[[str, str, Any], argparse.ArgumentParser]) -> None:
    books = action("list", "list books, newest first, a page at a time", cmd_book_list)
    books.add_argument("--limit", type=int, default=20, help="books a page (default 20, at most 200)")
    books.add_argument("--after", metavar="CURSOR", help="the page after this cursor (printed after a page)")
    books.add_argument("--all", action="store_true", help="page through every book, newest first")


def book_line(book: dict[str, Any]) -> str:
    done, total = book["segments_done"], book["segments_total"]
    return (f"{book['id']}  {book['status']:<10} {done:>6}/{total:<6} segments  "
            f"{len(book['chapters']):>3} chapters  {book['title']}")


def cmd_book_list(args: argparse.Namespace) -> int:
    api, after = client(args), args.after
    while True:
        page, after = api.books_page(after=after, limit=args.limit)
        for book in page:
            print(book_line(book))
        if after is None:
            return 0
        if not args.all:
            print(f"more: --after {after} (or --all)", file=sys.stderr)
            return 0
