"""The API's client for the CLI: `HttpClient` (httpx), the `Client` protocol it shares with
`app.api.local.LocalClient` (the same operations on the services in this process, for `--local`), and
`follow`, which polls a job with a progress bar.

Both clients answer with the API's JSON shapes (`JobOut`, `VoiceOut`, `BookOut` as dicts), so the CLI
prints one thing whichever way it went. HTTP errors come back as the error tree (BadInput, NotFound, ...).
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import httpx

from app.errors import BadAudio, BadInput, BadTokens, NotFound, WavefarmError

POLL_S = 0.5
ERRORS: dict[str, type[WavefarmError]] = {"BadAudio": BadAudio, "BadTokens": BadTokens, "NotFound": NotFound}


class ApiError(WavefarmError):
    """The API refused a request or could not be reached; the message says which and why."""


class Client(Protocol):
    def submit(self, *, voice: str | bytes, tokens: Sequence[Any] | None, seed: int | None,
               output_format: str, priority: int, idempotency_key: str | None, text: str | None = None,
               language: str | None = None) -> dict[str, Any]: ...
    def submit_batch(self, items: list[Any]) -> dict[str, Any]: ...
    def job(self, job_id: str) -> dict[str, Any]: ...
    def jobs(self, *, status: str | None, voice_id: str | None, limit: int) -> list[dict[str, Any]]: ...
    def jobs_page(self, *, status: str | None, voice_id: str | None, after: str | None,
                  limit: int) -> tuple[list[dict[str, Any]], str | None]: ...
    def cancel(self, job_id: str) -> dict[str, Any]: ...
    def audio(self, job_id: str) -> bytes: ...
    def voices(self) -> list[dict[str, Any]]: ...
    def add_voice(self, data: bytes) -> dict[str, Any]: ...
    def rename_voice(self, voice: str, name: str | None) -> dict[str, Any]: ...
    def submit_book(self, data: bytes, filename: str, voice: str | bytes, form: dict[str, str],
                    base_dir: Path) -> dict[str, Any]: ...
    def book(self, book_id: str) -> dict[str, Any]: ...
    def book_quality(self, book_id: str) -> dict[str, Any]: ...
    def books_page(self, *, after: str | None, limit: int) -> tuple[list[dict[str, Any]], str | None]: ...
    def cancel_book(self, book_id: str) -> dict[str, Any]: ...
    def book_file(self, book_id: str, name: str, dest: Path) -> None: ...


class HttpClient:
    def __init__(self, base_url: str, *, token: str | None = None, timeout: float = 60.0,
                 transport: httpx.BaseTransport | None = None) -> None:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.http = httpx.Client(base_url=base_url, headers=headers, timeout=timeout, transport=transport)

    def _call(self, method: str, url: str, **kwargs: Any) -> httpx.Response:
        try:
            response = self.http.request(method, url, **kwargs)
        except httpx.TransportError as exc:
            raise ApiError(f"cannot reach the API at {self.http.base_url} ({exc}); is `wavefarm serve` "
                           "running, or did you mean --local?") from exc
        if response.status_code >= 400:
            raise _error(response)
        return response

    def submit(self, *, voice: str | bytes, tokens: Sequence[Any] | None, seed: int | None,
               output_format: str, priority: int, idempotency_key: str | None, text: str | None = None,
               language: str | None = None) -> dict[str, Any]:
        if isinstance(voice, bytes):
            form = {"output_format": output_format, "priority": str(priority)}
            for name, value in (("seed", seed), ("idempotency_key", idempotency_key), ("text", text),
                                ("language", language)):
                if value is not None and value != "":
                    form[name] = str(value)
            files = {"reference": ("reference", voice)}
            if tokens is not None:
                files["tokens"] = ("tokens.json", json.dumps(list(tokens)).encode())
            return self._call("POST", "/v1/jobs", data=form, files=files).json()
        body = {"voice_id": voice, "tokens": None if tokens is None else list(tokens), "text": text,
                "language": language, "seed": seed, "output_format": output_format, "priority": priority,
                "idempotency_key": idempotency_key}
        return self._call("POST", "/v1/jobs", json={k: v for k, v in body.items() if v is not None}).json()

    def submit_batch(self, items: list[Any]) -> dict[str, Any]:
        """Up to 1000 job requests (dicts as POST /v1/jobs takes them as JSON): the BatchOut answer."""
        return self._call("POST", "/v1/jobs/batch", json=items).json()

    def job(self, job_id: str) -> dict[str, Any]:
        return self._call("GET", f"/v1/jobs/{job_id}").json()

    def jobs(self, *, status: str | None = None, voice_id: str | None = None,
             limit: int = 100) -> list[dict[str, Any]]:
        return self.jobs_page(status=status, voice_id=voice_id, after=None, limit=limit)[0]

    def jobs_page(self, *, status: str | None, voice_id: str | None, after: str | None,
                  limit: int) -> tuple[list[dict[str, Any]], str | None]:
        """A page newest first, and the next page's cursor (None: the last page)."""
        params = {k: v for k, v in (("status", status), ("voice_id", voice_id), ("after", after)) if v}
        response = self._call("GET", "/v1/jobs", params={**params, "limit": limit})
        return response.json(), response.headers.get("x-next-cursor")

    def cancel(self, job_id: str) -> dict[str, Any]:
        return self._call("POST", f"/v1/jobs/{job_id}/cancel").json()

    def audio(self, job_id: str) -> bytes:
        return self._call("GET", f"/v1/jobs/{job_id}/audio").content

    def voices(self) -> list[dict[str, Any]]:
        return self._call("GET", "/v1/voices").json()

    def add_voice(self, data: bytes) -> dict[str, Any]:
        """The voice, with `created`: False when it was stored already (HTTP 200, not 201)."""
        response = self._call("POST", "/v1/voices", files={"reference": ("reference", data)})
        return {**response.json(), "created": response.status_code == 201}

    def rename_voice(self, voice: str, name: str | None) -> dict[str, Any]:
        return self._call("PATCH", f"/v1/voices/{voice}", json={"name": name}).json()

    def submit_book(self, data: bytes, filename: str, voice: str | bytes, form: dict[str, str],
                    base_dir: Path) -> dict[str, Any]:
        """A book file and its options (the form's fields); `base_dir` is the local client's only."""
        files: dict[str, Any] = {"book": (filename, data)}
        if isinstance(voice, bytes):
            files["reference"] = ("reference", voice)
        else:
            form = {**form, "voice_id": voice}
        return self._call("POST", "/v1/books", data=form, files=files).json()

    def book(self, book_id: str) -> dict[str, Any]:
        return self._call("GET", f"/v1/books/{book_id}").json()

    def book_quality(self, book_id: str) -> dict[str, Any]:
        return self._call("GET", f"/v1/books/{book_id}/quality").json()

    def books_page(self, *, after: str | None, limit: int) -> tuple[list[dict[str, Any]], str | None]:
        """A page of books newest first, and the next page's cursor (None: the last page)."""
        params = {"after": after} if after else {}
        response = self._call("GET", "/v1/books", params={**params, "limit": limit})
        return response.json(), response.headers.get("x-next-cursor")

    def cancel_book(self, book_id: str) -> dict[str, Any]:
        return self._call("POST", f"/v1/books/{book_id}/cancel").json()

    def book_file(self, book_id: str, name: str, dest: Path) -> None:
        dest.write_bytes(self._call("GET", f"/v1/books/{book_id}/files/{name}").content)


