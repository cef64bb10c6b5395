"""The compose file for Apache Kafka cannot run here (no Docker engine): check it is consistent."""

from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from nodeshare.cli import app

COMPOSE = Path(__file__).parents[2] / "deploy" / "docker-compose.yml"
NEEDED = {"kafka", "topics", "worker", "ledger-sink", "archive-sink"}


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def test_every_service_the_pipeline_needs_is_there(compose):
    assert set(compose["services"]) >= NEEDED


def test_kafka_runs_in_kraft_mode(compose):
    env = compose["services"]["kafka"]["environment"]
    assert "controller" in env["KAFKA_PROCESS_ROLES"] and "KAFKA_ZOOKEEPER_CONNECT" not in env
    assert "healthcheck" in compose["services"]["kafka"]


def test_nodeshare_services_use_real_commands_and_reach_kafka(compose):
    runner = CliRunner()
    for name, svc in compose["services"].items():
        if name == "kafka":
            continue
        cmd = svc["command"]
        assert cmd[0] == "nodeshare"
        words = [w for w in cmd[1:] if not w.startswith("-")][:2]
        result = runner.invoke(app, [*words, "--help"])
        assert result.exit_code == 0, f"{name}: `nodeshare {' '.join(words)}` is not a command"
        for flag in (w for w in cmd[1:] if w.startswith("--")):
            assert flag in result.output, f"{name}: {flag} is not an option of {words}"
        assert svc["environment"]["NODESHARE_BOOTSTRAP"] == "kafka:9092"


def test_topics_are_created_before_the_pipeline_starts(compose):
    for name in ("worker", "ledger-sink", "archive-sink"):
        assert compose["services"][name]["depends_on"]["topics"]["condition"] == "service_completed_successfully"


def test_grafana_dashboard_queries_only_metrics_the_code_exports():
    import json
    import re

    from prometheus_client.metrics import MetricWrapperBase

    import nodeshare.runtime.metrics as m

    families = {v._name for v in vars(m).values() if isinstance(v, MetricWrapperBase)}
    families |= {name for name, _ in m.AUDIT_METRICS}  # written by `nodeshare audit --metrics-file`
    families |= {"nodeshare_agent_follower_up", "nodeshare_agent_follower_connected",
                 "nodeshare_agent_follower_retries", "nodeshare_fold_partitions_refused"}  # defined where they are set
    dashboard = json.loads((COMPOSE.parent / "grafana-dashboard.json").read_text())
    used = {re.sub(r"_(total|bucket|count|sum)$", "", name) for p in dashboard["panels"] for t in p["targets"]
            for name in re.findall(r"nodeshare_[a-z_]+", t["expr"])}
    assert used == families  # nothing queried that is not exported, and a panel for every metric


SYSTEMD = COMPOSE.parent / "systemd"


def _unit(path: Path) -> dict[str, str]:
    keys: dict[str, str] = {}
    for line in path.read_text().splitlines():
        if "=" in line and not line.startswith(("#", "[")):
            key, _, value = line.partition("=")
            keys[key.strip()] = value.strip()
    return keys


def test_systemd_units_run_real_commands_with_real_options():
    """HPC nodes run services under systemd: each unit's ExecStart must be a nodeshare command with
    options it has (a renamed option would leave a site's nodes without agents)."""
    runner = CliRunner()
    units = sorted(SYSTEMD.glob("*.service"))
    assert {u.stem for u in units} >= {"nodeshare-agent", "nodeshare-worker", "nodeshare-ledger-sink",
                                       "nodeshare-archive-sink", "nodeshare-slurm-source", "nodeshare-slurm-scheduler"}
    for unit in units:
        keys = _unit(unit)
        cmd = keys["ExecStart"].split()
        assert cmd[0].endswith("/bin/nodeshare"), unit.name
        words = [w for w in cmd[1:] if not w.startswith(("-", "/", "$"))][:2]  # $VAR: opt-in flags (drop-ins)
        result = runner.invoke(app, [*words, "--help"])
        assert result.exit_code == 0, f"{unit.name}: `nodeshare {' '.join(words)}` is not a command"
        for flag in (w for w in cmd[1:] if w.startswith("--")):
            assert flag in result.output, f"{unit.name}: {flag} is not an option of {words}"
        assert keys["EnvironmentFile"] == "/etc/nodeshare/nodeshare.env" and keys["Restart"] == "on-failure"
    # the agent's watchdog must outlive a stopped agent to undo what it could not
    assert _unit(SYSTEMD / "nodeshare-agent.service")["KillMode"] == "process"
    assert "NODESHARE_BOOTSTRAP=" in (SYSTEMD / "nodeshare.env.example").read_text()
