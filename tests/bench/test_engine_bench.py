"""The benchmark on the tiny preset: every part runs, and the report's numbers are positive and agree
with each other (frames counted == frames expected, ratios == quotients, histograms == rows)."""

from __future__ import annotations

import json

import pytest
import torch

from bench.engine import main
from bench.engine.machine import percentile
from bench.engine.sweep import clients_for, equal_tokens, mixed_tokens
from bench.engine.workload import BenchSetup
from gpu_worker.engine.streams import plan_chunks


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def _close(a: float, b: float, rel: float = 1e-9) -> bool:
    return abs(a - b) <= rel * max(abs(a), abs(b))


def test_workload_shapes_chunks_and_new_voices_arrive_mid_run() -> None:
    assert [len(plan_chunks(n)) for n in equal_tokens(3)] == [3]
    assert sorted(len(plan_chunks(n)) for n in mixed_tokens(2)) == [1, 2, 2, 3]
    clients = clients_for(4, equal_tokens(2), jobs_per_client=2, tag="t")
    assert [[job.voice for job in jobs] for jobs in clients] == [[0, 1], [1, 0], [0, 1], [1, 0]]
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5 and percentile([5.0], 95) == 5.0


def _check_report(report: dict) -> None:
    assert report["complete"] and report["git"]["revision"]
    assert report["command"].startswith("python -m bench.engine")
    assert report["machine"]["cpu_cores"] >= 1 and report["machine"]["torch_threads"] == 1
    ref = report["reference"]
    rows = [*report["decoder"], ref]
    for row in rows:
        assert row["frames"] == row["frames_expected"] > 0
        assert row["fps"] > 0 and _close(row["fps"], row["frames"] / row["seconds"])
        assert _close(row["rtf"], 50 / row["fps"])
    prep = report["prep"]
    assert prep["host_half_ms"]["p50"] > 0
    assert prep["device_half_ms"]["total"]["p50"] >= prep["device_half_ms"]["setup_solve"]["p50"] > 0
    limit = report["limit"]
    flops = limit["flops"]
    assert _close(sum(flops["by_component_per_frame"].values()), flops["flops_per_frame"], 1e-6)
    assert all(v > 0 for v in flops["by_component_per_frame"].values())
    assert any("attention" in op for op in flops["by_op"])
    assert set(limit["ceiling_fps"]) == {"fp32", "bf16"} and min(limit["ceiling_fps"].values()) > 0
    for row in report["decoder"]:
        assert _close(row["ratio_to_reference"], row["fps"] / ref["fps"])
        assert _close(row["limit_fraction"], row["fps"] / limit["ceiling_fps"]["fp32"])


def _check_engine(report: dict) -> None:
    runs = report["engine"]
    assert {(r["workload"], r["concurrency"]) for r in runs} == {("equal", 1), ("equal", 2), ("mixed", 2)}
    for r in runs:
        assert r["frames"] == r["frames_expected"] > 0 and r["fps"] > 0
        assert 0 < r["first_audio_s"]["p50"] <= r["first_audio_s"]["p95"]
        assert sum(int(k) * n for k, n in r["batch_hist"].items()) == r["rows"]
        assert max(int(k) for k in r["batch_hist"]) <= (1 if r["mode"] == "a" else r["concurrency"])
        assert sum(r["prep_paths"].values()) == r["jobs"] and r["peak_rss_mib"] > 0
        assert _close(r["ratio_to_reference"], r["fps"] / report["reference"]["fps"])
        first_path = {"a": "inline", "b": "inline", "c": "prepared_ahead"}.get(r["mode"], "already_installed")
        assert first_path in r["prep_paths"] and set(r["prep_paths"]) <= {first_path, "already_installed"}
        assert r["installs"] == (0 if r["mode"] == "d" else r["voices"])


