"""Where a submission's API CPU goes, from a py-spy profile: `py-spy record --gil --format raw` of the API
process (or the floor app's, `scripts/bench_floor.py`) while `bench_api.py --floor` sends submissions.

    python scripts/profile_buckets.py RAW CPU_MS_PER_REQUEST

A sampled stack is the handler's work when it holds one of `WORK`'s frames (the floor's by its
lines in `scripts/bench_floor.py`), else the layer of its innermost frame from a known package
(`LAYERS`), else the event loop. The shares are of the samples, and the milliseconds each share of the
CPU per request the benchmark measured for that process. Stacks of the benchmark's seeding are
left out. Prints a Markdown table.
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

SEEDING = ("register_voice", "seed_books", "_upgrade_schema", "store_voice")
# The handler's work: a stack holding one of these frames (first match in this order) is that work's.
WORK: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("the JSON body read and parsed", ("_json_fields (",)),
    ("the voice's use counted and the job INSERT (PostgreSQL: one statement)", ("new_job_using_voice (",)),
    ("the voice checked and its use counted (UPDATE ... RETURNING)", ("use_voice (",)),  # before issue 45's
    ("the job INSERT", ("new_job (",)),                                                  # third pass
    ("the commit, and the feature store's check of the voice (Redis)", ("queue_preparation (",)),
    ("the publish", ("send_synth (", "bench_floor.py:77)", "bench_floor.py:78)")),
    ("the INSERT and the commit", ("bench_floor.py:74)", "bench_floor.py:75)", "bench_floor.py:76)")),
    ("request checks, routing, the answer, the session", ("_submit (", "submit (scripts/bench_floor.py")),
)
# The rest by the innermost frame of a known package (first match from the leaf).
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("middleware's own work (body limit, request metrics)", ("prometheus_client/", "app/api/")),
    ("uvicorn and h11: the request read, the answer written", ("h11/", "uvicorn/")),
    ("FastAPI and Starlette: routing, dependencies, validation, the answer's JSON",
     ("fastapi/", "starlette/", "pydantic/", "json/")),
    ("the thread-pool hand-off (anyio, threads)", ("anyio/", "threading.py", "queue.py")),
)
LOOP = "the event loop (asyncio, selectors)"
NAMES = [name for name, _ in WORK] + [name for name, _ in LAYERS] + [LOOP]


def bucket(stack: str) -> str:
    for name, keys in WORK:
        if any(k in stack for k in keys):
            return name
    for frame in reversed(stack.split(";")):
        for name, keys in LAYERS:
            if any(k in frame for k in keys):
                return name
    return LOOP


def buckets(raw: Path) -> Counter[str]:
    counts: Counter[str] = Counter()
    for line in raw.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if n.isdigit() and not any(s in stack for s in SEEDING):
            counts[bucket(stack)] += int(n)
    return counts


def main(argv: list[str]) -> int:
    raw, cpu_ms = Path(argv[0]), float(argv[1])
    counts = buckets(raw)
    total = sum(counts.values())
    print(f"| where ({total} samples) | share | ms of {cpu_ms} |\n|---|---|---|")
    for name in NAMES:
        if counts[name]:
            print(f"| {name} | {100 * counts[name] / total:.1f} % | {cpu_ms * counts[name] / total:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
