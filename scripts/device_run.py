"""The device kit: every GPU measurement in one call on a lent GPU machine (docs/PERFORMANCE.md,
"How to run the GPU check"); on a CPU, `--device cpu --preset tiny` is its rehearsal.

    python3 scripts/device_run.py --out DIR [--budget-s 360] [--device cuda|cpu] [--preset full|tiny]
                                  [--parts smoke,sweep,...] [--plan]

The parts, their budgets and what each writes: `bench.kit` (python3 scripts/device_run.py --plan).
Exit code 0 when every part ended "ok".
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.kit.runner import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main())
