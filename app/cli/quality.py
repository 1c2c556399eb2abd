"""`wavefarm quality check AUDIO [--voice REF] [--text TEXT] [--language L] [--json]`: the quality gate
(app.quality) on one file. Exit 0 when it passes, 1 when a check fails, 2 on bad input (an unreadable
or over-long file: the CLI's refusal path). Thresholds come from the `WAVEFARM_QUALITY_*` settings.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from app.errors import BadInput


def add_commands(sub: Any) -> None:
    quality = sub.add_parser("quality", help="check rendered audio: silence, noise, voice, words")
    actions = quality.add_subparsers(dest="quality_command", required=True, metavar="ACTION")
    check = actions.add_parser("check", help="run every check on one audio file; exit 0 pass, 1 fail")
    check.add_argument("audio", type=Path, help="WAV, FLAC, OGG or MP3")
    check.add_argument("--voice", type=Path, help="the reference voice the clip should sound like")
    check.add_argument("--text", help="what the clip should say (length and word checks)")
    check.add_argument("--language", default="en", help="the text's language (words: English only)")
    check.add_argument("--json", action="store_true", help="print the report as one JSON object")
    check.set_defaults(handler=run_check)


def _read(path: Path, limits: Any) -> tuple[Any, int]:
    from app.audio import decode_audio

    try:
        if path.stat().st_size > limits.max_bytes:
            raise BadInput(f"{path} is over the {limits.max_bytes} byte limit of an audio file")
        data = path.read_bytes()
    except OSError as exc:
        raise BadInput(f"{path}: {exc.strerror or exc}") from exc
    decoded = decode_audio(data, limits)
    return decoded.pcm.mean(axis=1), decoded.sample_rate


def run_check(args: argparse.Namespace) -> int:
    from app.audio import AudioLimits
    from app.quality.gate import Thresholds, check_audio
    from app.settings import get_settings

    limits = AudioLimits(min_seconds=0.05)
    wave, rate = _read(args.audio, limits)
    ref, ref_rate = _read(args.voice, limits) if args.voice else (None, None)
    report = check_audio(wave, rate, text=args.text, reference=ref, reference_rate=ref_rate,
                         language=args.language, thresholds=Thresholds.from_settings(get_settings()))
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        print(f"{args.audio}: {'pass' if report.passed else 'FAIL'}")
        for c in report.checks:
            score = "" if c.score is None else f" {c.score:.3f}"
            tail = f" ({c.reason})" if c.reason else ""
            print(f"  {c.name:9s} {c.verdict:7s}{score}  {c.threshold}{tail}")
    return 0 if report.passed else 1
