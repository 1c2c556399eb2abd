"""deploy/prometheus and deploy/grafana, checked with Prometheus's own promtool: the rules load, every
alert has a unit test that fires it (tests/deploy/alerts_test.yml), the compose stack's configuration
loads, the GPU worker's exposition passes the linter, and the dashboard reads only series that exist."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import yaml
from prometheus_client import CollectorRegistry, generate_latest

from tests.support.prom import DASHBOARD, PROMETHEUS_DIR, RULE_FILES, promtool

HERE = Path(__file__).parent
ALERTS_TEST = HERE / "alerts_test.yml"
# A series a GPU worker exports (gpu_worker/worker/metrics.py) that has no sample until a CUDA graph falls
# back:
GRAPH_FALLBACKS = "wavefarm_graph_fallbacks_total"


def rules(kind: str) -> list[dict]:
    return [rule for path in RULE_FILES for group in yaml.safe_load(path.read_text())["groups"]
            for rule in group["rules"] if kind in rule]


def dashboard_expressions() -> list[str]:
    panels = json.loads(DASHBOARD.read_text())["panels"]
    return [target["expr"] for panel in panels for target in panel["targets"]]


def test_the_rules_pass_promtool_check_rules() -> None:
    done = promtool("check", "rules", *map(str, RULE_FILES))
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"SUCCESS: {len(rules('record'))} rules found" in done.stdout


def test_every_alert_fires_in_a_promtool_unit_test_and_the_unit_tests_pass() -> None:
    done = promtool("test", "rules", str(ALERTS_TEST))
    assert done.returncode == 0, done.stdout + done.stderr
    tests = yaml.safe_load(ALERTS_TEST.read_text())["tests"]
    cases = [case for test in tests for case in test["alert_rule_test"]]
    fired = {case["alertname"] for case in cases if case["exp_alerts"]}
    quiet = {case["alertname"] for case in cases if not case["exp_alerts"]}
    names = {rule["alert"] for rule in rules("alert")}
    assert fired == names and quiet == names  # each one both fires and stays quiet somewhere


def test_a_broken_threshold_fails_the_unit_tests(tmp_path: Path) -> None:
    """The unit tests can fail: the same tests on rules whose first-audio bound moved do."""
    copy = tmp_path / "deploy" / "prometheus"
    shutil.copytree(PROMETHEUS_DIR, copy)
    alerts = copy / "alerts.yml"
    alerts.write_text(alerts.read_text().replace("p95_5m > 5", "p95_5m > 50"))
    tests = tmp_path / "tests" / "deploy"
    tests.mkdir(parents=True)
    shutil.copy(ALERTS_TEST, tests)
    done = promtool("test", "rules", str(tests / ALERTS_TEST.name))
    assert done.returncode != 0 and "WavefarmFirstAudioSlow" in done.stdout + done.stderr


def test_the_compose_prometheus_configuration_loads_with_the_rules(tmp_path: Path) -> None:
    config = yaml.safe_load((PROMETHEUS_DIR / "prometheus.yml").read_text())
    mounted = "/etc/prometheus/wavefarm/"
    assert all(path.startswith(mounted) for path in config["rule_files"])
    config["rule_files"] = [str(PROMETHEUS_DIR / Path(path).name) for path in config["rule_files"]]
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    done = promtool("check", "config", str(tmp_path / "prometheus.yml"))
    assert done.returncode == 0, done.stdout + done.stderr
    jobs = {job["job_name"] for job in config["scrape_configs"]}
    assert jobs == {"wavefarm-api", "wavefarm-gpu-worker"}


def test_the_gpu_worker_exposition_passes_promtool_check_metrics() -> None:
    from gpu_worker.worker.metrics import WorkerMetrics

    registry = CollectorRegistry()
    metrics = WorkerMetrics(registry, lambda: {"batches": 3, "mel_frames": 150, "installs": 2, "evictions": 1,
                                               "live_jobs": 1, "voice_bytes": 4096})
    metrics.first_audio.observe(0.4)
    metrics.rows_per_step.observe(3)
    exposition = generate_latest(registry).decode()
    assert "wavefarm_worker_frames_total 150.0" in exposition
    done = promtool("check", "metrics", stdin=exposition)
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_dashboard_reads_only_exported_or_recorded_series() -> None:
    """Every series name a panel or a rule uses is exported by the API or a GPU worker (their modules name
    them) or recorded by a rule: a renamed metric fails here before a dashboard goes blank."""
    recorded = {rule["record"] for rule in rules("record")}
    sources = "".join(p.read_text() for p in (HERE.parents[1] / "app/api/metrics.py",
                                                 HERE.parents[1] / "gpu_worker/worker/metrics.py"))
    exported = set(re.findall(r'"(wavefarm_[a-z_]+)"', sources))
    used = set()
    for expr in dashboard_expressions() + [rule["expr"] for rule in rules("expr")]:
        used |= set(re.findall(r"\bwavefarm[a-z0-9_:]*", expr))
    suffixes = ("_total", "_bucket", "_sum", "_count")
    unknown = {name for name in used - recorded
               if not any(name.removesuffix(s) in exported for s in ("", *suffixes))}
    assert unknown == set()
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] == "wavefarm" and len(dashboard["panels"]) >= 8
