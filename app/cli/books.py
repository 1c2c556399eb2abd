"""Book commands: render (submit; with --wait follow it and download its files), preview, status, cancel,
list (`app.cli.book_list`).

They speak HTTP to the API, or with `--local` run the book services in this process (`app.api.client`),
where a manifest may also name source audio files beside it.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from app.cli.book_checks import check_preview_chapter
from app.cli.book_list import add_list_command
from app.cli.common import add_client_options, client, finished_well, read_file, voice_argument, voice_id_for
from app.errors import BadInput

# app.books.submission's DEFAULT_PREVIEW_S and PREVIEW_PRIORITY, repeated so that building the parser
# imports no book service (a quarter of a second or more: every command, `model check` too, paid it);
# tests/app/cli/test_books.py holds them equal.
DEFAULT_PREVIEW_S = 20.0
PREVIEW_PRIORITY = 5
BAR_ROOM = 64  # what a progress bar needs beside its label: counts, rate, status, audio seconds, ETA


def bar_label(title: str, columns: int | None = None) -> str:
    """A book's title for its progress bar: whole if the terminal has room, else cut with an ellipsis."""
    room = max(24, (columns or shutil.get_terminal_size().columns) - BAR_ROOM)
    return title if len(title) <= room else title[: room - 1].rstrip() + "\u2026"


def add_commands(sub: Any) -> None:
    book = sub.add_parser("book", help="render a book (text, Markdown, EPUB, manifest): chapters and an M4B")
    book_sub = book.add_subparsers(dest="book_command", required=True, metavar="ACTION")

    def action(name: str, help_: str, handler: Any) -> argparse.ArgumentParser:
        p = book_sub.add_parser(name, help=help_)
        add_client_options(p)
        p.set_defaults(handler=handler)
        return p

    render = action("render", "submit a book; --wait follows it and writes its files to --out",
                    cmd_book_render)
    render.add_argument("book", type=Path,
                        help="a .txt, .md, .epub, .html, .pdf, .docx, .srt, .vtt or .json manifest file")
    render.add_argument("--voice", required=True, help="voice id (sha256) or a reference audio file")
    render.add_argument("--out", type=Path, help="folder for the chapter files, book.m4b and the index")
    render.add_argument("--format", dest="book_output", choices=("m4b", "flac", "wav"), default="m4b",
                        help="m4b: FLAC chapters and an M4B (default); flac or wav: chapter files only")
    render.add_argument("--wait", action="store_true", help="show progress until done, then download")
    _add_book_options(render)
    preview = action("preview", "render the first seconds of one chapter at a high priority, then write it "
                     "to --out", cmd_book_preview)
    preview.add_argument("book", type=Path, help="the book file, as for render")
    preview.add_argument("--voice", required=True, help="voice id (sha256) or a reference audio file")
    preview.add_argument("--out", type=Path, required=True, help="the preview's audio file (.flac or .wav)")
    preview.add_argument("--chapter", type=int, default=1, help="which chapter, counted from 1 (default 1)")
    preview.add_argument("--seconds", type=float, default=DEFAULT_PREVIEW_S,
                         help=f"about how long (default {DEFAULT_PREVIEW_S:g}; whole segments, at least one)")
    _add_book_options(preview, preview=True)
    action("status", "show a book's progress", cmd_book_status).add_argument(
        "book_id", help="the book's id or a unique prefix of it (the 8 characters `book list` prints)")
    action("cancel", "cancel a book (finished segments are kept)", cmd_book_cancel).add_argument(
        "book_id", help="the book's id or a unique prefix of it")
    add_list_command(action)


