"""`python -m bench.engine`: run the benchmark, print the table, write the JSON report and plots.

    main(argv) -> exit code; every part of the run is one numbered step in `run`.

Defaults are sized for a 2-core CPU with the full-size model (about 10 minutes); `--quick` is a smoke
run of every part, `--preset tiny` the same code on the tiny model in seconds.
Rows or concurrencies whose attention caches would not fit in the memory available are skipped and
reported as skipped, never estimated.
"""

from __future__ import annotations

import argparse
import gc
import time
from collections.abc import Callable
from typing import Any

import torch

from bench.engine import decode, limit, precision, reference, report, sweep
from bench.engine.machine import (
    PeakRss,
    command_line,
    git_info,
    load_average,
    machine_info,
    mem_available_bytes,
)
from bench.engine.workload import BenchSetup
from gpu_worker.checkpoint.load import DTYPES

MEMORY_HEADROOM = 0.8  # of MemAvailable a run may plan to use


def _ints(text: str) -> list[int]:
    values = [int(x) for x in text.split(",") if x.strip()]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers separated by commas, got {text!r}")
    return values


def _modes(text: str) -> list[str]:
    keys = [x.strip() for x in text.split(",") if x.strip()]
    unknown = [k for k in keys if k not in sweep.MODES]
    if not keys or unknown:
        raise argparse.ArgumentTypeError(f"modes are a subset of {','.join(sweep.MODES)}, got {text!r}")
    return keys


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.engine", description=__doc__.split("\n")[0])
    p.add_argument("--preset", choices=["full", "tiny"], default="full")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default="fp32")
    p.add_argument("--hift-dtype", choices=["fp32", "bf16", "fp16"], default="fp32",
                   help="the vocoder's dtype (WAVEFARM_HIFT_DTYPE; default fp32, as the reference)")
    p.add_argument("--concurrency", type=_ints, default=None, help="engine sweep C (default 1,2,4,8,16)")
    p.add_argument("--batches", type=_ints, default=None, help="decoder rows per step (default: C)")
    p.add_argument("--chunks", type=int, default=None, help="chunks per engine job (default 2)")
    p.add_argument("--steps", type=int, default=None, help="timed decoder steps per batch size (default 2)")
    p.add_argument("--mixed", type=int, default=None, help="concurrency of the mixed-length set (0: none)")
    p.add_argument("--jobs-per-client", type=int, default=1, help="jobs each client submits in turn")
    p.add_argument("--modes", type=_modes, default=list(sweep.MODES))
    p.add_argument("--reference", action=argparse.BooleanOptionalAction, default=True,
                   help="time the stepaudio2 reference on the same weights and tokens")
    p.add_argument("--reference-dtype", choices=["fp32", "bf16", "fp16"], default="fp32",
                   help="the reference's flow dtype (default fp32, whatever --dtype is: the baseline)")
    p.add_argument("--speaker", choices=["s3", "standin", "campplus"], default=None,
                   help="device half's S3 + CAM++: the ONNX files (full), a stand-in, or the stand-in's "
                        "tokens with CAM++'s real network (random weights, onnxruntime CPU)")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    p.add_argument("--install-lane", action="store_true",
                   help="modes c and d install voices on a side thread (WAVEFARM_INSTALL_LANE; CPU)")
    p.add_argument("--quick", action="store_true", help="C 1,4, batches 1,4, 1 chunk, 1 step, no mixed set")
    p.add_argument("--json", dest="json_path", default=None, metavar="OUT")
    p.add_argument("--render", default=None, metavar="JSON",
                   help="print a saved report's table and Markdown tables; run nothing")
    p.add_argument("--plots", default=None, metavar="DIR")
    return p


def _resolve(args: argparse.Namespace) -> dict[str, Any]:
    quick = args.quick
    concurrency = args.concurrency or ([1, 4] if quick else [1, 2, 4, 8, 16])
    return {
        "preset": args.preset, "device": args.device, "dtype": args.dtype, "hift_dtype": args.hift_dtype,
        "install_lane": args.install_lane,
        "concurrency": concurrency,
        "batches": args.batches or ([1, 4] if quick else concurrency),
        "steps": args.steps or (1 if quick else 2), "chunks": args.chunks or (1 if quick else 2),
        "mixed": args.mixed if args.mixed is not None else (0 if quick else 4),
        "jobs_per_client": args.jobs_per_client, "modes": args.modes, "reference": args.reference,
        "reference_dtype": args.reference_dtype,
        "speaker": args.speaker or ("s3" if args.preset == "full" else "standin"),
        "matmul_min_s": 0.05 if quick else 0.25, "host_half_reps": 2 if quick else 5, "quick": quick,
    }


def _too_big(rows: int, row_bytes: float) -> str | None:
    """None if `rows` steady-state rows fit in the memory available now, else why not."""
    available = mem_available_bytes()
    if available is None or rows * row_bytes <= MEMORY_HEADROOM * available:
        return None
    return (f"{rows} rows would need about {rows * row_bytes / 2**30:.1f} GiB (measured "
            f"{row_bytes / 2**20:.0f} MiB per row); {available / 2**30:.1f} GiB available")


