"""scripts/bench_routing.py at a tiny size on both databases: it seeds, routes each kind of voice the way
its docstring says, and its JSON has the fields docs/SCALING.md quotes (no bound on the times: the
machine is shared; the figures themselves come from the full-size run, by hand)."""

import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))

import bench_routing  # noqa: E402


def test_the_routing_benchmark_runs_small_and_reports_each_kind_of_decision(tmp_path: Path) -> None:
    out = tmp_path / "routing.json"
    assert bench_routing.main(["--workers", "4", "--voices", "200", "--done-jobs", "50", "--decisions", "10",
                               "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["target_ms"] == 2.0 and report["cores"] >= 1 and report["cpu"]
    assert [b["backend"] for b in report["backends"]] == ["postgres", "sqlite"]
    for backend in report["backends"]:
        assert backend["workers"] == 4 and backend["voices_installed"] == 200
        kinds = backend["kinds"]
        assert set(kinds) == {"held", "not_held", "gone", "floor_3_select_1"}
        for name in ("held", "not_held", "gone"):
            kind = kinds[name]
            assert kind["decisions"] == 10
            assert 0 < kind["p50_ms"] <= kind["p99_ms"] and kind["client_cpu_ms"] >= 0
            assert kind["statements"] == 3  # live workers, backlogs, holders: whatever the size
        assert kinds["floor_3_select_1"]["statements"] == 3
        assert kinds["held"]["routes"] == {"affinity": 10}  # installed on an idle live worker
        assert kinds["not_held"]["routes"] == {"placed": 10}
        assert kinds["gone"]["routes"] == {"placed": 10}  # its only holder is gone: placed anew
        assert backend["statements"] and all(s["calls"] > 0 for s in backend["statements"])
    server = report["backends"][0]["server"]  # PostgreSQL's own time per statement of a decision
    assert set(server) == {"held", "not_held", "gone"}
    assert all(len(rows) == 3 and all(r["execution_ms"] > 0 for r in rows) for rows in server.values())