def _add_book_options(render: argparse.ArgumentParser, preview: bool = False) -> None:
    """A render's options; a preview takes those that change how it sounds (the others keep their
    defaults: one chapter file, nothing else)."""
    render.add_argument("--lexicon", type=Path, help="a pronunciation lexicon, JSON or YAML (docs/BOOKS.md)")
    render.add_argument("--cast", type=Path, help="voices for the names the text's markup uses, JSON or "
                        "YAML: name -> voice id or reference audio file (relative to the cast file)")
    render.add_argument("--language", help="BCP 47 tag (default: from the book, else en)")
    priority = PREVIEW_PRIORITY if preview else 0
    render.add_argument("--priority", type=int, default=priority,
                        help=f"segment job priority (default {priority}; 0 yields to every other job)")
    render.add_argument("--target-lufs", help="chapter loudness in LUFS (default -20, true peak at most "
                        "-1 dBTP), or off: measure, do not normalise")
    render.add_argument("--seed", type=int, default=0)
    render.add_argument("--quality", choices=("on", "report", "off"), help="the quality gate (default on: "
                        "hear each segment, render a failing one again, report; report: hear and report "
                        "only; off: not heard)")
    if preview:
        render.set_defaults(book_output="flac", mp3=False, timed=False, epub3=False, **dict.fromkeys(
            ("title", "author", "narrator", "description", "bitrate", "mp3_bitrate", "sample_rate", "series",
             "series_part", "chapters", "publisher", "year", "isbn", "genre")))
        return
    render.add_argument("--title")
    render.add_argument("--author")
    render.add_argument("--narrator", help="for the M4B's and MP3s' tags (default: the book's own, if any)")
    render.add_argument("--description", help="for the tags (default: the book's own, if any)")
    render.add_argument("--mp3", action="store_true", help="an MP3 per chapter too (ID3-tagged)")
    render.add_argument("--timed", action="store_true",
                        help="subtitles (.srt, .vtt): each cue's speech at its start time")
    render.add_argument("--bitrate", type=int, help="the M4B's AAC bitrate in kbit/s (default 64)")
    render.add_argument("--mp3-bitrate", type=int, help="the MP3s' bitrate in kbit/s (default 64; ACX: 192)")
    render.add_argument("--sample-rate", type=int, help="of the M4B and MP3s in Hz (default: the render's, "
                        "24000; ACX: 44100)")
    render.add_argument("--series", help="the series the book belongs to (tags, metadata.json)")
    render.add_argument("--series-part", help="the book's place in the series: 1, 2.5, 3a")
    render.add_argument("--publisher", help="for the tags and metadata.json (default: the book's own)")
    render.add_argument("--year", help="the publication year, 4 digits (default: the book's own, if any)")
    render.add_argument("--isbn", help="ISBN-10 or ISBN-13, hyphens allowed; its check digit is checked")
    render.add_argument("--genre", action="append", help="a genre; repeat for several (default: the book's "
                        "own; none: 'Audiobook')")
    render.add_argument("--epub3", action="store_true",
                        help="a read-along EPUB 3 too (book.epub: the text highlighted as the audio plays)")
    render.add_argument("--chapters", help="render only these chapters, counted from 1: e.g. 3-7,12 "
                        "(a later render of the whole book reuses their segments)")


def _form(args: argparse.Namespace) -> dict[str, str]:
    """The book's options as the API's form fields."""
    form = {"output_format": "flac" if args.book_output == "m4b" else args.book_output,
            "m4b": "true" if args.book_output == "m4b" else "false", "seed": str(args.seed),
            "priority": str(args.priority), "mp3": "true" if args.mp3 else "false",
            "timed": "true" if args.timed else "false", "epub3": "true" if args.epub3 else "false"}
    form.update({k: str(v) for k, v in (("title", args.title), ("author", args.author),
                                        ("narrator", args.narrator), ("description", args.description),
                                        ("language", args.language), ("target_lufs", args.target_lufs),
                                        ("chapters", args.chapters), ("bitrate_kbps", args.bitrate),
                                        ("mp3_bitrate_kbps", args.mp3_bitrate),
                                        ("sample_rate", args.sample_rate), ("series", args.series),
                                        ("series_part", args.series_part), ("publisher", args.publisher),
                                        ("year", args.year), ("isbn", args.isbn), ("quality", args.quality))
                 if v is not None})
    if args.genre is not None:
        form["genres"] = ",".join(args.genre)
    if args.lexicon is not None:
        try:
            form["lexicon"] = read_file(args.lexicon, "lexicon").decode("utf-8-sig")
        except UnicodeDecodeError:
            raise BadInput(f"the lexicon {args.lexicon} is not UTF-8 text") from None
    return form


def cast_ids(api: Any, path: Path) -> dict[str, str]:
    """The cast file with every reference audio file uploaded (once each) and named by its voice id."""
    from app.books.planning.cast import parse_cast

    cast = parse_cast(read_file(path, "cast file"), allow_files=True, what=f"the cast {path}")
    out: dict[str, str] = {}
    for name, value in cast.items():
        if re.fullmatch(r"[0-9a-f]{64}", value):
            out[name] = value
            continue
        reference = (path.parent / value).resolve()
        if not reference.is_file():
            raise BadInput(f"the cast {path}: the voice of {name!r}, {value!r}, is neither a voice id nor "
                           "a reference audio file")
        out[name] = voice_id_for(api, str(reference))
    return out


def cmd_book_preview(args: argparse.Namespace) -> int:
    """Submit the preview (a book of one chapter's first seconds), follow it, write its chapter file."""
    suffix = args.out.suffix.lower().lstrip(".")
    if suffix not in ("flac", "wav"):
        raise BadInput(f"--out {args.out}: a preview is written as .flac or .wav")
    check_preview_chapter(read_file(args.book, "book file"), args.book, args.chapter)  # before any upload
    args.book_output, args.chapters = suffix, str(args.chapter)
    form = {**_form(args), "preview_s": str(args.seconds)}
    api, book = _submit(args, form)
    book = follow_book(api, book["id"])
    for note in book.get("notes") or []:
        print(f"wavefarm: note: book {book['id'][:8]}: {note}", file=sys.stderr)
    if not finished_well("book", book):
        return 1
    args.out.parent.mkdir(parents=True, exist_ok=True)
    from app.books.files import chapter_file_name

    api.book_file(book["id"], chapter_file_name(0, suffix), args.out)
    print(f"preview of chapter {args.chapter} written to {args.out}")
    return 0


