"""The stream worker speaks to the broker with the same security settings as every other client.

Operators configure Kafka security once, in librdkafka's terms (``Settings.kafka``: what the
confluent-kafka producers and sinks take as they are). faust's client (aiokafka) needs them as
an ``ssl.SSLContext`` and credentials; ``faust_credentials`` translates, and refuses what it
cannot translate with an error naming the key, rather than connecting in plain text.
"""

from __future__ import annotations

import ssl
from collections.abc import Mapping
from pathlib import Path

import faust
from faust.types.auth import CredentialsT

#: librdkafka keys this translation understands (anything else under ssl.* or sasl.* is refused).
SSL_KEYS = frozenset({"ssl.ca.location", "ssl.certificate.location", "ssl.key.location", "ssl.key.password",
                      "enable.ssl.certificate.verification", "ssl.endpoint.identification.algorithm"})
SASL_KEYS = frozenset({"sasl.mechanism", "sasl.mechanisms", "sasl.username", "sasl.password"})
SASL_MECHANISMS = ("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512")
PROTOCOLS = ("PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL")


class SecurityConfigError(ValueError):
    """A Kafka security setting the stream worker cannot honour."""


def ssl_context(kafka: Mapping[str, str]) -> ssl.SSLContext:
    """A client TLS context from librdkafka's ssl.* settings: CA file (default: the system's),
    optional client certificate and key, verification and host-name checks (on by default)."""
    if ("ssl.certificate.location" in kafka) != ("ssl.key.location" in kafka):
        raise SecurityConfigError("ssl.certificate.location and ssl.key.location go together")
    for key in ("ssl.ca.location", "ssl.certificate.location", "ssl.key.location"):
        if key in kafka and not Path(kafka[key]).is_file():
            raise SecurityConfigError(f"{key}: no such file {kafka[key]!r}")
    try:
        ctx = ssl.create_default_context(cafile=kafka.get("ssl.ca.location"))
        if "ssl.certificate.location" in kafka:
            ctx.load_cert_chain(kafka["ssl.certificate.location"], kafka["ssl.key.location"],
                                password=kafka.get("ssl.key.password"))
    except OSError as exc:
        raise SecurityConfigError(f"{exc.filename or 'a TLS file'}: {exc.strerror or exc}") from None
    except ssl.SSLError as exc:
        raise SecurityConfigError(f"TLS files unusable: {exc}") from None
    if kafka.get("ssl.endpoint.identification.algorithm", "https").lower() == "none":
        ctx.check_hostname = False
    if kafka.get("enable.ssl.certificate.verification", "true").lower() == "false":
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    return ctx


def faust_credentials(kafka: Mapping[str, str]) -> CredentialsT | None:
    """faust's broker credentials for librdkafka-style settings; None for plain text."""
    protocol = kafka.get("security.protocol", "PLAINTEXT").upper()
    if protocol not in PROTOCOLS:
        raise SecurityConfigError(f"security.protocol {protocol!r}: expected one of {', '.join(PROTOCOLS)}")
    unknown = sorted(k for k in kafka if k.startswith(("ssl.", "sasl.")) and k not in SSL_KEYS | SASL_KEYS)
    if unknown:
        raise SecurityConfigError(f"{unknown[0]}: not supported by the stream worker (supported: "
                                  f"{', '.join(sorted(SSL_KEYS | SASL_KEYS))})")
    uses_tls, uses_sasl = protocol in ("SSL", "SASL_SSL"), protocol.startswith("SASL")
    stray = sorted(k for k in kafka if (k in SSL_KEYS and not uses_tls) or (k in SASL_KEYS and not uses_sasl))
    if stray:  # e.g. a CA file with security.protocol PLAINTEXT: the operator meant TLS
        raise SecurityConfigError(f"{stray[0]} is set but security.protocol is {protocol}")
    context = ssl_context(kafka) if uses_tls else None
    if not uses_sasl:
        return faust.SSLCredentials(context) if context else None
    mechanism = kafka.get("sasl.mechanism", kafka.get("sasl.mechanisms", "PLAIN")).upper()
    if mechanism not in SASL_MECHANISMS:
        raise SecurityConfigError(f"sasl.mechanism {mechanism!r}: the stream worker supports "
                                  f"{', '.join(SASL_MECHANISMS)}")
    for needed in ("sasl.username", "sasl.password"):
        if needed not in kafka:
            raise SecurityConfigError(f"{needed} is required with security.protocol {protocol}")
    return faust.SASLCredentials(username=kafka["sasl.username"], password=kafka["sasl.password"],
                                 mechanism=mechanism, ssl_context=context)
