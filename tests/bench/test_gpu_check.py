"""scripts/gpu_check.py, the script a GPU session runs on a lent device, run here on the CPU (tiny preset,
one round) so that it cannot rot between GPU sessions: it completes, and its report holds what the
docs quote from it. And its strict rules (the default on CUDA, issue 41): a run whose graphs fell back
or never ran fails, and says so on its first line, instead of comparing the eager path with itself."""

import json
import sys
from pathlib import Path

from bench.kit import verdict
from gpu_worker.accel import flow_graphs, graphs
from tests.support.graphs import stand_in_record

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))

import gpu_check  # noqa: E402


def test_the_gpu_check_runs_to_its_report_on_a_cpu(tmp_path, capsys) -> None:
    out = tmp_path / "report.json"
    args = ["--device", "cpu", "--rounds", "2", "--install-batch", "2", "--out", str(out)]
    assert gpu_check.main(args) == 0
    assert capsys.readouterr().out.splitlines()[0] == "gpu_check: passed"
    report = json.loads(out.read_text())
    assert report["device"] == "cpu" and report["lengths_ok"] and not report["strict"]
    (one_stream,) = report["ahead_vs_inline"]  # a CPU has one stream: bit for bit
    assert one_stream["one_stream"] and one_stream["bit_for_bit"] and one_stream["ok"]
    assert report["ahead"]["inline_calls"] == 0 and report["inline"]["inline_calls"] == 3
    batch = report["install_batch"]
    assert batch["preset"] == "tiny" and batch["voices"] == 2 and len(batch["samples"]["batched"]) == 2
    assert batch["one_by_one_s"] > 0 and batch["batched_s"] > 0 and batch["max_abs_diff"] < 1e-4
    g = report["graphs"]  # a CPU captures nothing: the wrapped modules run eagerly, the solve in its
    assert g["flow_cuda_graphs"] == g["vocoder_cuda_graphs"] == 0  # buckets' shapes (rounding)
    assert 0.0 <= g["max_abs_diff_to_eager"] <= 1e-5
    assert g["graphs_captured"] == {"flow": 0, "vocoder": 0} and g["graph_misses"]["flow"] > 0
    # the same figures under the strict rules: what a CUDA run with no graph would have been told
    strict = gpu_check.failures(report, strict=True)
    assert {"no flow CUDA graph captured", "no vocoder CUDA graph captured"} <= set(strict)
    assert any(f.startswith("flow:") and "ran eagerly" in f for f in strict)


def test_a_strict_check_whose_vocoder_captures_fall_back_fails_and_says_so_first(tmp_path, capsys,
                                                                                  monkeypatch) -> None:
    """The graph runners as on CUDA (capturable; a stand-in graph replays on the CPU), every vocoder
    capture refused as CUDA refused torch.istft's read-back: the graphs still equal eager (the fallback
    runs eagerly), and before issue 41 the check passed on exactly that."""
    def capturable_flow(flow, lanes, max_rows):
        runner = flow_graphs.GraphedFlow(flow, max_rows=max_rows)
        runner.capturable = True
        runner.capture(lanes)
        return runner

    def capturable_hift(hift, max_rows):
        runner = graphs.GraphedHiFT(hift, max_rows=max_rows)
        runner.capturable = True
        return runner

    def refused(self, run):
        raise RuntimeError("CUDA error: operation not permitted when stream is capturing")

    monkeypatch.setattr(flow_graphs.GraphedFlow, "_record", stand_in_record)
    monkeypatch.setattr(graphs.GraphedHiFT, "_record", refused)
    monkeypatch.setattr(gpu_check, "graph_flow", capturable_flow)
    monkeypatch.setattr(gpu_check, "graph_hift", capturable_hift)
    out = tmp_path / "report.json"
    args = ["--device", "cpu", "--strict", "--rounds", "1", "--install-batch", "0", "--out", str(out)]
    assert gpu_check.main(args) == 1
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith("gpu_check: FAILED") and "vocoder graph fallbacks: capture_error" in first
    report = json.loads(out.read_text())
    g = report["graphs"]
    assert g["max_abs_diff_to_eager"] <= 1e-5  # what the check used to pass on
    assert g["graphs_captured"]["flow"] > 0 and g["graph_replays"]["flow"] > 0
    assert g["graphs_captured"]["vocoder"] == 0 and g["graph_fallbacks"]["vocoder"]["capture_error"] > 0
    assert report["failures"] == [f for f in report["failures"] if "flow" not in f]  # the flow was fine


def test_ahead_against_inline_is_bit_for_bit_on_one_stream_and_within_tolerance_beside_it() -> None:
    assert verdict.ahead_vs_inline(True, 0.0, one_stream=True)["ok"]
    assert not verdict.ahead_vs_inline(False, 1e-9, one_stream=True)["ok"]  # one stream: the same bits
    assert verdict.ahead_vs_inline(False, 1e-6, one_stream=False)["ok"]
    assert not verdict.ahead_vs_inline(False, 1e-4, one_stream=False)["ok"]
