"""A Python environment like the GPU machine's, for the device kit's tests: a virtual environment made
from the base interpreter (no system site-packages, no pip), whose one extra path holds only the
distributions the machine's image has (`bench.kit.wheels.MACHINE_PACKAGES` and everything they
require) and those the kit carries as wheels (`WHEELS`), each linked file by file from this environment's
own installation (its RECORD). So an import the kit's path gains from anything else (celery, redis,
sqlalchemy, pydantic, librosa, transformers, ...) fails there as it would on the machine.

The wheels' versions are checked against this environment's; their files are the ones installed here
(this interpreter's builds of the same versions: the GPU machine's Python is 3.12, this one may not be).
"""

from __future__ import annotations

import importlib.metadata as md
import subprocess
import sys
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from bench.kit.wheels import MACHINE_PACKAGES, WHEELS


def closure(names: tuple[str, ...] | list[str]) -> set[str]:
    """`names` and every distribution they require here (markers evaluated; the extras a requirement
    names followed, as torch's `cuda-toolkit[cublas, ...]`)."""
    env = default_environment()
    seen: set[tuple[str, frozenset[str]]] = set()
    found: set[str] = set()
    todo: list[tuple[str, frozenset[str]]] = [(n, frozenset()) for n in names]
    while todo:
        name, extras = todo.pop()
        key = (canonicalize_name(name), extras)
        if key in seen:
            continue
        seen.add(key)
        try:
            requires = md.requires(name) or []
        except md.PackageNotFoundError:
            continue  # the image has it or it is optional: not here, so not linked
        found.add(key[0])
        for text in requires:
            req = Requirement(text)
            if req.marker is None or any(req.marker.evaluate({**env, "extra": e}) for e in ("", *extras)):
                todo.append((req.name, frozenset(req.extras)))
    return found


def allowed() -> set[str]:
    return closure(list(MACHINE_PACKAGES)) | {canonicalize_name(w.name) for w in WHEELS}


def link_site(site: Path, names: set[str]) -> None:
    for name in sorted(names):
        dist = md.distribution(name)
        for file in dist.files or []:
            if file.parts[0] == "..":
                continue
            target = site / file
            if target.exists() or target.is_symlink():
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            target.symlink_to(Path(str(dist.locate_file(file))).resolve())


def make(root: Path) -> Path:
    """The environment under `root` -> its python."""
    venv = root / "venv"
    base = getattr(sys, "_base_executable", sys.executable)
    subprocess.run([base, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             check=True, capture_output=True, text=True).stdout.strip()
    site = root / "machine-site"
    link_site(site, allowed())
    (Path(purelib) / "machine.pth").write_text(f"{site}\n")
    return python
