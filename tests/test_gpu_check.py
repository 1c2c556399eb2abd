"""scripts/gpu_check.py, the script a GPU session runs on a lent device, run here on the CPU (tiny preset,
one round) so that it cannot rot between GPU sessions: it completes, and its report holds what the
docs quote from it."""

import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))

import gpu_check  # noqa: E402


def test_the_gpu_check_runs_to_its_report_on_a_cpu(tmp_path) -> None:
    out = tmp_path / "report.json"
    args = ["--device", "cpu", "--rounds", "2", "--install-batch", "2", "--out", str(out)]
    assert gpu_check.main(args) == 0
    report = json.loads(out.read_text())
    assert report["device"] == "cpu" and report["lengths_ok"]
    assert report["ahead_equals_inline_bit_for_bit"]  # on a CPU installs are bit-reproducible
    assert report["ahead"]["inline_calls"] == 0 and report["inline"]["inline_calls"] == 3
    batch = report["install_batch"]
    assert batch["preset"] == "tiny" and batch["voices"] == 2 and len(batch["samples"]["batched"]) == 2
    assert batch["one_by_one_s"] > 0 and batch["batched_s"] > 0 and batch["max_abs_diff"] < 1e-4
    graphs = report["graphs"]  # a CPU captures nothing: the wrapped modules run eagerly, the solve in its
    assert graphs["flow_cuda_graphs"] == graphs["vocoder_cuda_graphs"] == 0  # buckets' shapes (rounding)
    assert 0.0 <= graphs["max_abs_diff_to_eager"] <= 1e-5
