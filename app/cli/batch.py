"""`wavefarm submit --batch PATH`: many jobs in requests of up to 1000 (POST /v1/jobs/batch).

PATH is a file of job requests (a JSON array, or JSON lines: one object a line, as POST /v1/jobs takes
them as JSON) or a folder of token files (`*.json`, by name: one job each, as `--tokens` reads them).
The command's --voice, --seed, --format, --priority fill what an item leaves out; with a folder,
--idempotency-key K gives each file's job the key K/<file name> (a file's items: K/<index>), so running
the same command again submits nothing twice. Prints one line per item and a summary; exit status 1 when
any item was refused.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from app.cli.common import read_file
from app.errors import BadInput, WavefarmError

PER_REQUEST = 1000  # app.submission.batch.BATCH_MAX (not imported: a client command loads no database code)


def read_items(path: Path) -> list[tuple[str, dict[str, Any] | str]]:
    """(label, item) per job: the item's index or file name, and the request, or why it cannot be one."""
    if path.is_dir():
        from app.api.schemas import parse_tokens

        files = sorted(p for p in path.iterdir() if p.suffix == ".json" and p.is_file())
        if not files:
            raise BadInput(f"the folder {str(path)!r} has no token files (*.json)")
        out: list[tuple[str, dict[str, Any] | str]] = []
        for f in files:
            try:
                out.append((f.name, {"tokens": parse_tokens(read_file(f, "tokens file"))}))
            except WavefarmError as exc:
                out.append((f.name, str(exc)))
        return out
    data = read_file(path, "batch file")
    if data.lstrip()[:1] == b"[":
        try:
            items = json.loads(data)
        except (UnicodeDecodeError, ValueError, RecursionError) as exc:
            raise BadInput(f"{path} is not a JSON array ({exc})") from exc
        return [(str(i), item) for i, item in enumerate(items)]
    lines = [line for line in data.split(b"\n") if line.strip()]
    return [(str(i), _line(i, line)) for i, line in enumerate(lines)]


def _line(i: int, line: bytes) -> Any:
    try:
        return json.loads(line)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        return f"line {i + 1} is not JSON ({type(exc).__name__})"


def with_defaults(items: list[tuple[str, Any]], args: argparse.Namespace,
                  voice: str | None) -> list[tuple[str, Any]]:
    """The command's options where an item leaves them out (module docstring)."""
    defaults = {"voice_id": voice, "seed": args.seed, "output_format": args.output_format,
                "priority": args.priority}
    out = []
    for label, item in items:
        if isinstance(item, dict):
            item = {**{k: v for k, v in defaults.items() if v is not None}, **item}
            if args.idempotency_key and "idempotency_key" not in item:
                item["idempotency_key"] = f"{args.idempotency_key}/{label}"
        out.append((label, item))
    return out


def submit_all(api: Any, items: list[tuple[str, Any]]) -> int:
    """Send the items in requests of PER_REQUEST, print each result and a summary; 1 if any was refused."""
    accepted = existed = refused = 0
    for start in range(0, len(items), PER_REQUEST):
        chunk = items[start:start + PER_REQUEST]
        sendable = [item for _, item in chunk if not isinstance(item, str)]
        answers = iter(api.submit_batch(sendable)["results"] if sendable else [])
        for label, item in chunk:
            r: dict[str, Any] = next(answers) if not isinstance(item, str) else {  # not readable: not sent
                "accepted": False, "code": "-", "error": "BadInput", "reason": item}
            if r["accepted"]:
                accepted += 1
                existed += r["existed"]
                print(f"{label}  {r['job_id']}  {r['status']}" + ("  (existed)" if r["existed"] else ""))
            else:
                refused += 1
                print(f"{label}  refused  {r['code']} {r['error']}: {r['reason']}")
    print(f"{accepted} accepted ({existed} existed already), {refused} refused")
    return 1 if refused else 0
