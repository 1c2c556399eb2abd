"""The kit's parts, their budgets and the presets' sizes. No torch: `--plan` answers at once.

    PARTS                               in order of value (issue 30); a part's floor, under which it skips
                                        itself (compile)
    Sizes, PRESETS["full" | "tiny"]     what each part runs at
    share_of(parts, remaining)          the next part's seconds: its share of what is left among the
                                        parts still to run (time an earlier part did not use flows on)
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Part:
    number: int
    name: str
    title: str
    weight: float  # share of the budget, relative to the other parts run
    min_cuda_s: float = 0.0  # below this budget the part skips itself (status "skipped", exit 0)
    min_cpu_s: float = 0.0

    @property
    def file(self) -> str:
        return f"{self.number}_{self.name}.json"

    def min_s(self, device: str) -> float:
        return self.min_cuda_s if device == "cuda" else self.min_cpu_s


# torch.compile's first compile of the DiT (inductor) on a cold GPU machine has not been measured: a part
# killed at its budget made the whole call fail, so compile does not start with less than these floors
# (chosen, not measured; the CPU one for the rehearsal's `eager` backend at tiny size)
COMPILE_MIN_CUDA_S, COMPILE_MIN_CPU_S = 120.0, 60.0

PARTS = (
    Part(1, "smoke", "environment + tiny correctness smoke", 0.12),
    Part(2, "sweep", "engine sweep, graphs on + reference batch-1", 0.34),
    Part(3, "graphs", "graphs off vs on; fp32", 0.20),
    Part(4, "churn", "churn: installs, fallbacks, cancels, evictions", 0.12),
    Part(5, "overlap", "side-stream install vs decode step", 0.07),
    Part(6, "compile", "torch.compile of the DiT (optional)", 0.15, COMPILE_MIN_CUDA_S, COMPILE_MIN_CPU_S),
)
DEFAULT_BUDGET_S = 270.0  # the first call's: its timeout_s 330 less a reserve (docs/PERFORMANCE.md)
BY_NAME = {p.name: p for p in PARTS}


@dataclass(frozen=True)
class Sizes:
    model: str  # the model preset of parts 2-6 (part 1 is always tiny)
    dtype: str  # parts 2, 4, 5, 6
    concurrency: tuple[int, ...]  # part 2, and part 3's graphs off
    modes: tuple[str, ...]  # part 2: b inline prep, c prep ahead, d installed (bench.engine.sweep)
    chunks: int  # per job
    jobs_per_client: int
    fp32_concurrency: tuple[int, ...]  # part 3
    reference_chunks: int  # part 2's reference: timed chunks
    churn_cycles: int  # part 4
    overlap_rows: int  # part 5: rows of the concurrent decode step
    compile_concurrency: tuple[int, ...]  # part 6


PRESETS = {
    "full": Sizes(model="full", dtype="bf16", concurrency=(1, 4, 16, 32, 64), modes=("b", "c", "d"), chunks=4,
                  jobs_per_client=2, fp32_concurrency=(1, 32), reference_chunks=4, churn_cycles=50,
                  overlap_rows=16, compile_concurrency=(16,)),
    "tiny": Sizes(model="tiny", dtype="bf16", concurrency=(1, 4), modes=("b", "c", "d"), chunks=2,
                  jobs_per_client=1, fp32_concurrency=(1, 4), reference_chunks=2, churn_cycles=8,
                  overlap_rows=4, compile_concurrency=(4,)),
}

GRACE_S = 5.0  # of a part's seconds kept for writing its JSON and leaving


def share_of(weights: list[float], remaining_s: float) -> float:
    """The first of `weights`' parts' seconds out of `remaining_s` for them all."""
    return remaining_s * weights[0] / sum(weights) if weights else 0.0


def plan_lines(parts: list[Part], budget_s: float, preset: str) -> list[str]:
    """What `--plan` prints: each part with its budget if every earlier part uses all of its own."""
    lines, remaining = [], budget_s
    sizes = PRESETS[preset]
    for i, part in enumerate(parts):
        seconds = share_of([p.weight for p in parts[i:]], remaining)
        remaining -= seconds
        floor = part.min_s("cuda")
        short = f" (skips itself under {floor:.0f} s on CUDA)" if floor else ""
        lines.append(f"  {part.number}. {part.name:8s} {seconds:6.0f} s  {part.title}{short}")
    lines.append(f"  total    {budget_s:6.0f} s  (preset {preset}: model {sizes.model}, {sizes.dtype}, "
                 f"C = {','.join(map(str, sizes.concurrency))}; time a part leaves unused goes to the next)")
    return lines
