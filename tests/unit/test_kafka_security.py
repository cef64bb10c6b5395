"""The stream worker's Kafka security comes from the same librdkafka settings as every client."""

from __future__ import annotations

import ssl
from pathlib import Path

import faust
import pytest

from nodeshare.streams.worker.kafka_security import SecurityConfigError, faust_credentials


def test_plain_text_needs_no_credentials():
    assert faust_credentials({}) is None
    assert faust_credentials({"security.protocol": "plaintext", "acks": "all"}) is None


def test_tls_verifies_the_broker_by_default():
    creds = faust_credentials({"security.protocol": "SSL"})
    assert isinstance(creds, faust.SSLCredentials)
    assert creds.context.verify_mode is ssl.CERT_REQUIRED and creds.context.check_hostname


def test_tls_checks_can_be_relaxed_only_explicitly():
    creds = faust_credentials({"security.protocol": "SSL", "enable.ssl.certificate.verification": "false"})
    assert isinstance(creds, faust.SSLCredentials)
    assert creds.context.verify_mode is ssl.CERT_NONE and not creds.context.check_hostname
    no_host = faust_credentials({"security.protocol": "SSL", "ssl.endpoint.identification.algorithm": "none"})
    assert isinstance(no_host, faust.SSLCredentials) and not no_host.context.check_hostname
    assert no_host.context.verify_mode is ssl.CERT_REQUIRED


def test_sasl_over_tls_carries_mechanism_user_and_context():
    creds = faust_credentials({"security.protocol": "SASL_SSL", "sasl.mechanism": "SCRAM-SHA-512",
                               "sasl.username": "svc", "sasl.password": "s3cret"})
    assert isinstance(creds, faust.SASLCredentials)
    assert (creds.username, creds.password, creds.mechanism.value) == ("svc", "s3cret", "SCRAM-SHA-512")
    assert creds.ssl_context is not None
    plain = faust_credentials({"security.protocol": "SASL_PLAINTEXT", "sasl.mechanisms": "PLAIN",
                               "sasl.username": "svc", "sasl.password": "x"})
    assert isinstance(plain, faust.SASLCredentials) and plain.ssl_context is None


@pytest.mark.parametrize(("kafka", "message"), [
    ({"security.protocol": "TLS"}, "security.protocol 'TLS'"),
    ({"security.protocol": "SSL", "ssl.keystore.location": "k.p12"}, "ssl.keystore.location: not supported"),
    ({"ssl.ca.location": "/etc/ca.pem"}, "ssl.ca.location is set but security.protocol is PLAINTEXT"),
    ({"security.protocol": "SASL_SSL", "sasl.mechanism": "GSSAPI", "sasl.username": "u", "sasl.password": "p"},
     "supports PLAIN, SCRAM-SHA-256, SCRAM-SHA-512"),
    ({"security.protocol": "SASL_SSL", "sasl.username": "u"}, "sasl.password is required"),
    ({"security.protocol": "SSL", "ssl.certificate.location": "c.pem"}, "go together"),
    ({"security.protocol": "SSL", "ssl.ca.location": "/nonexistent/ca.pem"},
     "ssl.ca.location: no such file '/nonexistent/ca.pem'"),
])
def test_what_cannot_be_honoured_is_refused_naming_the_key(kafka, message):
    with pytest.raises(SecurityConfigError, match=message):
        faust_credentials(kafka)


def test_errors_never_show_a_password(tmp_path: Path):
    with pytest.raises(SecurityConfigError) as info:
        faust_credentials({"security.protocol": "SASL_SSL", "sasl.mechanism": "BOGUS", "sasl.username": "u",
                           "sasl.password": "hunter2"})
    assert "hunter2" not in str(info.value)


def test_the_worker_refuses_to_start_with_settings_it_cannot_honour(monkeypatch):
    from typer.testing import CliRunner

    from nodeshare.cli import app

    monkeypatch.setenv("NODESHARE_BOOTSTRAP", "127.0.0.1:1")
    monkeypatch.setenv("NODESHARE_KAFKA", '{"security.protocol": "SSL", "ssl.keystore.location": "k.p12"}')
    r = CliRunner().invoke(app, ["worker"])
    assert r.exit_code == 2 and "ssl.keystore.location: not supported" in r.output
