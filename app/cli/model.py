"""Model folder commands: `model pull` fetches a released token2wav folder, `model check` validates one.

    model pull [--repo R] [--revision REV] [--dir DIR]   the repo's token2wav/ via huggingface_hub
                                                         (resumable, checksum-verified, cached), then
                                                         the check, then the WAVEFARM_MODEL_DIR line to set
    model check DIR [--preset P]                         every problem of the folder, one line each

The check is `python -m gpu_worker.checkpoint.check` (torch and the model classes) in a child process, as
`bench` runs its module: `app` never imports the worker packages (docs/ARCHITECTURE.md). The download is
huggingface_hub's `snapshot_download`, imported inside the command; the Hub's settings are its own
environment variables (HF_HOME, HF_HUB_CACHE, HF_HUB_OFFLINE, HF_TOKEN), read by the library.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from app.errors import BadInput, ModelLoadError, first_line
from app.speech import MODEL_FILES

DEFAULT_REPO = "stepfun-ai/Step-Audio-2-mini"  # MiniCPM-o-4_5 keeps the same files under assets/token2wav
SUBFOLDER = "token2wav"
PRESETS = ("full", "tiny")  # gpu_worker.checkpoint.check.PRESETS (app does not import it)
CHECK_MODULE = "gpu_worker.checkpoint.check"
OFFLINE_ROUTE = ("Without a network: pull on a machine that has one, copy its Hugging Face cache "
                 "(HF_HOME) here and run again with HF_HUB_OFFLINE=1, or copy a token2wav folder and point "
                 "WAVEFARM_MODEL_DIR at it after `wavefarm model check DIR` (docs/MODEL_SETUP.md, "
                 "\"Offline machines\")")


def add_commands(sub: Any) -> None:
    model = sub.add_parser("model", help="get (pull) and validate (check) a token2wav model folder")
    model_sub = model.add_subparsers(dest="model_command", required=True, metavar="ACTION")
    pull = model_sub.add_parser("pull", help="download a released token2wav/ folder from Hugging Face and "
                                "check it")
    pull.add_argument("--repo", default=DEFAULT_REPO, help=f"Hugging Face model (default {DEFAULT_REPO})")
    pull.add_argument("--revision", help="branch, tag or commit (default: main)")
    pull.add_argument("--dir", type=Path, help="download into this folder (default: the Hugging Face cache)")
    pull.set_defaults(handler=cmd_model_pull)
    check = model_sub.add_parser("check", help="list everything wrong with a model folder (exit 1 if any)")
    check.add_argument("dir", type=Path, help="a token2wav folder (flow.yaml, flow.pt, hift.pt, two ONNX)")
    check.add_argument("--preset", choices=PRESETS,
                       help="architecture to check against (default: the one flow.yaml describes)")
    check.set_defaults(handler=cmd_model_check)


def cmd_model_check(args: argparse.Namespace) -> int:
    # Said at once when there is nothing to read: the check's child imports torch (seconds, more on a
    # loaded machine) before it looks at a file. Its lines, word for word, for these two cases.
    problems = ([f"{args.dir}: not a folder"] if not args.dir.is_dir() else
                [f"{args.dir / name}: missing" for name in MODEL_FILES if not (args.dir / name).is_file()])
    if args.dir.is_dir() and len(problems) < len(MODEL_FILES):  # a file to read: the whole check
        return run_check(args.dir, *(["--preset", args.preset] if args.preset else []))
    for problem in problems:
        print(problem)
    print(f"{args.dir}: {len(problems)} problem(s) (preset {args.preset or PRESETS[0]})")
    return 1


def cmd_model_pull(args: argparse.Namespace) -> int:
    folder = fetch_token2wav(args.repo, revision=args.revision, local_dir=args.dir)
    return run_check(folder, "--print-env")


def run_check(folder: Path, *options: str) -> int:
    """The check in a child process, its lines on this one's stdout; 0 if the folder passes, else 1."""
    sys.stdout.flush()
    return subprocess.run([sys.executable, "-m", CHECK_MODULE, str(folder), *options]).returncode


def fetch_token2wav(repo: str, *, revision: str | None = None, local_dir: Path | None = None) -> Path:
    """The repo's token2wav/ folder on disk: downloaded, resumed, or found in the cache (HF_HUB_OFFLINE)."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (
        HFValidationError,
        HTTPError,  # the transport's base (requests' or httpx's), under the Hub's errors and lost connections
        LocalEntryNotFoundError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    spec = f"{repo}@{revision}" if revision else repo
    where = local_dir or f"the Hugging Face cache ({constants.HF_HUB_CACHE})"
    try:
        root = snapshot_download(repo, revision=revision, allow_patterns=[f"{SUBFOLDER}/*"],
                                 local_dir=local_dir)
    except (RepositoryNotFoundError, RevisionNotFoundError, HFValidationError) as exc:
        raise BadInput(f"{spec}: no such repository or revision on the Hub ({first_line(exc)})") from exc
    except (OfflineModeIsEnabled, LocalEntryNotFoundError) as exc:
        offline = constants.HF_HUB_OFFLINE or isinstance(exc.__cause__, OfflineModeIsEnabled) or isinstance(
            exc, OfflineModeIsEnabled)
        why = ("HF_HUB_OFFLINE is set, so nothing is downloaded" if offline else
               f"the Hub cannot be reached ({first_line(exc.__cause__ or exc)})")
        raise ModelLoadError(f"{spec}: {SUBFOLDER}/ is not in {where}, and {why}. {OFFLINE_ROUTE}") from exc
    except (HTTPError, OSError) as exc:  # a Hub error, a dropped connection, a full disk
        raise ModelLoadError(f"{spec}: download failed ({first_line(exc)}); run it again to resume") from exc
    folder = Path(os.path.abspath(str(root))) / SUBFOLDER  # for the printed setting; links kept
    if not folder.is_dir():
        raise ModelLoadError(f"{spec}: the repository has no {SUBFOLDER}/ folder")
    return folder