def test_tiny_bench_report_is_complete_and_consistent(tmp_path, one_thread, capsys) -> None:
    pytest.importorskip("stepaudio2.cosyvoice2.flow.flow")
    out = tmp_path / "bench.json"
    code = main(["--preset", "tiny", "--threads", "1", "--concurrency", "1,2", "--chunks", "1",
                 "--steps", "1", "--jobs-per-client", "2", "--mixed", "2", "--modes", "a,b,c,d",
                 "--json", str(out), "--plots", str(tmp_path)])
    assert code == 0
    report = json.loads(out.read_text())
    _check_report(report)
    _check_engine(report)
    printed = capsys.readouterr().out
    assert "Engine:" in printed and "ref 1" in printed
    assert (tmp_path / "bench_tiny_cpu_fp32.png").stat().st_size > 0
    assert main(["--render", str(out)]) == 0
    rendered = capsys.readouterr().out
    assert "| reference, batch 1, fp32 |" in rendered and rendered.count("| equal |") == 8
    assert "precision" not in report  # only a reduced-precision run compares itself with fp32


def test_bf16_run_is_held_to_the_fp32_reference_and_reports_its_deviation(tmp_path, one_thread,
                                                                          capsys) -> None:
    pytest.importorskip("stepaudio2.cosyvoice2.flow.flow")
    out = tmp_path / "bench.json"
    assert main(["--preset", "tiny", "--dtype", "bf16", "--threads", "1", "--concurrency", "1",
                 "--batches", "1", "--chunks", "1", "--steps", "1", "--mixed", "0", "--modes", "c,d",
                 "--install-lane", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["config"]["install_lane"] is True
    lane_run = next(r for r in report["engine"] if r["mode"] == "c")  # its voice installed in the lane
    assert lane_run["prep_paths"] == {"prepared_ahead": 1} and lane_run["installs"] == 1
    assert lane_run["frames"] == lane_run["frames_expected"] > 0
    ceiling = report["limit"]["ceiling_fps"]
    ref, row = report["reference"], report["decoder"][0]
    assert ref["dtype"] == "fp32" and _close(ref["limit_fraction"], ref["fps"] / ceiling["fp32"])
    assert _close(row["limit_fraction"], row["fps"] / ceiling["bf16"])
    assert _close(row["ratio_to_reference"], row["fps"] / ref["fps"])
    p = report["precision"]
    assert p["dtype"] == "bfloat16" and p["frames"] == 3 * 50
    # bf16 rounds (so it differs from fp32) but stays close: a broken cast would be far off
    assert 0 < p["mel_mean_abs"] < 0.05 * p["mel_range"] and 0 < p["mel_max_abs"] < 0.2 * p["mel_range"]
    assert 20 < p["audio_snr_db"] < 200
    assert "bf16 (vocoder fp32) vs fp32" in capsys.readouterr().out


def test_speedups_compare_before_and_after_on_the_same_inputs(tmp_path, one_thread) -> None:
    from bench.engine import rotation, speedups

    out = tmp_path / "speedups.json"
    assert speedups.main(["--rows", "2", "--reps", "1", "--threads", "1", "--decoder", "tiny", "--bf16",
                          "--vocoder-frames", "8",  # the full vocoder; bf16 without bf16 instructions is slow
                          "--setup-batch", "2", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["results"]
    parts = {" ".join(r["name"].split(" ")[:2]): r for r in rows}
    assert {"hift forward,", "hift 2", "DiT linear", "DiT causal"} <= set(parts)
    assert sum(r["name"].startswith("snake") for r in rows) == 3
    for r in rows:
        if "before_ms" in r:
            assert r["before_ms"] > 0 and r["after_ms"] > 0
            assert _close(r["speedup"], r["before_ms"] / r["after_ms"])
    # the kept HiFT speed-ups are exact; the linear and the rejected conv-as-matmul round differently
    assert all(r["max_abs_diff"] == 0 for r in rows if r["name"].startswith(("snake", "hift forward")))
    assert 0 < parts["DiT linear"]["max_abs_diff"] < 1e-4 and 0 < parts["DiT causal"]["max_abs_diff"] < 1e-4
    gelu = {r["name"].split(" ")[6].rstrip(":"): r for r in rows if r["name"].startswith("fc1 + gelu")}
    assert set(gelu) == {"float32", "bfloat16"}
    assert gelu["float32"]["max_abs_diff"] < 1e-4 and gelu["bfloat16"]["max_abs_diff"] < 0.1
    assert 15 < parts["hift 2"]["audio_snr_db"] < 200  # a bf16 vocoder body: close to fp32, not equal
    decoder = [r for r in rows if r["name"].startswith("decoder tiny")]
    for _, _, what in rotation.PAIRS:
        switched = {r["name"].split(": ")[1].split(" ")[0] for r in decoder if f"({what})" in r["name"]}
        assert switched == {"install_s", "fps_1_rows", "fps_2_rows"}, what
    against_reference = [r for r in decoder if "vs reference" in r["name"]]
    variants = {**rotation.FP32, **rotation.BF16}
    assert len(against_reference) == 2 * len(variants)  # 1 and 2 rows of each variant, same rotation
    for r in decoder:
        assert r["before"] > 0 and r["after"] > 0
        samples = r["samples"]
        assert all(len(samples[name]["install_s"]) == 2 for name in variants)
        assert len(samples["reference"]["fps_1_rows"]) == 2 and len(samples["reference"]["install_s"]) == 1
    for r in against_reference:
        assert _close(r["speedup"], r["after"] / r["before"])
    (batch,) = [r for r in rows if r["name"].startswith("install 2 voices")]
    assert len(batch["samples"]["one_by_one"]) == len(batch["samples"]["batched"]) == 2
    assert _close(batch["speedup"], batch["before"] / batch["after"]) and batch["max_abs_diff"] < 1e-4


def test_the_install_lane_is_refused_for_a_cuda_engine(capsys) -> None:
    assert main(["--preset", "tiny", "--device", "cuda", "--install-lane"]) == 2
    assert "--install-lane is for a CPU engine" in capsys.readouterr().err


def test_steps_bench_measures_every_allowed_count_against_ten_on_the_same_weights(tmp_path, one_thread,
                                                                                 capsys) -> None:
    from bench.engine import steps

    torch.set_num_threads(1)
    out = tmp_path / "steps.json"
    assert steps.main(["--preset", "tiny", "--rows", "2", "--rounds", "2", "--chunks", "2",
                       "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    by_steps = {r["steps"]: r for r in report["results"]}
    assert set(by_steps) == {6, 8, 10} and report["frames"] == 2 * 50
    ten = by_steps[10]
    assert ten["mel_max_abs"] == 0 and ten["speedup"] == 1.0  # the 10-step run is the yardstick
    for n in (6, 8):
        r = by_steps[n]
        assert len(r["fps_samples"]) == 2 and r["fps"] > 0
        assert _close(r["speedup"], r["fps"] / ten["fps"])
        # a coarser solve of the same weights moves the mel, but not wholesale (a different model
        # or voice would be off by the mel's whole range)
        assert 0 < r["mel_mean_abs"] < 0.05 * r["mel_range"] and 0 < r["mel_max_abs"] < 0.5 * r["mel_range"]
    assert by_steps[6]["mel_mean_abs"] > by_steps[8]["mel_mean_abs"]  # fewer steps, further from 10
    assert "| 6 |" in capsys.readouterr().out


def test_streams_bench_reports_what_each_added_stream_costs_in_lanes_and_in_caches_of_its_own(
        one_thread, capsys) -> None:
    from bench.engine import streams

    torch.set_num_threads(1)
    setup = BenchSetup.build(preset="tiny", device="cpu", dtype="fp32", speaker="standin", micro_batch_size=4)
    try:
        report = streams.measure(setup, [1, 2, 4], rounds=2)
    finally:
        setup.close()
    before, lanes = report["results"]["per_stream"], report["results"]["lanes"]
    assert [x["rows"] for x in before] == [x["rows"] for x in lanes] == [1, 2, 4]
    for b, a in zip(before, lanes, strict=True):
        assert b["stream_bytes"] > 0 and a["stream_bytes"] > 0 and a["voice_bytes"] == b["voice_bytes"] > 0
        assert a["copied_bytes"] < b["copied_bytes"]  # the voice's last 100 frames against 300 own ones
        assert len(b["step_s_all"]) == len(a["step_s_all"]) == 2
    slope = report["per_added_stream"]
    assert 0 < slope["lanes"]["copied_bytes_per_stream"] < slope["per_stream"]["copied_bytes_per_stream"]
    assert slope["lanes"]["stream_bytes_per_stream"] > 0
    print(streams.table(report))
    assert "| 4 | lanes |" in capsys.readouterr().out
