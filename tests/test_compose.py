"""docker-compose.yml and the Dockerfile agree with the code: real CLI commands, real settings.

No Docker needed: the YAML is parsed, every wavefarm command goes through the CLI's own parser, and
every WAVEFARM_* variable (set or interpolated) must be a Settings field whose value validates.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from app.cli import build_parser, subcommands
from app.settings import Settings

REPO = Path(__file__).resolve().parents[1]
BACKING = {"broker", "results", "features", "postgres"}
MONITORING = {"prometheus", "grafana"}
SERVICES = BACKING | MONITORING | {"migrate", "api", "cpu-worker", "gpu-worker-0", "flower"}
WAVEFARM_SERVICES = SERVICES - BACKING - MONITORING
INTERPOLATION = re.compile(r"\$\{([A-Z0-9_]+)(?::?([-?])([^}]*))?\}")


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return yaml.safe_load((REPO / "docker-compose.yml").read_text())


def interpolate(value: str) -> str:
    """What compose would substitute with nothing set in the shell: the default, or a stand-in."""
    return INTERPOLATION.sub(lambda m: m.group(3) if m.group(2) == "-" else "stand-in", value)


def test_compose_has_every_service(compose: dict[str, Any]) -> None:
    assert set(compose["services"]) == SERVICES


@pytest.mark.parametrize("name", sorted(WAVEFARM_SERVICES))
def test_every_command_is_a_real_cli_subcommand(compose: dict[str, Any], name: str) -> None:
    command = compose["services"][name]["command"]
    assert command[0] == "wavefarm"
    args = build_parser().parse_args(command[1:])  # exits (fails the test) on anything unknown
    assert callable(args.handler)


def test_dockerfile_default_command_is_a_real_cli_subcommand() -> None:
    dockerfile = (REPO / "Dockerfile").read_text()
    cmd = re.search(r"^CMD (\[.*\])$", dockerfile, re.M)
    assert cmd is not None
    argv = yaml.safe_load(cmd.group(1))
    assert argv[0] == "wavefarm" and build_parser().parse_args(argv[1:]).command == "serve"
    assert "pip install" in dockerfile and "USER " in dockerfile


def wavefarm_variables(compose: dict[str, Any]) -> dict[str, str]:
    """Every WAVEFARM_* name compose sets or interpolates anywhere, with its value (if set)."""
    found: dict[str, str] = {}
    for service in compose["services"].values():
        for key, value in (service.get("environment") or {}).items():
            if key.startswith("WAVEFARM_"):
                found[key] = interpolate(str(value))
    for name in INTERPOLATION.findall((REPO / "docker-compose.yml").read_text()):
        if name[0].startswith("WAVEFARM_"):
            found.setdefault(name[0], "")
    return found


def test_every_wavefarm_variable_is_a_setting_and_validates(compose: dict[str, Any]) -> None:
    variables = wavefarm_variables(compose)
    assert "WAVEFARM_DATABASE_URL" in variables and "WAVEFARM_API_TOKEN" in variables
    fields = {f"WAVEFARM_{name.upper()}" for name in Settings.model_fields}
    assert set(variables) <= fields, f"not settings: {sorted(set(variables) - fields)}"
    for service in WAVEFARM_SERVICES:
        env = compose["services"][service].get("environment") or {}
        Settings(**{k.removeprefix("WAVEFARM_").lower(): interpolate(str(v))
                    for k, v in env.items() if k.startswith("WAVEFARM_")})


def test_services_share_state_and_wait_for_the_migration(compose: dict[str, Any]) -> None:
    services = compose["services"]
    urls = {services[name]["environment"]["WAVEFARM_DATABASE_URL"] for name in WAVEFARM_SERVICES}
    assert len(urls) == 1 and "@postgres:" in urls.pop()
    for name in WAVEFARM_SERVICES - {"migrate"}:
        assert services[name]["depends_on"]["migrate"]["condition"] == "service_completed_successfully"
        assert "artifacts:/data" in services[name]["volumes"]
    assert services["migrate"]["restart"] == "no"


def test_the_broker_is_rabbitmq_that_lets_a_job_run_as_long_as_the_visibility_timeout(
        compose: dict[str, Any]) -> None:
    from app.broker.queues import is_amqp

    services = compose["services"]
    urls = {interpolate(services[name]["environment"]["WAVEFARM_BROKER_URL"]) for name in WAVEFARM_SERVICES}
    assert len(urls) == 1 and is_amqp(url := urls.pop()) and "@broker:5672" in url
    broker = services["broker"]
    assert broker["image"].startswith("rabbitmq:") and "/var/lib/rabbitmq" in broker["volumes"][0]
    erl_args = broker["environment"]["RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS"].split()
    timeout_ms = int(erl_args[erl_args.index("consumer_timeout") + 1])
    assert timeout_ms >= Settings().visibility_timeout_s * 1000  # a long job keeps its channel


def test_redis_roles_results_never_evict_feature_store_is_an_lru_cache(compose: dict[str, Any]) -> None:
    results = compose["services"]["results"]["command"]
    assert results[results.index("--maxmemory-policy") + 1] == "noeviction"
    features = compose["services"]["features"]["command"]
    assert "--maxmemory" in features
    assert features[features.index("--maxmemory-policy") + 1].endswith("-lru")


def gpu_services(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {name: s for name, s in compose["services"].items() if name.startswith("gpu-worker-")}


def test_each_gpu_worker_service_pins_its_own_gpu_under_a_fixed_hostname(compose: dict[str, Any]) -> None:
    """One service per GPU: a device id each, a hostname each (its node name and own queue survive a
    re-created container), the same worker command."""
    gpus = gpu_services(compose)
    assert list(gpus) == [f"gpu-worker-{n}" for n in range(len(gpus))]
    for n, (name, gpu) in enumerate(gpus.items()):
        devices = gpu["deploy"]["resources"]["reservations"]["devices"]
        assert devices == [{"driver": "nvidia", "device_ids": [str(n)], "capabilities": ["gpu"]}], name
        assert gpu["hostname"] == f"gpu-{n}"
        assert gpu["environment"]["WAVEFARM_DEVICE"] == "cuda"
        assert gpu["command"][:2] == ["wavefarm", "gpu-worker"] and "--hostname" not in gpu["command"]


def test_cpu_workers_scale_with_docker_compose_scale(compose: dict[str, Any]) -> None:
    """`--scale cpu-worker=3` needs replicas that clash on nothing: no fixed container name, hostname or
    published port (each replica's node name comes from its own hostname)."""
    cpu = compose["services"]["cpu-worker"]
    assert not {"container_name", "hostname", "ports"} & set(cpu)
    assert "--hostname" not in cpu["command"]


def test_flower_basic_auth_comes_from_the_environment(compose: dict[str, Any]) -> None:
    flower = compose["services"]["flower"]
    assert flower["environment"]["FLOWER_BASIC_AUTH"].startswith("${FLOWER_BASIC_AUTH:?")
    assert not any("auth" in part for part in flower["command"])  # never on a command line


def test_cli_has_every_documented_command() -> None:
    assert set(subcommands()) >= {"serve", "cpu-worker", "gpu-worker", "flower", "submit", "status", "cancel",
                                  "voices", "db", "db upgrade", "demo"}


def test_prometheus_mounts_the_deploy_rules_and_scrapes_the_api_and_every_gpu_worker(
        compose: dict[str, Any]) -> None:
    services = compose["services"]
    prometheus = services["prometheus"]
    mount = next(v for v in prometheus["volumes"] if v.startswith("./deploy/prometheus:"))
    inside = mount.split(":")[1]
    config_flag = next(a for a in prometheus["command"] if a.startswith("--config.file="))
    config_path = config_flag.split("=", 1)[1]
    assert config_path.startswith(inside + "/")
    config = yaml.safe_load((REPO / "deploy/prometheus" / Path(config_path).name).read_text())
    for rule_file in config["rule_files"]:
        assert rule_file.startswith(inside + "/")
        assert (REPO / "deploy/prometheus" / Path(rule_file).name).is_file()
    targets = {job["job_name"]: [t for c in job["static_configs"] for t in c["targets"]]
               for job in config["scrape_configs"]}
    api_port = services["api"]["command"][services["api"]["command"].index("--port") + 1]
    assert targets["wavefarm-api"] == [f"api:{api_port}"]
    gpu = {name: s for name, s in services.items() if name.startswith("gpu-worker")}
    expected = {f"{name}:{s['command'][s['command'].index('--metrics-port') + 1]}" for name, s in gpu.items()}
    assert set(targets["wavefarm-gpu-worker"]) == expected


def test_grafana_provisions_the_dashboard_on_the_compose_prometheus(compose: dict[str, Any]) -> None:
    grafana = compose["services"]["grafana"]
    volumes = {v.split(":")[0]: v.split(":")[1] for v in grafana["volumes"]}
    dashboard_dir = yaml.safe_load((REPO / "deploy/grafana/provisioning/dashboards/wavefarm.yml").read_text())
    path = dashboard_dir["providers"][0]["options"]["path"]
    assert volumes["./deploy/grafana/wavefarm.json"] == f"{path}/wavefarm.json"
    assert volumes["./deploy/grafana/provisioning"] == "/etc/grafana/provisioning"
    source = yaml.safe_load((REPO / "deploy/grafana/provisioning/datasources/prometheus.yml").read_text())
    assert source["datasources"][0]["url"] == "http://prometheus:9090"
    assert "9090:9090" in compose["services"]["prometheus"]["ports"]
