"""The kit's one-screen text table, from the parts' JSON reports (any of them missing or partial). Its first
line is the verdict (`verdict_line`): PASSED, or FAILED with each failing part and its first reason."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

Report = dict[str, Any]


def _f(value: Any, spec: str = ".1f") -> str:
    return format(value, spec) if isinstance(value, int | float) else "-"


PASSING = ("ok", "skipped")  # a part's statuses that leave the kit's exit code 0


def first_reason(r: Report) -> str:
    if r.get("failures"):
        return str(r["failures"][0])
    if r.get("errors"):
        e = r["errors"][-1]
        return f"{e.get('where', '?')}: {e.get('error', '?')}"
    return str(r.get("status"))


def verdict_line(reports: list[Report]) -> str:
    bad = [r for r in reports if r.get("status") not in PASSING]
    if bad:
        return "FAILED: " + "; ".join(f"{r['part']} {r['name']} {r.get('status')}: {first_reason(r)[:160]}"
                                      for r in bad)
    skipped = [f"{r['part']} {r['name']}" for r in reports if r.get("status") == "skipped"]
    return "PASSED: every part ok" + (f" ({', '.join(skipped)} skipped: budget)" if skipped else "")


def smoke(r: Report) -> str:
    res = r["results"]
    check, env = res.get("gpu_check", {}), res.get("environment", {})
    gpu = env.get("gpu") or env.get("cpu_model", "?")
    parts = [f"{gpu}", f"gpu_check {'passed' if check.get('passed') else 'FAILED'}"]
    if check:
        g = check.get("graphs", {})
        captured = g.get("graphs_captured", {})
        parts.append(f"graphs flow {captured.get('flow', '-')} vocoder {captured.get('vocoder', '-')}, "
                     f"vs eager {_f(g.get('max_abs_diff_to_eager'), '.1e')}")
        parts.append("ahead vs inline " + " ".join(
            f"{'1-stream' if a['one_stream'] else 'side'} {'ok' if a['ok'] else 'NOT ok'}"
            for a in check.get("ahead_vs_inline", [])))
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
    return lines + tokenize_rows(r["results"].get("tokenize") or {})


def tokenize_rows(tok: dict[str, Any]) -> list[str]:
    """The S3 tokenizer's batches beside the decoder, a line per attention: segments/s by batch size, and
    the largest batch's share of what a second of audio costs (tokenize + decode)."""
    lines = []
    for attention in ("written_out", "sdpa"):
        batches = {k: p for k, p in (tok.get(attention) or {}).items() if isinstance(p, dict)}
        if not batches:
            continue
        rates = " ".join(f"{k} {_f(p.get('segments_per_s'))}" for k, p in batches.items())
        last = list(batches.values())[-1]
        share = last.get("share_of_step")
        lines.append(f"  tokenize ({attention}) segments/s: {rates}; share of a step "
                     f"{_f(None if share is None else 100 * share)} %")
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
    installs = run.get("installs", {})
    install_s, campplus_s = installs.get("install_s") or {}, installs.get("campplus_s") or {}
    return (f"{run.get('jobs', '-')} jobs {run.get('ended', {})}; paths {run.get('prep_paths', {})}; "
            f"installs p50 {_f(install_s.get('p50'), '.3f')} s (CAM++ {_f(campplus_s.get('p50'), '.3f')} s), "
            f"step p95 {_f((run.get('step_s') or {}).get('p95'), '.3f')} s; "
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
    lines = [verdict_line(reports), title, "part        status      time/budget  what it found"]
    for r in reports:
        try:
            headline = HEADLINES[r["name"]](r) if r.get("status") != "skipped" else r["skipped"][-1]
        except Exception as exc:  # a partial report still gets its row
            headline = f"(unreadable: {type(exc).__name__})"
        errors = f" [{len(r.get('errors', []))} errors]" if r.get("errors") else ""
        errors += f" [{len(r.get('failures', []))} checks failed]" if r.get("failures") else ""
        lines.append(f"{r['part']} {r['name']:8s}  {r['status']:10s}  {_f(r.get('elapsed_s'), '.0f'):>4s}/"
                     f"{_f(r.get('budget_s'), '.0f'):<4s} s   {headline}{errors}")
        if r["name"] == "sweep":
            lines.extend(sweep_rows(r))
    na = sum(len(r.get("not_applicable", [])) for r in reports)
    skipped = sum(len(r.get("skipped", [])) for r in reports)
    lines.append(f"fallbacks: {fallbacks or 'none'}; not applicable here: {na}; "
                 f"skipped for budget: {skipped}")
    return "\n".join(lines)
