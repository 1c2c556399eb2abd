"""The measuring instrument: model numbers, the engine sweep and the limit, in one report.

    python -m bench.engine --preset full|tiny --device cpu|cuda --dtype fp32|bf16|fp16
        --concurrency 1,2,4,8,16 --chunks N --modes a,b,c,d --reference/--no-reference
        --json OUT --plots DIR [--quick]

`main(argv)` (in `bench.engine.cli`) is what a `wavefarm bench` subcommand would call. Parts:
`workload` (weights, voices, tokens), `decode` (decoder frames/s, voice preparation cost), `reference`
(the stepaudio2 implementation on the same inputs), `sweep` (the engine by mode and concurrency),
`limit` (FLOPs per frame x measured matmul rate), `report` (table, JSON, plots), `machine`.
"""

from __future__ import annotations


def main(argv: list[str] | None = None) -> int:
    from bench.engine.cli import main as cli_main

    return cli_main(argv)
