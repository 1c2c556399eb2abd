#!/usr/bin/env python
"""Thin wrapper: `python scripts/bench_model.py ARGS` == `python -m bench.engine ARGS`."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.engine import main  # noqa: E402

raise SystemExit(main())
