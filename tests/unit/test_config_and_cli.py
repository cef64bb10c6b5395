"""Settings precedence, clear configuration errors, and the CLI surface."""

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from nodeshare.cli import app
from nodeshare.runtime.config import Settings

runner = CliRunner()


def test_environment_overrides_defaults(monkeypatch):
    monkeypatch.setenv("NODESHARE_BOOTSTRAP", "kafka-1:9092,kafka-2:9092")
    monkeypatch.setenv("NODESHARE_RATE_PER_CORE_HOUR", "2.5")
    monkeypatch.setenv("NODESHARE_KAFKA", '{"security.protocol": "SASL_SSL", "sasl.password": "hunter2"}')
    s = Settings()
    assert s.bootstrap == "kafka-1:9092,kafka-2:9092" and s.policy().rate_per_core_hour == 2.5
    cfg = s.client_config()
    assert cfg["bootstrap.servers"] == s.bootstrap and cfg["security.protocol"] == "SASL_SSL"
    assert s.masked()["kafka"]["sasl.password"] == "***"
    assert "hunter2" not in json.dumps(s.masked())


def test_settings_survive_the_trip_to_a_child_process(monkeypatch):
    s = Settings(bootstrap="b:1", topic_prefix="x.", kafka={"ssl.ca.location": "/ca.pem"}, delta=0.1)
    for k, v in s.as_env().items():
        monkeypatch.setenv(k, v)
    assert Settings() == s


def test_a_bad_value_is_an_error_naming_the_variable(monkeypatch):
    monkeypatch.setenv("NODESHARE_DELTA", "-1")
    result = runner.invoke(app, ["topics", "list"])
    assert result.exit_code == 2 and "NODESHARE_DELTA" in result.output


def test_commands_that_need_a_broker_say_so(monkeypatch):
    monkeypatch.delenv("NODESHARE_BOOTSTRAP", raising=False)
    result = runner.invoke(app, ["topics", "create"])
    assert result.exit_code == 2 and "NODESHARE_BOOTSTRAP" in result.output


@pytest.mark.parametrize("command", [
    [], ["demo"], ["audit"], ["topics", "create"], ["topics", "list"], ["schemas", "export"], ["worker"],
    ["sink", "ledger"], ["sink", "archive"], ["simulate"], ["broker"], ["replay"], ["bench", "audit"],
    ["archive", "compact"], ["topics", "describe"], ["dlq", "show"], ["charges"], ["report-usage"],
    ["config", "show"],
])
def test_every_command_has_help(command):
    result = runner.invoke(app, [*command, "--help"])
    assert result.exit_code == 0 and "Usage" in result.output


def test_topics_list_prints_the_catalog():
    result = runner.invoke(app, ["topics", "list"])
    assert result.exit_code == 0
    for name in ("node.ipc", "jobs.lifecycle", "ledger.charges", "dlq", "decisions.power"):
        assert name in result.output


def test_audit_of_a_missing_ledger_is_a_clear_error(tmp_path):
    result = runner.invoke(app, ["audit", "--archive", str(tmp_path), "--ledger", str(tmp_path / "none.duckdb")])
    assert result.exit_code == 2 and "no ledger" in result.output


def test_configurable_rate_functions_are_exactly_the_implemented_ones():
    from typing import get_args

    from nodeshare.streams.core.pricing import RATE_FUNCTIONS

    assert set(get_args(Settings.model_fields["rate_function"].annotation)) == set(RATE_FUNCTIONS)
    assert Settings(rate_function="sop").policy().rate_function == "sop"


EXAMPLE = Path(__file__).parents[2] / "deploy" / "nodeshare.example.toml"


def test_the_example_file_documents_every_key_and_loads(monkeypatch):
    import tomllib

    monkeypatch.setenv("NODESHARE_CONFIG", str(EXAMPLE))
    s = Settings()
    import re

    text = EXAMPLE.read_text()
    # a setting a host sets only in some roles (the signing files) is documented commented out
    commented = set(re.findall(r"^# ([a-z_]+) = ", text, re.MULTILINE))
    assert commented == {"site_secret_file", "signing_key_file"}
    assert set(tomllib.loads(text)) | commented == set(Settings.model_fields)
    assert s.bootstrap.startswith("kafka-1") and s.kafka["security.protocol"] == "SASL_SSL"
    assert s.power_budget_watts == 28000.0 and s.policy().rate_function == "poppa_eq4"


def test_environment_wins_over_the_file_and_secrets_are_masked(monkeypatch):
    monkeypatch.setenv("NODESHARE_CONFIG", str(EXAMPLE))
    monkeypatch.setenv("NODESHARE_DELTA", "0.07")
    result = runner.invoke(app, ["config", "show", "--json"])
    assert result.exit_code == 0, result.output
    shown = json.loads(result.output)
    assert shown["delta"] == 0.07 and shown["period_ms"] == 200
    assert shown["kafka"]["sasl.password"] == "***" and "change-me" not in result.output


def test_config_option_and_unknown_keys(tmp_path):
    good = tmp_path / "good.toml"
    good.write_text('topic_prefix = "site."\nsample_us = 800\n')
    result = runner.invoke(app, ["--config", str(good), "config", "show", "--json"])
    assert result.exit_code == 0 and json.loads(result.output)["sample_us"] == 800
    bad = tmp_path / "bad.toml"
    bad.write_text("rate_per_core_hr = 2.0\n")
    result = runner.invoke(app, ["--config", str(bad), "config", "show"])
    assert result.exit_code == 2 and "rate_per_core_hr" in result.output
    worse = tmp_path / "worse.toml"
    worse.write_text("period_ms = 0\n")
    result = runner.invoke(app, ["--config", str(worse), "config", "show"])
    assert result.exit_code == 2 and "period_ms" in result.output and "worse.toml" in result.output
    result = runner.invoke(app, ["--config", str(tmp_path / "absent.toml"), "config", "show"])
    assert result.exit_code == 2 and "does not exist" in result.output
