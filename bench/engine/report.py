"""Turning measurements into a report: derived ratios, the printed table, the JSON file and the plots.

    finish(report) adds to every engine run its ratio to the reference's batch-1 frames per second and
        the fraction of the limit it reached, and to every decoder row the same two numbers
    table(report) -> str      the text the CLI prints
    write_json(report, path)  / plot(report, directory) -> [paths]   (matplotlib, if installed)
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

SCHEMA = 1


def _ratio(value: float | None, base: float | None) -> float | None:
    return None if value is None or not base else value / base


def finish(report: dict[str, Any]) -> dict[str, Any]:
    ref = (report.get("reference") or {}).get("fps")
    limit = report.get("limit") or {}
    ceiling = (limit.get("ceiling_fps") or {}).get(report["config"]["dtype"])
    rows = [*report.get("decoder", []), *report.get("engine", [])]
    if report.get("reference"):
        rows.append(report["reference"])
    for row in rows:
        if "fps" in row:
            row["ratio_to_reference"] = _ratio(row["fps"], ref)
            # the reference runs in its own dtype (fp32 unless asked), and is held to that dtype's limit
            own = (limit.get("ceiling_fps") or {}).get(row["dtype"]) if "dtype" in row else ceiling
            row["limit_fraction"] = _ratio(row["fps"], own)
    return report


def _f(value: Any, fmt: str = ".1f", none: str = "-") -> str:
    return none if value is None else format(value, fmt)


def _header(report: dict[str, Any]) -> list[str]:
    m, g, c = report["machine"], report["git"], report["config"]
    dirty = f" + {len(g['modified_files'])} modified files" if g.get("modified_files") else ""
    return [
        f"wavefarm bench: preset {c['preset']}, {m['device']} {c['dtype']} (vocoder "
        f"{c.get('hift_dtype', 'fp32')}), {m['torch_threads']} threads, "
        f"{m['cpu_model']} ({m['cpu_cores']} cores), torch {m['torch_version']}",
        f"git {str(g.get('revision'))[:12]}{dirty}; load average at start {m.get('load_average_at_start')}",
        f"command: {report['command']}", ""]


def _model_lines(report: dict[str, Any]) -> list[str]:
    ref_dtype = (report.get("reference") or {}).get("dtype", "fp32")
    lines = ["Model: steady-state chunks (50 mel frames = 1 s of audio) through StreamingDecoder.step "
             f"({report['config']['dtype']}; the reference 'ref' in {ref_dtype})",
             f"  {'rows':>6} {'frames/s':>9} {'RTF':>6} {'stream RTF':>10} {'step p50 s':>10} "
             f"{'x ref':>6} {'% limit':>7}"]
    ref = report.get("reference")
    if ref:
        lines.append(f"  {'ref 1':>6} {ref['fps']:9.1f} {ref['rtf']:6.2f} {ref['rtf']:10.2f} "
                     f"{ref['step_s']['p50']:10.3f} {_f(ref.get('ratio_to_reference'), '.2f'):>6} "
                     f"{_f(ref.get('limit_fraction'), '.1%'):>7}")
    for row in report.get("decoder", []):
        if "skipped" in row:
            lines.append(f"  {row['batch']:>6} skipped: {row['skipped']}")
            continue
        lines.append(f"  {row['batch']:>6} {row['fps']:9.1f} {row['rtf']:6.2f} {row['stream_rtf']:10.2f} "
                     f"{row['step_s']['p50']:10.3f} {_f(row.get('ratio_to_reference'), '.2f'):>6} "
                     f"{_f(row.get('limit_fraction'), '.1%'):>7}")
    return lines


def _precision_lines(report: dict[str, Any]) -> list[str]:
    p = report.get("precision")
    if not p:
        return []
    vocoder = report["config"].get("hift_dtype", "fp32")
    return ["", f"{report['config']['dtype']} (vocoder {vocoder}) vs fp32, same weights, voice, tokens and "
            "seed "
            f"({p['chunks']} chunks, "
            f"setup solve included): mel max |diff| {p['mel_max_abs']:.3g} (fp32 mel spans "
            f"{p['mel_range']:.3g}), mean |diff| {p['mel_mean_abs']:.3g}; audio max |diff| "
            f"{p['audio_max_abs']:.3g}, SNR {p['audio_snr_db']:.1f} dB"]


def _prep_lines(report: dict[str, Any]) -> list[str]:
    prep = report.get("prep")
    if not prep:
        return []
    dev = prep["device_half_ms"]
    parts = ", ".join(f"{k} {dev[k]['p50']:.0f}" for k in ("s3_quantize", "campplus", "setup_solve", "other")
                      if dev.get(k))
    ref = report.get("reference") or {}
    ref_solve = f"; reference setup solve {ref['setup_solve_s'] * 1000:.0f} ms" if ref else ""
    return ["", f"Voice (6 s): host half p50 {prep['host_half_ms']['p50']:.0f} ms; device half p50 "
            f"{dev['total']['p50']:.0f} ms ({parts}){ref_solve}; installed prompt "
            f"{prep['voice_cache_mib']:.0f} MiB; speaker = {prep['speaker']}"]


def _limit_lines(report: dict[str, Any]) -> list[str]:
    limit = report.get("limit")
    if not limit:
        return []
    fl = limit["flops"]
    comp = ", ".join(f"{k} {v / 1e9:.3g}" for k, v in fl["by_component_per_frame"].items())
    rates = "; ".join(f"{k}: best mm {v['best_gflops']:.3g} GFLOP/s -> {limit['ceiling_fps'][k]:.3g} frames/s"
                      for k, v in limit["matmul"].items())
    return ["", f"Limit: {fl['flops_per_frame'] / 1e9:.3g} GFLOP per mel frame ({comp}); {rates}"]


def _engine_lines(report: dict[str, Any]) -> list[str]:
    runs = report.get("engine", [])
    if not runs:
        return []
    lines = ["", "Engine: frames/s served (mel frames), first audio and step seconds p50/p95",
             f"  {'load':5} {'C':>3} {'mode':4} {'frames/s':>9} {'x ref':>6} {'% limit':>7} "
             f"{'first audio':>13} {'step s':>13} {'prep share':>10} {'peak RSS':>9}  batches"]
    for r in runs:
        if "skipped" in r:
            lines.append(f"  {r['workload']:5} {r['concurrency']:>3} {r['mode']:4} skipped: {r['skipped']}")
            continue
        fa, st = r["first_audio_s"], r["step_s"]
        lines.append(
            f"  {r['workload']:5} {r['concurrency']:>3} {r['mode']:4} {r['fps']:9.1f} "
            f"{_f(r.get('ratio_to_reference'), '.2f'):>6} {_f(r.get('limit_fraction'), '.1%'):>7} "
            f"{fa['p50']:6.2f}/{fa['p95']:6.2f} {st['p50']:6.2f}/{st['p95']:6.2f} {r['prep_share']:10.0%} "
            f"{_f(r['peak_rss_mib'] / 1024, '.1f')}G  {r['batch_hist']}")
    lines.append("  modes: " + "; ".join(f"{k} = {v}" for k, v in report["modes"].items()))
    return lines


def table(report: dict[str, Any]) -> str:
    lines = (_header(report) + _model_lines(report) + _precision_lines(report) + _prep_lines(report)
             + _limit_lines(report))
    lines += _engine_lines(report)
    if report.get("complete"):
        lines.append(f"\nwall time {report['wall_s']:.0f} s; load average at end "
                     f"{report.get('load_average_at_end')}")
    else:
        lines.append("\nINCOMPLETE run: the report holds the parts finished before it stopped")
    return "\n".join(lines)


def publish(report: dict[str, Any], text: str, json_path: str | None) -> None:
    """A small bench's ending: the machine line, its table, and the whole report as JSON if asked."""
    print(json.dumps(report["machine"]))
    print(text)
    if json_path:
        write_json(report, json_path)


