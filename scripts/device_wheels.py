"""Download the wheels the device kit carries to the GPU machine (`bench.kit.wheels.WHEELS`), pinned
and checked by sha256, into wheels/ (ignored by git). Run it here, where PyPI is reachable, before the
device call that names `wheels` in its carry list (docs/PERFORMANCE.md, "How to run the GPU check").

    python3 scripts/device_wheels.py [--dir wheels] [--check]

--check downloads nothing: it says whether every pinned wheel is there with its hash (exit 1 if not).
Files in the folder that are not on the list are removed (two versions of one package stop the install
there).
"""

from __future__ import annotations

import argparse
import hashlib
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.kit.wheels import WHEELS, WHEELS_DIR  # noqa: E402

PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def missing(folder: Path) -> list[str]:
    """The pinned wheels not in `folder` with their hash."""
    return [w.file for w in WHEELS if not (folder / w.file).is_file() or sha256(folder / w.file) != w.sha256]


def download(folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
    command = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
               "--python-version", "3.12", "--implementation", "cp", *platforms, "-d", str(folder),
               *(f"{w.name}=={w.version}" for w in WHEELS)]
    subprocess.run(command, check=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, default=REPO / WHEELS_DIR)
    parser.add_argument("--check", action="store_true", help="only check what is there")
    args = parser.parse_args(argv)
    if not args.check and missing(args.dir):
        download(args.dir)
    wanted = {w.file for w in WHEELS}
    for extra in sorted(args.dir.glob("*.whl")) if args.dir.is_dir() else []:
        if extra.name not in wanted:
            print(f"removing {extra.name}: not on the list")
            extra.unlink()
    bad = missing(args.dir)
    for name in bad:
        print(f"MISSING or wrong hash: {name}")
    total = sum((args.dir / w.file).stat().st_size for w in WHEELS if (args.dir / w.file).is_file())
    print(f"{len(WHEELS) - len(bad)}/{len(WHEELS)} wheels in {args.dir}, {total / 2**20:.2f} MiB")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
