"""The artifact root: reference audio, token lists and outputs on disk.

Layout (every name is derived by us, never taken from a client):
    references/<sha256 of the file>.<wav|flac|ogg|mp3>
    tokens/<job id>.json
    outputs/<job id>.<wav|flac>
    tmp/                       partial files; renamed into place when complete
Files are written under tmp/, fsynced, then `os.replace`d, so a reader sees
a whole file or none. The database stores paths relative to the root. This
module knows nothing about the database: callers pass the paths it refers to
when they ask for orphans.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
import time
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from app.speech import OutputFormat
from app.storage.keys import check_job_id

REFERENCES, TOKENS, OUTPUTS, TMP = "references", "tokens", "outputs", "tmp"
_PARTIAL = re.compile(r"\.([0-9a-f-]{36})\.(?:wav|flac)\.[^/]+\.part")
# soundfile's format names -> our extensions
REFERENCE_FORMATS = {"WAV": "wav", "FLAC": "flac", "OGG": "ogg", "MP3": "mp3"}

_RELPATH = re.compile(
    r"references/[0-9a-f]{64}\.(wav|flac|ogg|mp3)"
    r"|tokens/[0-9a-f-]{36}\.json"
    r"|outputs/[0-9a-f-]{36}\.(wav|flac)"
)


@contextmanager
def atomic_path(path: Path) -> Iterator[Path]:
    """Yield a temp path beside `path` to write; renamed into place on success, removed on failure (for
    files outside the layout, e.g. a book's outputs, whose readers must see a whole file or none)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".part", dir=path.parent)
    os.close(fd)
    try:
        yield Path(tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_text(path: Path, text: str) -> None:
    """UTF-8 text to `path`, atomically (`atomic_path`)."""
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


class ArtifactStore:
    """Files under one root; every public method takes or returns root-relative paths."""

    def __init__(self, root: Path | str) -> None:
        self.root = Path(root).resolve()

    def ensure_layout(self) -> None:
        for sub in (REFERENCES, TOKENS, OUTPUTS, TMP):
            (self.root / sub).mkdir(parents=True, exist_ok=True)

    def path(self, relpath: str) -> Path:
        """Absolute path of a stored artifact; refuses anything outside the layout."""
        if not _RELPATH.fullmatch(relpath):
            raise ValueError(f"not an artifact path: {relpath!r}")
        return self.root / relpath

    # Writing ------------------------------------------------------------------

    def temp_path(self, suffix: str = "") -> Path:
        """A fresh name under tmp/ (nothing is created)."""
        if suffix and not re.fullmatch(r"\.[a-z0-9]{1,8}", suffix):
            raise ValueError(f"bad temp suffix {suffix!r}")
        (self.root / TMP).mkdir(parents=True, exist_ok=True)
        return self.root / TMP / f"{uuid.uuid4().hex}{suffix}.part"

    @contextmanager
    def writing(self, relpath: str) -> Iterator[Path]:
        """Yield a temp path to write; on success it is fsynced and renamed to `relpath`."""
        dest = self.path(relpath)
        tmp = self.temp_path(dest.suffix)
        try:
            yield tmp
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
            dest.parent.mkdir(parents=True, exist_ok=True)
            os.replace(tmp, dest)
        finally:
            tmp.unlink(missing_ok=True)

    def write_bytes(self, relpath: str, data: bytes) -> None:
        with self.writing(relpath) as tmp:
            tmp.write_bytes(data)

    # References ---------------------------------------------------------------

    def put_reference(self, data: bytes, fmt: str) -> str:
        """Store reference file bytes under their sha256; `fmt` is soundfile's format name."""
        ext = REFERENCE_FORMATS.get(fmt.upper())
        if ext is None:
            raise ValueError(f"unsupported reference format {fmt!r}")
        relpath = f"{REFERENCES}/{hashlib.sha256(data).hexdigest()}.{ext}"
        if not self.path(relpath).exists():  # same name, same bytes: nothing to do
            self.write_bytes(relpath, data)
        return relpath

    def read_bytes(self, relpath: str) -> bytes:
        return self.path(relpath).read_bytes()

    # Tokens and outputs ---------------------------------------------------------

    def tokens_relpath(self, job_id: str) -> str:
        return f"{TOKENS}/{check_job_id(job_id)}.json"

    def put_tokens(self, job_id: str, tokens: Sequence[int]) -> str:
        relpath = self.tokens_relpath(job_id)
        self.write_bytes(relpath, json.dumps(list(tokens), separators=(",", ":")).encode())
        return relpath

    def read_tokens(self, relpath: str) -> list[int]:
        tokens = json.loads(self.read_bytes(relpath))
        assert isinstance(tokens, list), f"{relpath} does not hold a token list"
        return tokens

    def output_relpath(self, job_id: str, fmt: str) -> str:
        if fmt not in tuple(OutputFormat):
            raise ValueError(f"output format {fmt!r} is not one of {[f.value for f in OutputFormat]}")
        return f"{OUTPUTS}/{check_job_id(job_id)}.{fmt}"

    def output_path(self, job_id: str, fmt: str) -> Path:
        return self.path(self.output_relpath(job_id, fmt))

    def remove(self, relpath: str) -> bool:
        try:
            self.path(relpath).unlink()
        except FileNotFoundError:
            return False
        return True

    # Housekeeping ---------------------------------------------------------------

    def partial_outputs(self) -> dict[str, list[Path]]:
        """Job id -> the partial outputs under outputs/ (`.<job id>.<fmt>.<random>.part`, written while
        a job streams; a killed worker leaves its own behind)."""
        found: dict[str, list[Path]] = {}
        folder = self.root / OUTPUTS
        if not folder.is_dir():
            return found
        with os.scandir(folder) as entries:
            for entry in entries:
                match = _PARTIAL.fullmatch(entry.name)
                if match is not None:
                    found.setdefault(match.group(1), []).append(Path(entry.path))
        return found

    def list_orphans(self, *, referenced: set[str], older_than_s: float = 3600.0) -> list[Path]:
        """Files nothing refers to, last modified more than `older_than_s` ago.

        `referenced` is every relative path the database points at
        (`app.db.queries.referenced_paths`). The age guard keeps a file whose
        row is still being committed, or a temp file being written, off the list."""
        cutoff = time.time() - older_than_s
        orphans: list[Path] = []
        for sub in (REFERENCES, TOKENS, OUTPUTS, TMP):
            folder = self.root / sub
            if not folder.is_dir():
                continue
            for entry in folder.iterdir():
                relpath = f"{sub}/{entry.name}"
                if sub != TMP and relpath in referenced:
                    continue
                try:
                    if entry.is_file() and entry.stat().st_mtime < cutoff:
                        orphans.append(entry)
                except FileNotFoundError:  # removed while we looked
                    continue
        return sorted(orphans)
