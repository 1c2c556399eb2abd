"""One part's process (`python -m bench.kit.part NAME --out DIR ...`): its arguments, its deadline,
its report written to DIR as it grows (so a part killed on overrun still leaves what it measured).

    PartRun.left()                 seconds before the part must stop starting new work
    PartRun.attempt(name, fn)      fn() -> its value stored under results[name]; an error is recorded
                                   with its traceback's last lines and the part goes on (degrade, never die)
    PartRun.not_applicable(what)   what only CUDA has, recorded as "not applicable on cpu: ..."
    PartRun.skipped(what)          work left out for want of budget
    PartRun.fail(why)              a check that failed (the part's status "failed", the kit's exit 1)
Every part module has `run(ctx: PartRun) -> None`. A part whose budget is under its floor
(`Part.min_s`) skips itself before importing anything heavy: status "skipped", reason "budget". On CUDA
every fallback counter that moved during the part fails it (`bench.kit.verdict`): a part that
measured the slow path must not read "ok". The status: failed, errors (a step raised), skipped, or ok.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import time
import traceback
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench.kit import verdict
from bench.kit.plan import BY_NAME, GRACE_S, PRESETS, Sizes

log = logging.getLogger("bench.kit")
HANG_ENV = "WAVEFARM_KIT_HANG"


class PartRun:
    def __init__(self, name: str, out: Path, device: str, preset: str, budget_s: float) -> None:
        self.part = BY_NAME[name]
        self.out, self.device, self.preset = out, device, preset
        self.sizes: Sizes = PRESETS[preset]
        self.started = time.monotonic()
        self.budget_s = budget_s
        self.deadline = self.started + max(1.0, budget_s - GRACE_S)
        self.path = out / self.part.file
        self.report: dict[str, Any] = {
            "part": self.part.number, "name": name, "title": self.part.title, "status": "running",
            "device": device, "preset": preset, "budget_s": budget_s,
            "started_at": datetime.now(UTC).isoformat(timespec="seconds"),
            "results": {}, "errors": [], "failures": [], "not_applicable": [], "skipped": [],
        }
        self.save()

    @property
    def cuda(self) -> bool:
        return self.device == "cuda"

    @property
    def results(self) -> dict[str, Any]:
        return self.report["results"]

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def save(self) -> None:
        self.report["elapsed_s"] = round(time.monotonic() - self.started, 3)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.report, indent=1, default=str))
        os.replace(tmp, self.path)

    def attempt(self, name: str, fn: Callable[[], Any]) -> Any:
        start = time.monotonic()
        try:
            value = fn()
        except Exception as exc:  # one failing measurement must not take the part's others with it
            lines = traceback.format_exc().strip().splitlines()
            self.report["errors"].append({"where": name, "error": f"{type(exc).__name__}: {exc}"[:2000],
                                          "traceback": lines[-12:]})
            log.error("part %s: %s failed: %s: %s", self.part.name, name, type(exc).__name__, exc)
            value = None
        else:
            self.results[name] = value
        log.info("part %s: %s took %.1f s", self.part.name, name, time.monotonic() - start)
        self.save()
        return value

    def not_applicable(self, what: str) -> None:
        self.report["not_applicable"].append(f"not applicable on {self.device}: {what}")

    def skipped(self, what: str) -> None:
        self.report["skipped"].append(what)
        log.warning("part %s: skipped for want of budget: %s", self.part.name, what)
        self.save()

    def fail(self, why: str) -> None:
        self.report["failures"].append(why)
        log.error("part %s: FAILED: %s", self.part.name, why)
        self.save()

    def status(self) -> str:
        if self.report["failures"]:
            return "failed"
        if self.report["errors"]:
            return "errors"
        return "skipped" if self.report.get("skip_reason") else "ok"


def hang(ctx: PartRun) -> None:
    """The rehearsal of a part killed at its budget while writing its JSON: a half-written temporary file
    is left, then the part hangs (`WAVEFARM_KIT_HANG=name`)."""
    ctx.path.with_suffix(".tmp").write_text('{"part": ')
    time.sleep(3600)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="one part of the device kit")
    parser.add_argument("name", choices=sorted(BY_NAME))
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--device", choices=["cuda", "cpu"], required=True)
    parser.add_argument("--preset", choices=sorted(PRESETS), required=True)
    parser.add_argument("--budget-s", type=float, required=True)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s part {args.name} %(levelname)s %(name)s: "
                        "%(message)s", datefmt="%H:%M:%S")
    ctx = PartRun(args.name, args.out, args.device, args.preset, args.budget_s)
    if os.environ.get(HANG_ENV) == args.name:  # a part that hangs, for the runner's kill to be rehearsed
        hang(ctx)
    floor = ctx.part.min_s(args.device)
    if args.budget_s < floor:
        ctx.report.update(skip_reason="budget", status="skipped")
        ctx.skipped(f"skipped: budget ({args.budget_s:.0f} s, under the {floor:.0f} s it starts with)")
        return 0
    try:
        module = importlib.import_module(f"bench.kit.{args.name}")
        module.run(ctx)
    except Exception as exc:  # the part's own code broke: recorded, and the runner goes on to the next
        ctx.report["errors"].append({"where": "part", "error": f"{type(exc).__name__}: {exc}"[:2000],
                                     "traceback": traceback.format_exc().strip().splitlines()[-12:]})
        log.exception("part %s failed", args.name)
    from gpu_worker import fallbacks

    ctx.report["fallbacks"] = {kind: {f"{p}/{r}": n for (p, r), n in fallbacks.counts(kind).items()}
                               for kind in fallbacks.KINDS}
    if ctx.cuda:
        for why in verdict.fallback_failures(ctx.report["fallbacks"]):
            ctx.fail(why)
    ctx.report["status"] = ctx.status()
    ctx.save()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