def _submit(args: argparse.Namespace, form: dict[str, str]) -> tuple[Any, dict[str, Any]]:
    """Upload the voice and the cast's references if need be, submit the book, print its id."""
    voice_argument(args.voice)  # a bad --voice is refused before the book is read
    data = read_file(args.book, "book file")
    api = client(args)
    if args.cast is not None:
        form["cast"] = json.dumps(cast_ids(api, args.cast))
    book = api.submit_book(data, args.book.name, voice_id_for(api, args.voice), form,
                           args.book.resolve().parent)
    print(book["id"])
    return api, book


def cmd_book_render(args: argparse.Namespace) -> int:
    api, book = _submit(args, _form(args))
    if not (args.wait or args.out):
        return 0
    book = follow_book(api, book["id"])
    for note in book.get("notes") or []:  # dummy weights, the stand-in tokenizer: said plainly
        print(f"wavefarm: note: book {book['id'][:8]}: {note}", file=sys.stderr)
    if not finished_well("book", book):
        return 1
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        for name in book["files"]:
            api.book_file(book["id"], name, args.out / name)
        print(f"{len(book['files'])} files written to {args.out}")
    return 0


def follow_book(api: Any, book_id: str, poll_s: float = 1.0) -> dict[str, Any]:
    """Poll a book until it finishes, with a tqdm bar over its segments; returns the last state."""
    from tqdm import tqdm

    book = api.book(book_id)
    with tqdm(total=book["segments_total"] or None, unit="seg", desc=bar_label(book["title"])) as bar:
        while True:
            if bar.desc != bar_label(book["title"]):  # read: the book's own title replaces the file's
                bar.set_description_str(bar_label(book["title"]))
            bar.total = book["segments_total"] or bar.total
            eta = f", ETA {book['eta_s']:.0f} s" if book.get("eta_s") else ""
            what = (f"reading the book ({book.get('parse_lane', 'quick')} lane, waited "
                    f"{book.get('parse_wait_s', 0):.0f} s)" if book["status"] == "parsing"
                    else f"{book['audio_seconds']:.0f} s audio")
            bar.set_postfix_str(f"{book['status']}, {what}{eta}")
            bar.update(book["segments_done"] - bar.n)
            if book["status"] in ("succeeded", "failed", "cancelled"):
                return book
            time.sleep(poll_s)
            book = api.book(book_id)


def cmd_book_status(args: argparse.Namespace) -> int:
    api = client(args)
    book = api.book(args.book_id)
    eta = f"  ETA {book['eta_s']:.0f} s" if book.get("eta_s") else ""
    length = f", {book['seconds']:.2f} s with pauses (M4B)" if book.get("seconds") is not None else ""
    print(f"{book['id']}  {book['status']}  {book['segments_done']}/{book['segments_total']} segments  "
          f"{book['audio_seconds']:.1f} s speech{length}{eta}  {book['title']}"
          + (f"  (chapters {book['chapters_selected']})" if book.get("chapters_selected") else ""))
    for note in book.get("notes") or []:
        print(f"  note: {note}")
    for c in book["chapters"]:
        loud = (f"  {c['loudness_lufs']:.1f} LUFS, {c['true_peak_dbtp']:.1f} dBTP"
                if c.get("loudness_lufs") is not None and c.get("true_peak_dbtp") is not None else "")
        length = f" ({c['seconds']:.2f} s with pauses)" if c.get("seconds") is not None else ""
        print(f"  {c['index'] + 1:>3}. {c['segments_done']:>4}/{c['segments_total']:<4} "
              f"{c['audio_seconds']:>7.1f} s speech{length}  {c['title']}{loud}")
    _print_quality(api.book_quality(book["id"]))
    if book.get("error"):
        print(f"  error: {book['error']}")
    return 0


def _print_quality(quality: dict) -> None:
    """The book's gate and its totals, its notes, and each failed segment kept: why, what it says, where
    to play it."""
    t = quality["totals"]
    gate = quality.get("mode", "on")
    if any(t.values()) or gate != "on":
        print(f"  quality (gate {gate}): {t['passed']} passed, {t['rerendered']} re-rendered, {t['failed']} "
              f"failed (kept), {t['unheard']} not heard")
    for note in quality.get("notes") or []:
        print(f"  quality note: {note}")
    for w in quality["worst"]:
        text = f"; {w['text'][:60]!r}" if w["text"] else ""
        print(f"    chapter {w['chapter'] + 1}, segment {w['key'][:12]}, {w['attempts']} renders: "
              f"{'; '.join(w['reasons'])}{text}  {w['audio']}")


def cmd_book_cancel(args: argparse.Namespace) -> int:
    book = client(args).cancel_book(args.book_id)
    print(f"book {book['id']}: {book['status']}")
    return 0
