"""The one place a submitted book file is read: `python -m app.books.intake_child JOB.json`, a child process
that sets hard limits on itself first, so a hostile file costs at most those limits and never a worker.

    plan_submission(files, submission, job) -> (BookPlan, SourceBook)   pure: parse, select chapters,
                                         lexicon and cast, the timed span, plan (no database, no Redis)
    main(argv)                           the child: limits, plan_submission, then the book's files
                                         (plan.json, meta.json, cover, with epub3 readalong.json: the
                                         text as shown, cut at the segments) and `outcome.json` last

`outcome.json` is {"ok": true, "book": {...}, "chapters": [[title, est_seconds, [[key, kind, voice],
...]], ...], "voices": [...]} (what the parent writes to the database, without reading the plan again),
or {"ok": false, "error": reason}. Every exception of every reader is mapped to a reason here, at one
boundary (`reason_of`); a child that dies without an outcome (a limit's signal) is explained by its
parent (`app.books.intake`). The parent writes the job (`ParseJob`) and reads the outcome.
"""

from __future__ import annotations

import errno
import json
import logging
import resource
import signal
import sys
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from app.books.files import SKELETON, store_files, store_readalong
from app.books.planning.cast import parse_cast
from app.books.planning.lexicon import EMPTY, Budget, Lexicon, load_lexicon, parse_lexicon
from app.books.planning.plan import BookPlan, plan_book, preview_plan
from app.books.planning.readalong import readalong_text
from app.books.planning.readalong_source import own_documents
from app.books.planning.select import describe, parse_chapters
from app.books.reading.parse import parse_book, sniff_format
from app.books.reading.source import DEFAULT_LIMITS, BookLimits, SourceBook, with_metadata
from app.books.submission import Submission, SubmittedFiles
from app.errors import BadInput, first_line
from app.speech import TOKEN_RATE

log = logging.getLogger(__name__)

OUTCOME = "outcome.json"
_MB = 1024 * 1024


@dataclass(frozen=True)
class ChildLimits:
    """What the child may use: CPU seconds, address space and the size of any file it writes (MB)."""

    cpu_s: int
    memory_mb: int
    output_mb: int


@dataclass(frozen=True)
class ParseJob:
    """Everything the child needs beyond the stored inputs: what the parent's settings say."""

    folder: str  # the book's folder (books/<id>/)
    voice_id: str  # the book's voice
    render_options: dict[str, Any]  # into every segment key (seed, model)
    limits: ChildLimits
    max_timed_span_s: float
    lexicon_budget_s: float
    default_lexicon: str | None = None  # WAVEFARM_LEXICON
    guide: dict[str, Any] | None = field(default=None)  # the guide voice's identity for text keys

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> ParseJob:
        data = json.loads(text)
        return cls(**{**data, "limits": ChildLimits(**data["limits"])})


def plan_submission(files: SubmittedFiles, submission: Submission, job: ParseJob,
                    limits: BookLimits = DEFAULT_LIMITS) -> tuple[BookPlan, SourceBook, str | None]:
    """The stored upload -> (plan, source, chapter selection as recorded); BadInput with the reason."""
    data = files.source.read_bytes()
    fmt = submission.book_format or sniff_format(data, submission.filename)
    base_dir = Path(submission.base_dir) if submission.base_dir else None
    source = parse_book(data, fmt=fmt, filename=submission.filename, title=submission.title,
                        author=submission.author, language=submission.language, base_dir=base_dir,
                        limits=limits)
    del data
    source = with_metadata(source, narrator=submission.narrator, description=submission.description,
                           publication=submission.publication, limits=limits)
    selected = None
    if submission.chapters is not None:
        indices = parse_chapters(submission.chapters, len(source.chapters))
        source = replace(source, chapters=tuple(source.chapters[i] for i in indices))
        selected = describe(indices)
    if submission.options.timed:
        check_timed_span(source, job.max_timed_span_s)
    lexicon = _lexicon(files, job)
    cast = parse_cast(files.cast.read_bytes()) if files.cast.is_file() else {}
    guide = _guide(source, job)
    plan = plan_book(source, voice_id=job.voice_id, render_options=job.render_options, guide_options=guide,
                     limits=limits, lexicon=lexicon, cast=cast,
                     lexicon_budget=Budget(job.lexicon_budget_s))
    options = submission.options
    if options.preview_s is not None:
        plan = preview_plan(plan, options.preview_s)
    plan = replace(plan, series=" ".join((options.series or "").split()),
                   series_part=options.series_part or "")
    return plan, source, selected


def _lexicon(files: SubmittedFiles, job: ParseJob) -> Lexicon:
    own = parse_lexicon(files.lexicon.read_bytes()) if files.lexicon.is_file() else EMPTY
    try:
        default = load_lexicon(Path(job.default_lexicon) if job.default_lexicon else None)
    except BadInput:  # the operator's file, not the client's: no server path in the client's reason
        raise BadInput("the service's default lexicon (WAVEFARM_LEXICON) cannot be read; the service's "
                       "/healthz says why (an operator must fix it)") from None
    return own.over(default)