def _model_numbers(setup: BenchSetup, cfg: dict[str, Any], out: dict[str, Any], log: Callable[[str], None]
                   ) -> None:
    log("3. decoder sweep: one stream warmed alone (its peak memory sizes the rest), then the others")
    with PeakRss() as probe:
        streams = decode.warm_streams(setup, 1)
    row_bytes = float(decode.row_peak_bytes(setup))
    if not probe.process_lifetime and probe.peak_mib and probe.start_mib:
        row_bytes = (probe.peak_mib - probe.start_mib) * 2**20
    out["row_peak_mib"] = row_bytes / 2**20
    skipped = {b: why for b in cfg["batches"] if (why := _too_big(b, row_bytes))}
    batches = [b for b in cfg["batches"] if b not in skipped]
    streams += decode.warm_streams(setup, max(batches) - 1, start=1)
    out["decoder"] = decode.decoder_sweep(setup, streams, batches, cfg["steps"], log)
    out["decoder"] += [{"batch": b, "skipped": why} for b, why in skipped.items()]
    log("4. FLOPs of one steady-state step")
    flops = limit.count_flops(setup, streams[:1])
    del streams
    gc.collect()
    out["limit"]["flops"] = flops
    out["limit"]["ceiling_fps"] = limit.ceilings(flops, out["limit"]["matmul"])


def _reference(setup: BenchSetup, cfg: dict[str, Any], out: dict[str, Any], log: Callable[[str], None]
               ) -> None:
    log("5. reference (stepaudio2) batch 1 on the same weights and tokens")
    ref = reference.build_reference(setup, DTYPES[cfg["reference_dtype"]])
    out["reference"] = reference.reference_fps(setup, ref, voice_index=0, timed=cfg["steps"])
    log(f"  reference batch  1 ({cfg['reference_dtype']}): {out['reference']['fps']:8.1f} frames/s")
    del ref
    gc.collect()


def _engine(setup: BenchSetup, cfg: dict[str, Any], out: dict[str, Any],
            save: Callable[[dict[str, Any]], None], log: Callable[[str], None]) -> None:
    log("6. engine sweep")
    row_bytes = out["row_peak_mib"] * 2**20
    out["engine"] = []
    too_big = {c: why for c in cfg["concurrency"] if (why := _too_big(c, row_bytes))}

    def keep(result: dict[str, Any]) -> None:
        out["engine"].append(result)
        save(out)

    fits = [c for c in cfg["concurrency"] if c not in too_big]
    sweep.engine_sweep(setup, cfg["modes"], fits, cfg["chunks"], cfg["mixed"], cfg["jobs_per_client"],
                       max(cfg["concurrency"]), log, keep, install_lane=cfg["install_lane"])
    out["engine"] += [{"workload": "equal", "concurrency": c, "mode": m, "skipped": why}
                      for c, why in too_big.items() for m in cfg["modes"]]


def run(cfg: dict[str, Any], command: str, log: Callable[[str], None] = print,
        save: Callable[[dict[str, Any]], None] = lambda report: None) -> dict[str, Any]:
    """Every part in order; `save` gets the report so far after each part (a killed run keeps its data)."""
    started = time.perf_counter()
    out: dict[str, Any] = {"schema": report.SCHEMA, "command": command, "config": cfg, "complete": False,
                           "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                           "git": git_info(), "modes": {k: sweep.MODES[k].title for k in cfg["modes"]}}
    log("1. model folder (seeded random weights, released layout) and the decoder")
    rows = max(cfg["batches"] + cfg["concurrency"])
    setup = BenchSetup.build(preset=cfg["preset"], device=cfg["device"], dtype=cfg["dtype"],
                             hift_dtype=cfg["hift_dtype"],
                             speaker=cfg["speaker"], micro_batch_size=rows)
    out["machine"] = machine_info(setup.device)
    try:
        log("2. matmul rates and voice preparation costs")
        dtypes = sorted({"fp32", "bf16", cfg["dtype"]})
        out["limit"] = {"matmul": limit.matmul_rates(setup, dtypes, cfg["batches"], cfg["matmul_min_s"])}
        out["prep"] = decode.prep_costs(setup, voices=2, reps=cfg["host_half_reps"])
        save(out)
        _model_numbers(setup, cfg, out, log)
        save(out)
        if cfg["dtype"] != "fp32" or cfg["hift_dtype"] != "fp32":
            log(f"4b. flow {cfg['dtype']}, vocoder {cfg['hift_dtype']} output against fp32 on "
                "the same weights, voice, tokens and seed")
            out["precision"] = precision.deviation(setup)
            log(f"  mel max |diff| {out['precision']['mel_max_abs']:.3g}, audio SNR "
                f"{out['precision']['audio_snr_db']:.1f} dB")
            save(out)
        if cfg["reference"]:
            _reference(setup, cfg, out, log)
            save(report.finish(out))
        _engine(setup, cfg, out, lambda partial: save(report.finish(partial)), log)
    finally:
        setup.close()
    out["wall_s"] = time.perf_counter() - started
    out["load_average_at_end"] = load_average()
    out["complete"] = True
    return report.finish(out)


def main(argv: list[str] | None = None) -> int:
    import sys

    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser().parse_args(argv)
    if args.render:
        import json
        from pathlib import Path

        saved = json.loads(Path(args.render).read_text(encoding="utf-8"))
        print(report.table(saved))
        print()
        print(report.markdown(saved))
        return 0
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.device == "cuda" and args.install_lane:
        print("error: --install-lane is for a CPU engine; a CUDA engine always installs on its lane (a side "
              "thread, the side stream)", file=sys.stderr)
        return 2
    if args.device == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda but torch sees no CUDA device", file=sys.stderr)
        return 2
    def save(partial: dict[str, Any]) -> None:
        if args.json_path:
            report.write_json(partial, args.json_path)

    result = run(_resolve(args), command_line(argv), save=save)
    print()
    print(report.table(result))
    if args.json_path:
        report.write_json(result, args.json_path)
        print(f"report: {args.json_path}")
    if args.plots:
        for path in report.plot(result, args.plots):
            print(f"plot: {path}")
    return 0
