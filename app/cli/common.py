"""What the command groups share: the process's settings, a voice argument, the client choice, JSON out."""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

from app.errors import BadInput


def settings() -> Any:
    from app.settings import get_settings

    return get_settings()


def add_client_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--api", help="API base URL (default: WAVEFARM_API_URL, else http://127.0.0.1:8000)")
    parser.add_argument("--local", action="store_true", help="use the database directly, not the API")


def client(args: argparse.Namespace) -> Any:
    """The API over HTTP, or with --local the same operations in this process (`app.api.client`)."""
    if args.local:
        from app.api.local import LocalClient

        return LocalClient(settings())
    from app.api.client import HttpClient

    token = settings().api_token
    return HttpClient(args.api or settings().api_url, token=token.get_secret_value() if token else None)


def read_file(path: Path, what: str) -> bytes:
    """A file the user named, or BadInput in one line (missing, a folder, unreadable): no traceback."""
    try:
        return path.read_bytes()
    except OSError as exc:
        raise BadInput(f"cannot read the {what} {str(path)!r}: {exc.strerror or type(exc).__name__}") from exc


AUDIO_SUFFIXES = (".wav", ".flac", ".ogg", ".mp3")


def voice_argument(value: str) -> str | bytes:
    """--voice: a reference audio file (its bytes), or a stored voice's id, name or unique id prefix (the
    API finds it). Something that looks like a file but is not one is refused here."""
    if Path(value).is_file():
        return read_file(Path(value), "reference audio file")
    if "/" in value or value.lower().endswith(AUDIO_SUFFIXES) or not re.fullmatch(r"[\w .'-]+", value):
        raise BadInput(f"--voice {value!r} is neither a reference audio file nor a voice id or name")
    return value


def voice_id_for(api: Any, value: str) -> str:
    """--voice as a voice id: a reference file is uploaded first (POST /v1/voices, once per voice), and
    what normalising it changed (cut to 6 s, padded, scaled down) is said on stderr, once: when the voice
    is stored."""
    voice = voice_argument(value)
    if isinstance(voice, str):
        return voice
    record = api.add_voice(voice)
    if record.get("created", True):  # said when the voice is stored, not on every submit that reuses it
        for note in record.get("notes", []):
            print(f"wavefarm: note: {note}", file=sys.stderr)
    return str(record["id"])


def finished_well(kind: str, state: dict[str, Any]) -> bool:
    """Print how a followed job or book ended ("job <id>: failed (why)"); True if it succeeded."""
    error = f" ({state['error']})" if state.get("error") else ""
    print(f"{kind} {state['id']}: {state['status']}{error}")
    return state["status"] == "succeeded"


def print_json(data: Any) -> None:
    print(json.dumps(data, indent=2, sort_keys=True, default=str))