def _guide(source: SourceBook, job: ParseJob) -> dict[str, Any] | None:
    """The guide voice's identity for text keys (None for a book of tokens); refuses a language no
    guide voice speaks."""
    if not any(c.paragraphs for c in source.chapters):
        return None
    if job.guide is not None:  # given by the parent (tests; a parent that knows it already)
        return job.guide
    from app.text.guide_voice import identity, options_for

    return identity(options_for(source.language))


def check_timed_span(source: SourceBook, max_span_s: float) -> None:
    """A timed book's cues must all start within `max_span_s`: its chapter files are that long."""
    limit_ms = max_span_s * 1000
    for chapter in source.chapters:
        for i, start in enumerate(chapter.starts_ms):
            if start > limit_ms:
                raise BadInput(
                    f"cue {i + 1} ({chapter.paragraphs[i][:40]!r}) starts at {_clock(start)}, past the "
                    f"timed span limit of {_clock(limit_ms)} (WAVEFARM_BOOK_MAX_TIMED_SPAN_S)")


def _clock(ms: float) -> str:
    seconds = int(ms // 1000)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def _own_documents(files: SubmittedFiles, submission: Submission, source: SourceBook,
                   plan: BookPlan) -> dict[str, Any] | None:
    """An EPUB source's own XHTML with its segments wrapped (None: not an EPUB, or not annotatable)."""
    data = files.source.read_bytes()
    if (submission.book_format or sniff_format(data, submission.filename)) != "epub":
        return None
    return own_documents(data, source, plan, DEFAULT_LIMITS, files.folder / SKELETON)


def reason_of(exc: BaseException, limits: ChildLimits) -> str:
    """Any exception from reading a book -> the reason its client reads. The readers raise BadInput
    themselves where they can; the rest are a library's refusals of a file it cannot read."""
    if isinstance(exc, BadInput):
        return str(exc)
    if isinstance(exc, MemoryError):
        return f"reading the book needs more than its memory limit of {limits.memory_mb} MB"
    if isinstance(exc, RecursionError):
        return "the book is nested too deeply to read"
    if isinstance(exc, OSError) and exc.errno == errno.EFBIG:
        return f"the book's plan is larger than the limit of {limits.output_mb} MB"
    return f"the book cannot be read: {type(exc).__name__}: {first_line(exc)[:300]}"


def outcome_of(plan: BookPlan, source: SourceBook, selected: str | None) -> dict[str, Any]:
    chapters = [[c.title, sum(s.est_tokens for s in c.segments) / TOKEN_RATE,
                 [[s.key, s.kind, plan.voice_of(s)] for s in c.segments]] for c in plan.chapters]
    book = {"title": plan.title, "author": plan.author, "language": plan.language, "plan_key": plan.key,
            "chapters_selected": selected, "cover": source.cover is not None}
    return {"ok": True, "book": book, "chapters": chapters, "voices": plan.voices()[1:]}


def limit_self(limits: ChildLimits) -> None:
    """Hard limits on this process, before it reads anything. Past the CPU limit the kernel sends
    SIGXCPU (then SIGKILL); past the address space an allocation fails (MemoryError); past the file
    size a write fails (EFBIG, with SIGXFSZ ignored); no core files."""
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    for which, soft, hard in ((resource.RLIMIT_CPU, limits.cpu_s, limits.cpu_s + 5),
                              (resource.RLIMIT_AS, limits.memory_mb * _MB, limits.memory_mb * _MB),
                              (resource.RLIMIT_FSIZE, limits.output_mb * _MB, limits.output_mb * _MB),
                              (resource.RLIMIT_CORE, 0, 0)):
        resource.setrlimit(which, (soft, hard))


def run(job: ParseJob) -> dict[str, Any]:
    files = SubmittedFiles(Path(job.folder))
    try:
        submission = Submission.from_json(files.request.read_text(encoding="utf-8"))
        plan, source, selected = plan_submission(files, submission, job)
        base_dir = Path(submission.base_dir) if submission.base_dir else None
        store_files(Path(job.folder), plan, source, base_dir)
        if submission.options.epub3:
            texts = readalong_text(source, plan)
            store_readalong(Path(job.folder), texts, _own_documents(files, submission, source, plan))
        return outcome_of(plan, source, selected)
    except Exception as exc:  # the boundary: every reader's exception becomes a reason
        if not isinstance(exc, BadInput):
            log.warning("book reader: %s", exc, exc_info=True)
        return {"ok": False, "error": reason_of(exc, job.limits)}


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    job = ParseJob.from_json(Path(args[0]).read_text(encoding="utf-8"))
    limit_self(job.limits)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    try:
        outcome = run(job)
    except MemoryError:  # outside `run`'s boundary: while writing the plan
        outcome = {"ok": False, "error": reason_of(MemoryError(), job.limits)}
    text = json.dumps(outcome, ensure_ascii=False)
    tmp = Path(job.folder) / f".{OUTCOME}.part"
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(Path(job.folder) / OUTCOME)
    return 0


if __name__ == "__main__":
    sys.exit(main())
