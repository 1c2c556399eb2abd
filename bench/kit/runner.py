"""`scripts/device_run.py`: every part in its own process, in order, each with its share of the budget
and killed when it overruns it; then summary.json, the one-screen table (printed too) and kit.log.

The output folder holds at most 8 files, flat (what comes back from the GPU machine): one JSON per part
(six), summary.json and kit.log, in which every part's own output is kept too; a part killed while
writing its JSON leaves a temporary file, which is removed (a ninth file would not come back).

The summary's first line (and the table's, printed last) is the verdict: PASSED, or FAILED naming each
part that failed a check, raised, crashed or was killed, and its first reason. Exit code 0 when every
part is "ok" or "skipped" (a part under its budget floor).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import IO, Any

from bench.kit import table
from bench.kit.plan import BY_NAME, DEFAULT_BUDGET_S, PARTS, PRESETS, Part, plan_lines, share_of

REPO = Path(__file__).resolve().parents[2]
SUMMARY, LOG = "summary.json", "kit.log"


def parse_parts(text: str) -> list[Part]:
    wanted = [x.strip() for x in text.split(",") if x.strip()]
    chosen = []
    for item in wanted:
        part = BY_NAME.get(item) or next((p for p in PARTS if str(p.number) == item), None)
        if part is None:
            raise argparse.ArgumentTypeError(f"unknown part {item!r}: one of {', '.join(BY_NAME)} or 1-6")
        chosen.append(part)
    return [p for p in PARTS if p in chosen]  # always in the order


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="scripts/device_run.py", description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=False, help="output folder (created)")
    p.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S,
                   help="seconds for all the parts together")
    p.add_argument("--device", choices=["cuda", "cpu"], default=None, help="default: cuda where there is one")
    p.add_argument("--preset", choices=sorted(PRESETS), default="full")
    p.add_argument("--parts", type=parse_parts, default=list(PARTS), help="names or numbers, comma-separated")
    p.add_argument("--plan", action="store_true", help="print the parts and their budgets, run nothing")
    return p


def default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def say(log: IO[str], line: str) -> None:
    print(line, flush=True)
    log.write(line + "\n")
    log.flush()


def run_part(part: Part, args: argparse.Namespace, budget_s: float, log: IO[str]) -> dict[str, Any]:
    """The part's process, killed (its whole process group) once it runs past `budget_s`."""
    command = [sys.executable, "-m", "bench.kit.part", part.name, "--out", str(args.out),
               "--device", args.device, "--preset", args.preset, "--budget-s", f"{budget_s:.1f}"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    if args.device == "cpu":  # the rehearsal: one torch thread, so that a loaded machine does not stall it
        env.setdefault("OMP_NUM_THREADS", "1")  # (2 threads: gpu_check over 100 s beside 3 busy loops; 1: 41)
    start = time.monotonic()
    proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        code: int | None = proc.wait(timeout=budget_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        code = None
    took = time.monotonic() - start
    path = args.out / part.file
    path.with_suffix(".tmp").unlink(missing_ok=True)  # a write the kill cut short
    report: dict[str, Any] = json.loads(path.read_text()) if path.is_file() else {
        "part": part.number, "name": part.name, "title": part.title, "results": {}, "errors": []}
    if code is None:
        report["status"] = "killed"
        report.setdefault("errors", []).append({"where": "runner",
                                                "error": f"killed at its budget, {budget_s:.0f} s"})
    elif code != 0 or report.get("status") == "running":
        report["status"] = "crashed"
        report.setdefault("errors", []).append({"where": "runner",
                                                "error": f"process ended with code {code}"})
    report.update(elapsed_s=round(took, 1), budget_s=round(budget_s, 1))
    path.write_text(json.dumps(report, indent=1, default=str))
    return report


def merged_fallbacks(reports: list[dict[str, Any]]) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {}
    for r in reports:
        for kind, counts in r.get("fallbacks", {}).items():
            for key, n in counts.items():
                out.setdefault(kind, {})[f"{r['name']}:{key}"] = n
    return out


def title(args: argparse.Namespace, reports: list[dict[str, Any]], elapsed: float) -> str:
    smoke = [r["results"].get("environment", {}) for r in reports if r["name"] == "smoke"]
    env: dict[str, Any] = smoke[0] if smoke else {}
    where = env.get("gpu") or env.get("cpu_model") or args.device
    return (f"wavefarm device kit: {where}, torch {env.get('torch_version', '?')}, device {args.device}, "
            f"preset {args.preset}, budget {args.budget_s:.0f} s, took {elapsed:.0f} s")


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.plan:
        print("\n".join(plan_lines(args.parts, args.budget_s, args.preset)))
        return 0
    if args.out is None:
        parser().error("--out is required (unless --plan)")
    args.device = args.device or default_device()
    args.out.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    reports = []
    with open(args.out / LOG, "a", encoding="utf-8") as log:
        say(log, f"device kit: {' '.join(sys.argv)}")
        for line in plan_lines(args.parts, args.budget_s, args.preset):
            say(log, line)
        for i, part in enumerate(args.parts):
            remaining = args.budget_s - (time.monotonic() - start)
            budget = share_of([p.weight for p in args.parts[i:]], remaining)
            say(log, f"== part {part.number} {part.name}: {budget:.0f} s of {remaining:.0f} s left")
            log.flush()
            report = run_part(part, args, budget, log)
            reports.append(report)
            say(log, f"== part {part.number} {part.name}: {report['status']} in {report['elapsed_s']:.0f} s")
        elapsed = time.monotonic() - start
        text = table.render(title(args, reports, elapsed), reports, merged_fallbacks(reports))
        summary = {"verdict": text.splitlines()[0], "command": sys.argv, "device": args.device,
                   "preset": args.preset, "budget_s": args.budget_s, "elapsed_s": round(elapsed, 1),
                   "fallbacks": merged_fallbacks(reports), "table": text,
                   "parts": [{k: r.get(k) for k in ("part", "name", "status", "elapsed_s", "budget_s")}
                             | {"errors": len(r.get("errors", [])), "failures": r.get("failures", [])}
                             for r in reports]}
        (args.out / SUMMARY).write_text(json.dumps(summary, indent=1))
        say(log, text)
    return 0 if all(r["status"] in table.PASSING for r in reports) else 1
