"""The kit's one-screen text table, from the parts' JSON reports (any of them missing or partial)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

Report = dict[str, Any]


def _f(value: Any, spec: str = ".1f") -> str:
    return format(value, spec) if isinstance(value, int | float) else "-"


def smoke(r: Report) -> str:
    res = r["results"]
    check, env = res.get("gpu_check", {}), res.get("environment", {})
    gpu = env.get("gpu") or env.get("cpu_model", "?")
    parts = [f"{gpu}", f"gpu_check {'passed' if check.get('passed') else 'FAILED'}"]
    if check:
        parts.append(f"graphs vs eager {_f(check.get('graphs', {}).get('max_abs_diff_to_eager'), '.1e')}")
        parts.append(f"ahead==inline {'yes' if check.get('ahead_equals_inline_bit_for_bit') else 'no'}")
    if "matmul_bf16" in res:
        parts.append(f"bf16 matmul {_f(res['matmul_bf16']['tflops'], '.0f')} TFLOP/s")
    return ", ".join(parts)


def sweep(r: Report) -> str:
    ref = r["results"].get("reference_batch1", {})
    return f"reference batch-1 {_f(ref.get('fps'))} frames/s (fp32); engine below"


def sweep_rows(r: Report) -> list[str]:
    engine = r["results"].get("engine", {})
    cs = sorted({int(k.split("_")[0][1:]) for k in engine})
    if not cs:
        return []
    lines = ["     C  fps b    fps c    fps d    1st-audio p95 d  step p50 d  peak MiB d"]
    for c in cs:
        b, cc, d = (engine.get(f"C{c}_{m}", {}) for m in "bcd")
        lines.append(f"  {c:4d}  {_f(b.get('fps')):>7s}  {_f(cc.get('fps')):>7s}  {_f(d.get('fps')):>7s}  "
                     f"{_f(d.get('first_audio_s', {}).get('p95'), '.3f'):>12s} s  "
                     f"{_f(d.get('step_s', {}).get('p50'), '.4f'):>8s} s  "
                     f"{_f(d.get('peak_allocated_mib'), '.0f'):>8s}")
    return lines


def graphs(r: Report) -> str:
    res = r["results"]
    cmp_ = res.get("graphs_on_vs_off", {})
    speed = " ".join(f"{k.split('_')[0]} x{_f(v['speedup'], '.2f')}" for k, v in cmp_.items()) or "no pairs"
    fp32 = " ".join(f"{k.split('_')[0]} {_f(v['fps'])}" for k, v in res.get("fp32_graphs_on", {}).items())
    return f"graphs on/off {speed}; fp32 fps {fp32 or '-'}"


def churn(r: Report) -> str:
    res = r["results"]
    run, alone = res.get("churn", {}), res.get("against_alone", {})
    return (f"{run.get('jobs', '-')} jobs {run.get('ended', {})}; paths {run.get('prep_paths', {})}; "
            f"max|diff| alone {_f(alone.get('max_abs_diff_to_alone'), '.1e')} "
            f"{'ok' if alone.get('equal_within_1e-4') else 'NOT ok'}; "
            f"memory flat {res.get('memory_flat', 'n/a')}")


def overlap(r: Report) -> str:
    o = r["results"].get("overlap", {})
    return (f"step {_f(o.get('step_ms'))} ms, install {_f(o.get('install_ms'))} ms, together "
            f"{_f(o.get('together_ms'))} ms, overlap {_f(o.get('overlap'), '.2f')} ({o.get('timer', '-')})")


def compile_(r: Report) -> str:
    res = r["results"]
    build = res.get("build_compiled", {})
    vs = " ".join(f"{k.split('_')[0]} {_f(v['fps_compiled'])} fps x{_f(v['speedup'], '.2f')}"
                  for k, v in res.get("compiled_vs_graphs_only", {}).items())
    steps = " ".join(f"{k.split('_')[0]} step p50 {_f(v['step_s']['p50'], '.4f')} s"
                     for k, v in res.get("compiled", {}).items())
    return "; ".join(x for x in (f"backend {build.get('backend', '-')}", vs, steps) if x)


HEADLINES: dict[str, Callable[[Report], str]] = {"smoke": smoke, "sweep": sweep, "graphs": graphs,
                                                 "churn": churn, "overlap": overlap, "compile": compile_}


def render(title: str, reports: list[Report], fallbacks: dict[str, dict[str, int]]) -> str:
    lines = [title, "part        status      time/budget  what it found"]
    for r in reports:
        try:
            headline = HEADLINES[r["name"]](r)
        except Exception as exc:  # a partial report still gets its row
            headline = f"(unreadable: {type(exc).__name__})"
        errors = f" [{len(r.get('errors', []))} errors]" if r.get("errors") else ""
        lines.append(f"{r['part']} {r['name']:8s}  {r['status']:10s}  {_f(r.get('elapsed_s'), '.0f'):>4s}/"
                     f"{_f(r.get('budget_s'), '.0f'):<4s} s   {headline}{errors}")
        if r["name"] == "sweep":
            lines.extend(sweep_rows(r))
    na = sum(len(r.get("not_applicable", [])) for r in reports)
    skipped = sum(len(r.get("skipped", [])) for r in reports)
    lines.append(f"fallbacks: {fallbacks or 'none'}; not applicable here: {na}; "
                 f"skipped for budget: {skipped}")
    return "\n".join(lines)
