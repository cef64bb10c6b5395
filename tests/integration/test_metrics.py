"""The worker's Prometheus endpoint, scraped while it processes a simulated run."""

from __future__ import annotations

import time
import urllib.request
import uuid
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from nodeshare.demo import publish, running_pipeline
from nodeshare.deploy.broker import free_port
from nodeshare.producers.simulator import SimConfig, simulate
from nodeshare.runtime.config import Settings

pytestmark = pytest.mark.integration


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(samples: dict, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def test_worker_metrics_move_during_a_run(kafka_bootstrap: str, tmp_path: Path) -> None:
    tag = uuid.uuid4().hex[:8]
    port = free_port()
    settings = Settings(bootstrap=kafka_bootstrap, topic_prefix=f"m{tag}.", app_id=f"nodeshare-m{tag}",
                        metrics_port=port)
    sim = simulate(SimConfig(nodes=4, jobs=8, seed=3))
    with running_pipeline(settings, tmp_path) as pipeline:
        deadline = time.monotonic() + 60
        while True:  # the endpoint comes up with the worker
            try:
                before = scrape(port)
                break
            except OSError:
                assert time.monotonic() < deadline, "no metrics endpoint on the worker"
                time.sleep(0.2)
        publish(settings, sim, lambda *_: None)
        pipeline.wait(len(sim.truth), len(sim.events), 120, lambda *_: None)
        after = scrape(port)
    ipc = settings.topic("node.ipc")
    assert value(after, "nodeshare_events_in_total", topic=ipc) > value(before, "nodeshare_events_in_total", topic=ipc)
    blocks = sum(value(after, "nodeshare_shutter_blocks_total", verdict=v) for v in ("accepted", "rejected", "refused"))
    assert blocks == sum(len(e.cycle) for e in sim.events if e.kind == "shutter_batch")
    assert value(after, "nodeshare_shutter_blocks_total", verdict="accepted") > 0
    assert value(after, "nodeshare_charges_emitted_total") >= len(sim.truth)
    assert value(after, "nodeshare_events_out_total", topic=settings.topic("ledger.charges")) >= len(sim.truth)
    assert value(after, "nodeshare_processing_seconds_count") >= len(sim.events) - len(
        [e for e in sim.events if e.kind in ("shutter_window", "node_inventory")])
    # every job charged: none awaits a node's stream (the gauge is there, at 0)
    assert ("nodeshare_jobs_awaiting_nodes", ()) in after and value(after, "nodeshare_jobs_awaiting_nodes") == 0
    assert value(after, "nodeshare_jobs_awaiting_nodes_oldest_seconds") == 0


def test_the_sinks_and_the_charge_fold_measure_their_lag_in_their_loops(settings: Settings, tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The lag is measured from the consumer loops themselves, on a real broker (a librdkafka
    statistics callback, served inside a rebalance, aborted the worker)."""
    import threading

    from prometheus_client import REGISTRY

    from nodeshare.deploy.topics import create_topics
    from nodeshare.runtime import metrics
    from nodeshare.runtime.consumer import run_in_thread
    from nodeshare.sinks.ledger import LedgerSink
    from nodeshare.streams.worker.fold_consumer import FoldConsumer, FoldThread

    monkeypatch.setattr(metrics, "LAG_INTERVAL_S", 0.2)
    create_topics(settings)
    stop = threading.Event()
    sink = run_in_thread(LedgerSink(settings, tmp_path / "ledger.duckdb"), stop, "ledger")
    failures: list[BaseException] = []
    fold = FoldThread(FoldConsumer(settings), stop, failures.append)
    fold.start()
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not all(
                REGISTRY.get_sample_value("nodeshare_consumer_lag_messages", {"consumer": c}) is not None
                for c in ("ledger", "accounting")):
            time.sleep(0.1)
    finally:
        stop.set()
        sink.join(30)
        fold.join(30)
    assert not failures and not sink.errors
    for consumer in ("ledger", "accounting"):
        assert REGISTRY.get_sample_value("nodeshare_consumer_lag_messages", {"consumer": consumer}) == 0
