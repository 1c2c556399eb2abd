"""Every change of state of a job, a book, a chapter and a segment, in one package: nothing else writes
those columns (`tests/test_layering.py` checks it); routes, tasks, the GPU worker and the reconciler call
these functions. docs/RELIABILITY.md draws the state diagrams.

    jobs   claim (a lease), mark_running, renew, release, settle/finish, cancel, ring (a queued job's
           doorbell), ring_many (a group of jobs at once)
    books  a book's reading, plan and status; chapters scheduled, ready (the outbox of `book.chapter`),
           rung, checked, assembled; segments linked to a job, failed, reopened, and the chapter counters
           every change of a segment's outcome moves
    chapters  a chapter's render as a lease: claimed, renewed, released, expired
    readings  a book's reading claimed (an attempt), and moved to the long lane
    quality   the quality gate's verdict on a segment's render
    outbox    settling a job, then sending the follow-up its transaction recorded (a ready chapter's
              `book.chapter`)

Callers use this package's names (`lifecycle.claim(...)`, `lifecycle.set_book_status(...)`).
"""

from __future__ import annotations

from app.lifecycle.books import (
    add_book_plan,
    claim_next_chapter,
    count_outcome,
    fail_segment,
    link_segment_job,
    mark_chapter_assembled,
    mark_chapter_checked,
    mark_chapter_rung,
    record_ready,
    reopen_failed_segments,
    set_book_status,
    touch_chapter,
    unlink_segment_job,
)
from app.lifecycle.chapters import (
    RENDER_LEASE_S,
    claim_render,
    expire_renders,
    release_render,
    renew_render,
)
from app.lifecycle.jobs import (
    CLAIMED,
    RING_BACKOFF_MAX,
    Settled,
    cancel,
    claim,
    finish,
    is_leased,
    mark_running,
    release,
    renew,
    ring,
    ring_many,
    settle,
)
from app.lifecycle.outbox import settle_and_send
from app.lifecycle.quality import record_quality
from app.lifecycle.readings import LONG, QUICK, claim_reading, demote_reading

__all__ = [
    "CLAIMED", "LONG", "QUICK", "RENDER_LEASE_S", "RING_BACKOFF_MAX", "Settled", "add_book_plan", "cancel",
    "claim", "claim_next_chapter", "claim_reading", "claim_render", "count_outcome", "demote_reading",
    "expire_renders", "fail_segment", "finish", "is_leased", "link_segment_job", "mark_chapter_assembled",
    "mark_chapter_checked", "mark_chapter_rung", "mark_running", "record_quality", "record_ready",
    "release", "release_render", "renew", "renew_render", "reopen_failed_segments", "ring", "ring_many",
    "set_book_status", "settle", "settle_and_send", "touch_chapter", "unlink_segment_job",
]
