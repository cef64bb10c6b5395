"""Issue 41: `topics create --principal` on a broker without ACLs (the bundled Tansu answers
CreateAcls in a way librdkafka aborts on) ends with a clear error, not a crashed CLI; the topics
are created all the same. On Apache Kafka with an authorizer the same command applies them."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from nodeshare.cli import app

pytestmark = pytest.mark.integration


def test_acls_on_a_broker_without_them_fail_cleanly(settings, monkeypatch):
    for key, value in settings.as_env().items():
        monkeypatch.setenv(key, value)
    result = CliRunner().invoke(app, ["topics", "create", "--principal", "agent=User:agent-n1"])
    assert "created" in result.output  # the topics first
    if result.exit_code == 0:  # a broker with an authorizer (NODESHARE_TEST_BOOTSTRAP, testcontainers)
        assert "ACLs created" in result.output
    else:
        assert result.exit_code == 1 and "has no ACLs" in result.output, result.output
