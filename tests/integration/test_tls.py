"""The whole pipeline over TLS: producers, the faust worker, both sinks and the audit."""

from __future__ import annotations

from pathlib import Path

import pytest
from confluent_kafka.admin import AdminClient
from tls_proxy import TlsProxy, make_certificates

from nodeshare.config import Settings
from nodeshare.demo import run_demo
from nodeshare.deploy.broker import BundledBroker, free_port
from nodeshare.scenarios import ClusterChoice, source

pytestmark = pytest.mark.integration


def test_the_pipeline_runs_over_tls_and_refuses_plain_text(tmp_path: Path) -> None:
    certs = make_certificates(tmp_path / "tls")
    tls_port = free_port()
    with BundledBroker(advertised=f"127.0.0.1:{tls_port}", log_path=tmp_path / "tansu.log") as broker, \
            TlsProxy(tls_port, broker.port, certs) as proxy:
        tls = {"security.protocol": "SSL", "ssl.ca.location": str(certs.ca)}
        settings = Settings(bootstrap=broker.bootstrap, kafka=tls, app_id="nodeshare-tls")
        run = run_demo(settings, source(ClusterChoice(nodes=3, jobs=5, seed=3, mean_work_s=15.0, span_s=10.0)),
                       tmp_path / "run", timeout_s=120)
        assert run.jobs_ended == 5 and len(run.charges) == 5 and run.audit.ok
        assert proxy.connections >= 4  # producer, worker, sinks: every client came through TLS
        # a client without TLS gets nothing from the TLS port
        plain = AdminClient({"bootstrap.servers": broker.bootstrap, "socket.timeout.ms": 2000})
        with pytest.raises(Exception, match=r"Timed out|Transport|timed out|Failed"):
            plain.list_topics(timeout=3)
