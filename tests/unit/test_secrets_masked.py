"""Issue 41: `nodeshare config show` and the logs mask secrets by the setting's name, at any depth,
whatever property carries them: librdkafka's whole list of secret properties is tried."""

from __future__ import annotations

import json
import logging

import pytest
from typer.testing import CliRunner

from nodeshare.cli import app
from nodeshare.runtime.config import Settings, is_secret, masked_value
from nodeshare.runtime.logs import TextFormatter

runner = CliRunner()

#: Every librdkafka property whose value is a credential (librdkafka's CONFIGURATION.md, global
#: properties: the passwords and passphrases, private keys as text, OAUTHBEARER/OIDC secrets and the
#: free-form OAUTHBEARER config and extensions, which carry principals and tokens).
LIBRDKAFKA_SECRETS = (
    "sasl.password",
    "ssl.key.password",
    "ssl.key.pem",
    "ssl_key",
    "ssl.keystore.password",
    "sasl.oauthbearer.config",
    "sasl.oauthbearer.extensions",
    "sasl.oauthbearer.client.secret",
    "sasl.oauthbearer.client.credentials.client.secret",
    "sasl.oauthbearer.assertion.private.key.passphrase",
    "sasl.oauthbearer.assertion.private.key.pem",
    "sasl.kerberos.kinit.cmd",
)
#: Settings an operator needs to see to debug a connection (``*token*`` names are masked whole,
#: sasl.oauthbearer.token.endpoint.url included: a URL hidden costs less than a token shown).
PLAIN = {"security.protocol": "SASL_SSL", "sasl.mechanism": "OAUTHBEARER", "sasl.username": "agent-n1",
         "ssl.ca.location": "/etc/nodeshare/ca.crt", "client.id": "nodeshare", "sasl.oauthbearer.method": "oidc"}


def secret_of(name: str) -> str:
    return f"S3cr3t-{name.replace('.', '-')}"


@pytest.mark.parametrize("name", LIBRDKAFKA_SECRETS)
def test_every_librdkafka_secret_property_is_a_secret(name):
    assert is_secret(name)


def test_config_show_masks_every_secret_property_from_the_environment(monkeypatch):
    kafka = {**PLAIN, **{name: secret_of(name) for name in LIBRDKAFKA_SECRETS}}
    monkeypatch.setenv("NODESHARE_KAFKA", json.dumps(kafka))
    for args in (["config", "show", "--json"], ["config", "show"]):
        result = runner.invoke(app, args, terminal_width=400)
        assert result.exit_code == 0, result.output
        leaked = [name for name in LIBRDKAFKA_SECRETS if secret_of(name) in result.output]
        assert leaked == [], f"{args}: printed in clear: {leaked}"
    shown = json.loads(runner.invoke(app, ["config", "show", "--json"]).output)["kafka"]
    assert {k: shown[k] for k in PLAIN} == PLAIN  # what is not secret stays readable
    assert all(shown[name] == "***" for name in LIBRDKAFKA_SECRETS)


def test_the_issue_reproduction_prints_nothing_in_clear(monkeypatch):
    monkeypatch.setenv("NODESHARE_KAFKA", '{"sasl.oauthbearer.client.secret":"xyz","ssl.key.pem":"-----BEGIN"}')
    result = runner.invoke(app, ["config", "show", "--json"])
    assert result.exit_code == 0 and "xyz" not in result.output and "BEGIN" not in result.output


@pytest.mark.parametrize("name", ["db_password", "API_TOKEN", "s3.secret_access_key", "tls.pem", "jaas.config",
                                  "sasl.jaas.config", "Passphrase", "credentials"])
def test_secret_names_by_pattern(name):
    assert is_secret(name)


def test_masked_at_any_depth_and_inside_json_strings():
    value = {"outer": {"inner": [{"api_token": "t0k"}], "plain": "ok"},
             "as_json": json.dumps({"nested": {"ssl.key.password": "pw1"}, "list": [{"secret": "pw2"}]})}
    masked = masked_value(value)
    text = json.dumps(masked)
    assert "t0k" not in text and "pw1" not in text and "pw2" not in text and "ok" in text
    assert json.loads(masked["as_json"])["nested"]["ssl.key.password"] == "***"


def test_log_lines_mask_every_secret_value():
    s = Settings(kafka={name: secret_of(name) for name in LIBRDKAFKA_SECRETS})
    formatter = TextFormatter(s.secret_values())
    line = formatter.format(logging.LogRecord("x", logging.ERROR, __file__, 1, "config: %s", (s.kafka,), None))
    assert not [name for name in LIBRDKAFKA_SECRETS if secret_of(name) in line], line
