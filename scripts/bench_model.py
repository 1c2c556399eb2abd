#!/usr/bin/env python
"""Thin wrapper: `python scripts/bench_model.py ARGS` == `python -m gpu_worker.bench ARGS`."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpu_worker.bench import main  # noqa: E402

raise SystemExit(main())
