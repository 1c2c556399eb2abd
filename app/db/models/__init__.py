"""SQLAlchemy 2.0 models: the source of truth for voices, jobs, GPU workers and their installs, and books.

Only table definitions live here; reading and writing goes through
`app.db.queries`. Types are chosen to behave the same on SQLite and
PostgreSQL (strings for enums and ids, JSON for token lists, UTC datetimes).
Every model is imported from here (`from app.db.models import Job`); the files are by role:

    base   the declarative base, its naming convention, UTC datetimes, CHECK helpers
    jobs   voices, jobs, GPU workers, the voices each holds and their install events
    books  books, their chapters, segments and the segments each book reads
"""

from app.db.models.base import (
    NAMING_CONVENTION,
    Base,
    UTCDateTime,
    one_of,
    utcnow,
)
from app.db.models.books import (
    LIVE_BOOK_STATUSES,
    Book,
    BookChapter,
    BookSegment,
    BookStatus,
    Segment,
    SegmentKind,
)
from app.db.models.jobs import (
    DONE_JOB_STATUSES,
    LIVE_JOB_STATUSES,
    InstallEvent,
    Job,
    JobKind,
    JobStatus,
    PrepPath,
    Voice,
    VoiceStatus,
    Worker,
    WorkerVoice,
)

__all__ = [
    "Base",
    "Book",
    "BookChapter",
    "BookSegment",
    "BookStatus",
    "DONE_JOB_STATUSES",
    "DONE_JOB_STATUSES",
    "InstallEvent",
    "Job",
    "JobKind",
    "JobKind",
    "JobStatus",
    "JobStatus",
    "LIVE_BOOK_STATUSES",
    "LIVE_JOB_STATUSES",
    "LIVE_JOB_STATUSES",
    "NAMING_CONVENTION",
    "PrepPath",
    "PrepPath",
    "Segment",
    "SegmentKind",
    "UTCDateTime",
    "Voice",
    "VoiceStatus",
    "VoiceStatus",
    "Worker",
    "WorkerVoice",
    "one_of",
    "utcnow",
]
