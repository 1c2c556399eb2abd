"""Prometheus's own tools for the tests: promtool (rules, rule unit tests, exposition lint) and the server.

Debian's `prometheus` package has both (`.ci/run` installs it). Missing, they skip the tests that need
them, except under `./run test`, where a missing one fails (`tests.conftest.service_missing`).
"""

from __future__ import annotations

import contextlib
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import yaml

from app.dev.services import wait_until
from tests.conftest import REPO, service_missing
from tests.support.net import free_port

PROMETHEUS_DIR = REPO / "deploy" / "prometheus"
RULE_FILES = (PROMETHEUS_DIR / "recording.yml", PROMETHEUS_DIR / "alerts.yml")
DASHBOARD = REPO / "deploy" / "grafana" / "wavefarm.json"


def binary(name: str) -> str:
    """The path of `promtool` or `prometheus`, or the test is skipped (failed under ./run test)."""
    path = shutil.which(name)
    if path is None:
        service_missing(f"no {name} binary (apt-get install prometheus)")
    assert path is not None
    return path


def promtool(*args: str, stdin: str | None = None,
             cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([binary("promtool"), *args], input=stdin, capture_output=True, text=True,
                          timeout=120, cwd=cwd)


def _mask(expr: str) -> str:
    """`expr` with everything inside (), {} and [] blanked: what is left is its top level."""
    out, depth = [], 0
    for ch in expr:
        depth += ch in "({["
        out.append(ch if depth == 0 else " ")
        depth -= ch in ")}]"
    return "".join(out)


def _split(expr: str, pattern: str) -> list[str]:
    cuts = [(m.start(), m.end()) for m in re.finditer(pattern, _mask(expr))]
    edges = [0, *(i for cut in cuts for i in cut), len(expr)]
    return [expr[a:b].strip() for a, b in zip(edges[::2], edges[1::2], strict=True)]


def alert_signals(expr: str) -> list[str]:
    """What an alert compares, which must return data while all is well: the left side of each top-level
    comparison, each operand of and/or/unless, the inside of an absent()."""
    expr = " ".join(expr.split())
    absent = re.fullmatch(r"absent\((.*)\)", expr)
    if absent:
        return [absent.group(1)]
    return [_split(part, r"\s(?:==|!=|>=|<=|>|<)\s")[0] for part in _split(expr, r"\s(?:and|or|unless)\s")]


@contextlib.contextmanager
def prometheus(workdir: Path, targets: dict[str, str], *, interval_s: int = 1) -> Iterator[str]:
    """A real Prometheus scraping `targets` ({job name: host:port}) every `interval_s`, with the deploy
    rules evaluated at the same interval, its data in `workdir`; yields its base URL once ready."""
    for rules in RULE_FILES:  # the groups' own interval, shortened for the test
        text = re.sub(r"interval: \d+s", f"interval: {interval_s}s", rules.read_text())
        (workdir / rules.name).write_text(text)
    config = {"global": {"scrape_interval": f"{interval_s}s", "evaluation_interval": f"{interval_s}s"},
              "rule_files": [str(workdir / rules.name) for rules in RULE_FILES],
              "scrape_configs": [{"job_name": job, "static_configs": [{"targets": [target]}]}
                                 for job, target in targets.items()]}
    (workdir / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    log = workdir / "prometheus.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([binary("prometheus"), f"--config.file={workdir / 'prometheus.yml'}",
                                 f"--storage.tsdb.path={workdir / 'data'}",
                                 f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
                                stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        started = wait_until(lambda: _ready(url) or proc.poll() is not None, timeout=120)
        if not started or proc.poll() is not None:
            raise RuntimeError(f"prometheus did not start:\n{log.read_text(errors='replace')[-3000:]}")
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _ready(url: str) -> bool:
    try:
        return httpx.get(f"{url}/-/ready", timeout=2).status_code == 200
    except httpx.TransportError:
        return False


def query(url: str, expr: str) -> list[dict[str, Any]]:
    """The instant vector `expr` evaluates to now (an error is a failure: the expression is wrong)."""
    body = httpx.get(f"{url}/api/v1/query", params={"query": expr}, timeout=30).json()
    assert body["status"] == "success", f"{expr}: {body}"
    return list(body["data"]["result"])
