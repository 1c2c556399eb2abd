"""Keyword-only data access over `app.db.models`.

Every function takes `session=` and flushes its work; the caller owns the
transaction (`app.db.session.session_scope`). State changes that may race
(claims, progress, finishing) are single conditional UPDATEs, so two
processes never both win. Inserts that may race use INSERT .. ON CONFLICT
DO NOTHING (SQLite and PostgreSQL both have it).

    voices       voice rows, preparation states, uses, live jobs, referenced artifact paths
    jobs         job creation (idempotent), tokens, notes, listing (state changes: `app.lifecycle`)
    installs     which voices each GPU worker holds, pins, last use
    workers      GPU worker incarnations and heartbeats;
                 the routing reads (live workers, backlogs, voice holders) and job routes
    maintenance  the reconciler's reads: leases that passed, doorbells due, abandoned ready voices
    books        books, chapters, segments and their jobs: creation and reads (their state changes:
                 `app.lifecycle.books`)
    chapters     the chapter counters' reads and locks, the outbox's reads (the counting itself:
                 `app.lifecycle.books`)
    quality      what the quality gate last heard of each book segment
    stats        books by status and the chapters of live books, for the API's metrics
    _common      private helpers (error clipping, UPDATE row counts, dialect INSERTs)

Callers use this package's names (`queries.require_job(...)`), not the submodules.
"""

from __future__ import annotations

from app.db.queries._common import ERROR_MAX_CHARS
from app.db.queries.books import (
    NewBook,
    PlannedChapter,
    SegmentState,
    book_ids_with_prefix,
    book_segment_states,
    count_live_books_with_segment,
    count_rendering_segments,
    create_book,
    gather_book_notes,
    get_book,
    get_segment,
    list_books,
    list_chapters,
    list_unsent_chapters,
    page_books,
    reading_candidates,
    renders_segment,
    require_book,
    segment_renders,
    segment_state,
)
from app.db.queries.chapters import (
    ChapterRow,
    chapter_ready_at,
    list_chapters_of,
    list_unchecked_chapters,
)
from app.db.queries.installs import (
    clear_worker_voices,
    get_worker_voice,
    list_install_events,
    list_worker_voices,
    pin_worker_voice,
    record_install,
    remove_worker_voice,
)
from app.db.queries.jobs import (
    NewJob,
    add_job_note,
    count_jobs_by_status,
    create_job,
    create_job_using_voice,
    delete_jobs,
    get_job,
    get_job_by_idempotency_key,
    get_jobs,
    insert_jobs,
    is_tokenized,
    job_ids_with_prefix,
    jobs_by_idempotency_keys,
    list_jobs,
    page_jobs,
    require_job,
    set_job_tokens,
)
from app.db.queries.maintenance import (
    list_abandoned_ready_voices,
    list_claims_before,
    list_due_rings,
    list_ended_jobs,
    list_expired_leases,
    list_queued_on_gone_workers,
)
from app.db.queries.quality import HeardSegment, SegmentQuality, book_segment_quality, heard_segments
from app.db.queries.stats import count_books_by_status, count_live_book_chapters
from app.db.queries.voices import (
    VoiceUse,
    add_voice_use,
    count_live_jobs,
    get_or_create_voice,
    get_voice,
    get_voice_by_name,
    is_voice_abandoned,
    list_voices,
    mark_voice_failed,
    mark_voice_pending,
    mark_voice_preparing,
    mark_voice_ready,
    referenced_paths,
    require_voice,
    set_voice_name,
    use_voice,
    voice_ids_with_prefix,
    voice_names,
)
from app.db.queries.workers import (
    LiveWorker,
    beat,
    count_jobs_by_route,
    get_worker,
    list_gone_workers,
    list_worker_names,
    live_worker_beats,
    live_worker_rows,
    live_workers,
    live_workers_on_dummy_weights,
    mark_worker_stopped,
    register_worker,
    set_job_route,
    voice_holders,
    worker_backlogs,
    worker_slots,
)

__all__ = [
    "ERROR_MAX_CHARS",
    "job_ids_with_prefix",
    "book_ids_with_prefix",
    # stats
    "count_books_by_status",
    "count_live_book_chapters",
    # voices
    "get_voice",
    "require_voice",
    "get_or_create_voice",
    "get_voice_by_name",
    "set_voice_name",
    "voice_ids_with_prefix",
    "voice_names",
    "list_voices",
    "add_voice_use",
    "use_voice",
    "VoiceUse",
    "mark_voice_pending",
    "mark_voice_preparing",
    "mark_voice_ready",
    "mark_voice_failed",
    "count_live_jobs",
    "is_voice_abandoned",
    "referenced_paths",
    # jobs
    "get_job",
    "get_jobs",
    "require_job",
    "get_job_by_idempotency_key",
    "create_job",
    "create_job_using_voice",
    "NewBook",
    "NewJob",
    "insert_jobs",
    "jobs_by_idempotency_keys",
    "delete_jobs",
    "set_job_tokens",
    "is_tokenized",
    "add_job_note",
    "list_jobs",
    "page_jobs",
    "count_jobs_by_status",
    # worker installs
    "get_worker_voice",
    "record_install",
    "list_install_events",
    "pin_worker_voice",
    "remove_worker_voice",
    "list_worker_voices",
    "clear_worker_voices",
    # GPU workers
    "register_worker",
    "beat",
    "mark_worker_stopped",
    "get_worker",
    # routing
    "live_workers",
    "live_workers_on_dummy_weights",
    "worker_backlogs",
    "worker_slots",
    "LiveWorker",
    "live_worker_beats",
    "live_worker_rows",
    "voice_holders",
    "set_job_route",
    "list_gone_workers",
    "list_worker_names",
    "count_jobs_by_route",
    # maintenance
    "list_expired_leases",
    "list_claims_before",
    "list_queued_on_gone_workers",
    "list_due_rings",
    "list_ended_jobs",
    "list_abandoned_ready_voices",
    # books and segments
    "PlannedChapter",
    "create_book",
    "get_book",
    "require_book",
    "list_books",
    "page_books",
    "reading_candidates",
    "list_chapters",
    "count_rendering_segments",
    "list_unsent_chapters",
    "SegmentState",
    "book_segment_states",
    "gather_book_notes",
    "segment_state",
    "get_segment",
    "renders_segment",
    "segment_renders",
    # chapter counters and the outbox of book.chapter
    "ChapterRow",
    "list_chapters_of",
    "chapter_ready_at",
    "list_unchecked_chapters",
    "count_live_books_with_segment",
    # the quality gate's reads
    "HeardSegment",
    "heard_segments",
    "SegmentQuality",
    "book_segment_quality",
]