def write_json(report: dict[str, Any], path: str | Path) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(report, indent=1, sort_keys=False) + "\n", encoding="utf-8")
    tmp.replace(path)


def _decorate(axes: Any, ref: float | None, ceiling: float | None, dtype: str, formatter: Any) -> None:
    """The reference's and the limit's lines on the two throughput panels; log2 C axes, grid, legends."""
    for ax in axes[:2]:
        if ref:
            ax.axhline(ref, color="grey", linestyle="--", label=f"reference batch 1 ({ref:.0f})")
        if ceiling:
            ax.axhline(ceiling, color="red", linestyle=":", label=f"limit {dtype} ({ceiling:.0f})")
        ax.set_ylim(bottom=0)
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_formatter(formatter)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)


def plot(report: dict[str, Any], directory: str | Path) -> list[str]:
    """One PNG with three panels: decoder frames/s by batch, engine frames/s and first-audio p95 by C."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker
    except ImportError:
        return []
    c = report["config"]
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
    ref = (report.get("reference") or {}).get("fps")
    ceiling = ((report.get("limit") or {}).get("ceiling_fps") or {}).get(c["dtype"])
    dec = [r for r in report.get("decoder", []) if "fps" in r]
    axes[0].plot([r["batch"] for r in dec], [r["fps"] for r in dec], "o-", label="StreamingDecoder.step")
    axes[0].set(title="Decoder: mel frames/s by rows per step", xlabel="rows per step", ylabel="mel frames/s")
    equal = [r for r in report.get("engine", []) if r.get("workload") == "equal" and "fps" in r]
    for key, title in report["modes"].items():
        runs = [r for r in equal if r["mode"] == key]
        if runs:
            xs = [r["concurrency"] for r in runs]
            axes[1].plot(xs, [r["fps"] for r in runs], "o-", label=f"{key}: {title}")
            axes[2].plot(xs, [r["first_audio_s"]["p95"] for r in runs], "o-", label=f"{key}: {title}")
    axes[1].set(title="Engine: mel frames/s served", xlabel="concurrent streams C", ylabel="mel frames/s")
    axes[2].set(title="Engine: first-audio latency p95", xlabel="concurrent streams C", ylabel="seconds")
    _decorate(axes, ref, ceiling, c["dtype"], matplotlib.ticker.FormatStrFormatter("%g"))
    m = report["machine"]
    fig.suptitle(f"wavefarm bench: {c['preset']} preset, {m['device']} {c['dtype']}, {m['cpu_model']}, "
                 f"{m['torch_threads']} threads, git {str(report['git'].get('revision'))[:10]}", fontsize=9)
    fig.tight_layout()
    path = directory / f"bench_{c['preset']}_{report['machine']['device']}_{c['dtype']}.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [str(path)]


def _md_table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|",
            *("| " + " | ".join(row) + " |" for row in rows)]


def markdown(report: dict[str, Any]) -> str:
    """The report's tables as Markdown (for docs/PERFORMANCE.md), every number from the report."""
    ref = report.get("reference")
    rows = []
    if ref:
        rows.append([f"reference, batch 1, {ref.get('dtype', 'fp32')}", f"{ref['fps']:.1f}",
                     f"{ref['rtf']:.2f}",
                     f"{ref['step_s']['p50']:.2f}", "1.00", _f(ref.get("limit_fraction"), ".1%")])
    for r in report.get("decoder", []):
        if "skipped" in r:
            rows.append([f"StreamingDecoder, {r['batch']} rows", "skipped", r["skipped"], "", "", ""])
        else:
            rows.append([f"StreamingDecoder, {r['batch']} rows", f"{r['fps']:.1f}", f"{r['rtf']:.2f}",
                         f"{r['step_s']['p50']:.2f}", _f(r.get("ratio_to_reference"), ".2f"),
                         _f(r.get("limit_fraction"), ".1%")])
    out = _md_table(["decoder", "mel frames/s", "RTF", "step p50 (s)", "x reference", "of limit"], rows)
    runs = []
    for r in report.get("engine", []):
        if "skipped" in r:
            runs.append([r["workload"], str(r["concurrency"]), r["mode"], "skipped", r["skipped"],
                         *[""] * 6])
            continue
        fa, st = r["first_audio_s"], r["step_s"]
        runs.append([r["workload"], str(r["concurrency"]), r["mode"], f"{r['fps']:.1f}",
                     _f(r.get("ratio_to_reference"), ".2f"), _f(r.get("limit_fraction"), ".1%"),
                     f"{fa['p50']:.2f} / {fa['p95']:.2f}", f"{st['p50']:.2f} / {st['p95']:.2f}",
                     ", ".join(f"{k}: {n}" for k, n in r["batch_hist"].items()),
                     f"{r['prep_share']:.0%}", f"{r['peak_rss_mib'] / 1024:.1f}"])
    header = ["jobs", "C", "mode", "mel frames/s", "x reference", "of limit", "first audio p50 / p95 (s)",
              "step p50 / p95 (s)", "rows per step: steps", "prep share", "peak RSS (GiB)"]
    out += ["", *_md_table(header, runs)]
    return "\n".join(out)
