"""The whole pipeline over mutual TLS: producers, the faust worker, both sinks and the audit; and
the client key's password, a secret, in no log line and no file the run leaves behind."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from confluent_kafka.admin import AdminClient
from tls_proxy import TlsProxy, make_certificates

from nodeshare.demo import run_demo
from nodeshare.deploy.broker import BundledBroker, free_port
from nodeshare.runtime.config import Settings
from nodeshare.scenarios import ClusterChoice, source

pytestmark = pytest.mark.integration

KEY_PASSWORD = "kp-7Hx2-must-never-be-logged"


def _refused(config: dict[str, str]) -> None:
    client = AdminClient({**config, "socket.timeout.ms": 2000})
    with pytest.raises(Exception, match=r"Timed out|Transport|timed out|Failed"):
        client.list_topics(timeout=3)


def test_the_pipeline_runs_over_mutual_tls_and_keeps_the_key_password_out_of_every_file(tmp_path: Path) -> None:
    certs = make_certificates(tmp_path / "tls", client_key_password=KEY_PASSWORD)
    tls_port = free_port()
    with BundledBroker(advertised=f"127.0.0.1:{tls_port}", log_path=tmp_path / "tansu.log") as broker, \
            TlsProxy(tls_port, broker.port, certs, require_client_cert=True) as proxy:
        server_only = {"bootstrap.servers": broker.bootstrap, "security.protocol": "SSL",
                       "ssl.ca.location": str(certs.ca)}
        tls = {**server_only, "ssl.certificate.location": str(certs.client_cert),
               "ssl.key.location": str(certs.client_key), "ssl.key.password": KEY_PASSWORD}
        del tls["bootstrap.servers"]
        settings = Settings(bootstrap=broker.bootstrap, kafka=tls, app_id="nodeshare-tls", log_format="json")
        run = run_demo(settings, source(ClusterChoice(nodes=3, jobs=5, seed=3, mean_work_s=15.0, span_s=10.0)),
                       tmp_path / "run", timeout_s=120)
        assert run.jobs_ended == 5 and len(run.charges) == 5 and run.audit.ok
        assert proxy.connections >= 4  # producer, worker, sinks: every client came through TLS with its certificate
        _refused({"bootstrap.servers": broker.bootstrap})  # plain text gets nothing from the TLS port
        _refused(server_only)  # nor does TLS without a client certificate

    # Secrets never appear in logs or in the ledger: not in any file of the run (worker log,
    # ledger, archive, worker data). The in-process clients logged nothing to check here; the
    # masking itself is tested in tests/unit/test_logs.py.
    files = [p for p in (tmp_path / "run").rglob("*") if p.is_file()]
    assert any(p.name == "ledger.duckdb" for p in files) and any(p.suffix == ".parquet" for p in files)
    leaks = [p for p in files if KEY_PASSWORD.encode() in p.read_bytes()]
    assert not leaks, f"the key password is in {leaks}"
    # the worker logged in JSON lines, each with its component
    worker_log = (tmp_path / "run" / "worker.log").read_text().splitlines()
    records = [json.loads(line) for line in worker_log if line.strip()]  # every line, librdkafka's too
    assert records and all(r["component"] == "worker" and {"ts", "level", "logger", "msg"} <= r.keys()
                           for r in records)
    print(f"mTLS run: {proxy.connections} TLS sessions, {len(files)} files scanned, {len(records)} JSON worker "
          f"log lines; no key password anywhere")
