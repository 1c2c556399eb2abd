"""The `wavefarm` command: run the services, talk to the API, render books, pull the model, run the demo.

    services.py  serve, cpu-worker, gpu-worker, flower, bench, db upgrade, maintenance, demo: each replaces
                 this process with the real server (or runs it in process) so signals reach it directly
    jobs.py      submit, status, cancel, jobs, voices: HTTP to the API, or with `--local` the services
                 in process (`app.api.client`)
    books.py     book render / status / cancel, the same two ways
    quality.py   quality check AUDIO: the quality gate on one file (app.quality)
    model.py     model pull (a released token2wav folder from Hugging Face) / model check DIR
Heavy imports happen inside the commands: building the parser (shell completion, the tests that read
it) stays cheap, and a client command starts without loading torch.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from app.cli import books, jobs, model, quality, services
from app.errors import WavefarmError

log = logging.getLogger("wavefarm")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="wavefarm", description="Offline speech synthesis service.")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    services.add_commands(sub)
    jobs.add_commands(sub)
    books.add_commands(sub)
    model.add_commands(sub)
    quality.add_commands(sub)
    return parser


def subcommands(parser: argparse.ArgumentParser | None = None) -> dict[str, argparse.ArgumentParser]:
    """Every command path ('serve', 'db upgrade', ...) -> its parser; for tests and completion."""
    found: dict[str, argparse.ArgumentParser] = {}

    def walk(p: argparse.ArgumentParser, prefix: str) -> None:
        for action in p._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, child in action.choices.items():
                    path = f"{prefix} {name}".strip()
                    found[path] = child
                    walk(child, path)

    walk(parser or build_parser(), "")
    return found


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    # `bench` hands everything after it to the benchmark's own parser (argparse's REMAINDER would
    # refuse a leading option such as --help).
    split = argv.index("bench") if "bench" in argv else -1
    if split >= 0 and all(a.startswith("-") for a in argv[:split]):
        args, extra = parser.parse_args(argv[:split + 1]), argv[split + 1:]
        args.bench_args = extra
    else:
        args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not args.verbose:
        logging.getLogger("alembic").setLevel(logging.WARNING)  # one line per migration step otherwise
        logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request: it broke progress bars
    try:
        return int(args.handler(args))
    except WavefarmError as exc:  # refused input or missing ids: a message, not a traceback
        print(f"wavefarm: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("wavefarm: interrupted", file=sys.stderr)
        return 130
