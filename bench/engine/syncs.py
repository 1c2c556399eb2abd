"""Host syncs of a decoder step, counted on any device: `python -m bench.engine.syncs`.

On CUDA a step stalls its host thread wherever the host needs a value the device computed: a tensor read
as a Python number or bool (`item()`, `int()`, `bool()`, `tolist()`: `aten._local_scalar_dense`, or
`aten.item` under `torch.inference_mode()`), an
op whose output shape depends on the data (`nonzero`, `masked_select`, `unique`, boolean indexing), or
a copy from the device to the host. `count_syncs` records the first two kinds with a
`TorchDispatchMode`, so a CPU run counts exactly the points that would sync on a GPU; device-to-host
copies are named separately (`copies_to_host`), found as copies whose source is not on the CPU (none on
a CPU run: they are what the engine does once per step with every row's audio,
`streams.audio_to_host`). On a CPU run every tensor counts as a device tensor, so the count is an upper
bound; `tolist()` and `numpy()` of a CPU tensor read its memory without an aten op and are not seen
(the decoder's step calls neither).

    count_syncs(fn) -> (fn's result, SyncCount(by_op, copies_to_host))
    decoder_step_syncs(setup, rows) -> {rows, syncs, by_op}: one steady-state step of `rows` warm streams

Not in here: timing (the profile and the sweep do that).
"""

from __future__ import annotations

import argparse
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
# item: under torch.inference_mode() a scalar read reaches the mode as `item`, not `_local_scalar_dense`
SYNC_OPS = frozenset({aten._local_scalar_dense.default, aten.item.default, aten.nonzero.default,
                      aten.masked_select.default,
                      aten._unique2.default, aten.unique_consecutive.default, aten.unique_dim.default,
                      aten.index.Tensor})  # index.Tensor: only with a boolean index (checked below)
COPY_OPS = frozenset({aten._to_copy.default, aten.copy_.default})


@dataclass
class SyncCount:
    by_op: Counter[str] = field(default_factory=Counter)
    copies_to_host: int = 0

    @property
    def total(self) -> int:
        return sum(self.by_op.values()) + self.copies_to_host


class _Counting(TorchDispatchMode):
    def __init__(self, count: SyncCount) -> None:
        super().__init__()
        self.count = count

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func in SYNC_OPS and (func is not aten.index.Tensor or _bool_index(args)):
            self.count.by_op[str(func.overloadpacket.__name__)] += 1
        elif func in COPY_OPS and _to_host(func, args, kwargs):
            self.count.copies_to_host += 1
        return func(*args, **kwargs)


def _bool_index(args: tuple) -> bool:
    indices = args[1] if len(args) > 1 else ()
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices)


def _to_host(func: Any, args: tuple, kwargs: dict) -> bool:
    src = args[0] if args else None
    if not isinstance(src, torch.Tensor) or src.device.type == "cpu":
        return False
    if func is aten.copy_.default:
        return args[0].device.type == "cpu" and args[1].device.type != "cpu"
    dst = kwargs.get("device")
    return dst is not None and torch.device(dst).type == "cpu"


def count_syncs(fn: Callable[[], Any]) -> tuple[Any, SyncCount]:
    count = SyncCount()
    with _Counting(count):
        out = fn()
    return out, count


def decoder_step_syncs(setup: Any, rows: int) -> dict[str, Any]:
    """One steady-state `StreamingDecoder.step` of `rows` warm streams (streams warmed outside the count)."""
    from bench.engine.decode import steady_rows, warm_streams

    streams = warm_streams(setup, rows)
    _, count = count_syncs(lambda: setup.decoder.step(steady_rows(streams, step=800)))
    return {"rows": rows, "syncs": count.total, "by_op": dict(count.by_op),
            "copies_to_host": count.copies_to_host}


def main(argv: list[str] | None = None) -> int:
    from bench.engine.workload import BenchSetup

    p = argparse.ArgumentParser(prog="python -m bench.engine.syncs", description=__doc__.split("\n")[0])
    p.add_argument("--preset", choices=["full", "tiny"], default="tiny")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default="fp32")
    p.add_argument("--rows", type=int, default=4)
    args = p.parse_args(argv)
    setup = BenchSetup.build(preset=args.preset, device=args.device, dtype=args.dtype, speaker="standin",
                             micro_batch_size=args.rows)
    try:
        result = decoder_step_syncs(setup, args.rows)
    finally:
        setup.close()
    print(f"host syncs in one steady-state decoder step of {result['rows']} rows ({args.preset}, "
          f"{args.device} {args.dtype}): {result['syncs']} {result['by_op']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