def _error(response: httpx.Response) -> WavefarmError:
    try:
        body = response.json()
        kind, reason = str(body.get("error", "")), str(body.get("reason", response.text))
    except ValueError:
        kind, reason = "", response.text[:500]
    cls = ERRORS.get(kind) or (BadInput if response.status_code in (400, 422) else ApiError)
    return cls(f"{reason} (HTTP {response.status_code})")


def follow(client: Client, job_id: str, *, timeout_s: float | None = None,
           poll_s: float = POLL_S) -> dict[str, Any]:
    """Poll a job until it finishes, showing its progress on stderr (a tqdm bar on a terminal, a line per
    change in a pipe or a log); returns the last state."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    job = client.job(job_id)
    show: BarProgress | LineProgress = BarProgress(job_id) if sys.stderr.isatty() else LineProgress(job_id)
    try:
        while True:
            show.update(job)
            if job["status"] in ("succeeded", "failed", "cancelled"):
                return job
            if deadline is not None and time.monotonic() > deadline:
                raise ApiError(f"job {job_id} still {job['status']} after {timeout_s:g} s")
            time.sleep(poll_s)
            job = client.job(job_id)
    finally:
        show.close()


class LineProgress:
    """For a pipe or a log: one line per change of a job's status or frames, and each note once."""

    def __init__(self, job_id: str, file: Any = None) -> None:
        self.label, self.file = job_id[:8], file
        self.last: tuple[Any, ...] | None = None
        self.told: set[str] = set()

    def update(self, job: dict[str, Any]) -> None:
        out = self.file or sys.stderr
        for note in job.get("notes") or []:
            if note not in self.told:
                self.told.add(note)
                print(f"note: job {self.label}: {note}", file=out)
        done, total = job["progress"]["frames_done"], job["progress"]["frames_total"]
        if (job["status"], done, total) != self.last:
            self.last = (job["status"], done, total)
            share = f" ({100 * done // total} %)" if total else ""
            print(f"job {self.label}: {job['status']}, {done}/{total or '?'} frames{share}", file=out,
                  flush=True)

    def close(self) -> None:
        pass


class BarProgress:
    """For a terminal: a tqdm bar over the decoded frames; its count moves before its status, so it never
    shows "succeeded" short of 100 %."""

    def __init__(self, job_id: str, file: Any = None) -> None:
        from tqdm import tqdm

        self.tqdm, self.label, self.told = tqdm, job_id[:8], set[str]()
        self.bar = tqdm(total=None, unit="frame", desc=self.label, file=file)

    def update(self, job: dict[str, Any]) -> None:
        for note in job.get("notes") or []:  # dummy weights, the stand-in tokenizer: said once, plainly
            if note not in self.told:
                self.told.add(note)
                self.tqdm.write(f"note: job {self.label}: {note}", file=self.bar.fp)
        self.bar.total = job["progress"]["frames_total"] or self.bar.total
        self.bar.update(job["progress"]["frames_done"] - self.bar.n)
        self.bar.set_postfix_str(job["status"])

    def close(self) -> None:
        self.bar.close()
