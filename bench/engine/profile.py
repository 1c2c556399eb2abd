"""Where one steady-state decoder step spends its time: `python -m bench.engine.profile --rows 8`.

Warms `rows` streams to their trimmed caches, then runs one step under `torch.profiler` with the step's
phases labelled (encoder, cache gather, CFM solve, cache scatter, vocoder, where the code has them; the
rest of the step is trimming and bookkeeping) and prints the phases, then the top operators by self time.
The labels are instance attributes set around the profiled step only; no project code is changed.
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from bench.engine.decode import steady_rows, warm_streams
from bench.engine.workload import BenchSetup

PHASES = (("flow", "encode_lanes", "1 encoder (over the lanes)"),
          ("flow", "encode_chunks", "1 encoder"),
          ("flow", "encode_chunk", "1 encoder (one row)"),
          ("flow", "_gather_caches", "2 gather caches"),
          ("flow", "_gather_conv", "2 gather conv caches"),
          ("cfm", "solve", "3 CFM solve (10 Euler x CFG DiT)"),
          ("flow", "_scatter_caches", "4 scatter caches"),
          ("decoder", "_vocode", "5 HiFT vocoder"))


@contextlib.contextmanager
def labelled(objects: dict[str, Any]) -> Iterator[None]:
    patched = []
    for owner, name, label in PHASES:
        obj = objects[owner]
        original = getattr(obj, name, None)
        if original is None:  # the decoder's internals move; label what is there
            continue

        def wrapper(*args: Any, _f: Any = original, _label: str = label, **kwargs: Any) -> Any:
            with record_function(_label):
                return _f(*args, **kwargs)

        setattr(obj, name, wrapper)
        patched.append((obj, name))
    try:
        yield
    finally:
        for obj, name in patched:
            delattr(obj, name)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.engine.profile")
    p.add_argument("--preset", choices=["full", "tiny"], default="full")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default="fp32")
    p.add_argument("--hift-dtype", choices=["fp32", "bf16", "fp16"], default="fp32")
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    p.add_argument("--trace", default=None, help="also write a Chrome trace here")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    setup = BenchSetup.build(preset=args.preset, device=args.device, dtype=args.dtype, speaker="standin",
                             hift_dtype=args.hift_dtype,
                             micro_batch_size=args.rows)
    try:
        streams = warm_streams(setup, args.rows)
        objects = {"flow": setup.model.flow, "cfm": setup.model.flow.decoder, "decoder": setup.decoder}
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if setup.device.type == "cuda" else [])
        with labelled(objects), profile(activities=activities, record_shapes=True) as prof:
            with record_function("decoder step"):
                setup.decoder.step(steady_rows(streams, step=700))
    finally:
        setup.close()
    averages = prof.key_averages()
    phases = [e for e in averages if e.key[:1].isdigit() or e.key == "decoder step"]
    print(f"one steady-state step of {args.rows} rows, preset {args.preset}, {args.device} {args.dtype}, "
          f"{torch.get_num_threads()} threads")
    for event in sorted(phases, key=lambda e: e.key):
        print(f"  {event.key:40s} {event.cpu_time_total / 1e6:8.3f} s")
    print(averages.table(sort_by="self_cpu_time_total", row_limit=args.top))
    print(prof.key_averages(group_by_input_shape=True).table(sort_by="self_cpu_time_total", row_limit=12))
    if args.trace:
        prof.export_chrome_trace(args.trace)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
