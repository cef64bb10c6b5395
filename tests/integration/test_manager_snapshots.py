"""Manager state past retention through the real worker (issue 43, s4): the power manager snapshots
its state to its compacted topic; a restarted worker rebuilds from the snapshot, folds only the log
after it, and decides the next events as if it had never stopped."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
from power_events import scenario
from topic_reading import read_until

from nodeshare.demo import running_pipeline
from nodeshare.producers.kafka_producer import EventProducer
from nodeshare.runtime.config import Settings
from nodeshare.schemas.catalog import DECISIONS_POWER, POWER_LOG, SNAPSHOTS
from nodeshare.schemas.serde import decode
from nodeshare.streams.core import snapshot
from nodeshare.streams.worker.cursor import latest_snapshot

pytestmark = pytest.mark.integration


def _decided(settings: Settings, want: set[tuple[str, str]]) -> dict:
    def distinct(msgs: list) -> dict:
        return {decode(DECISIONS_POWER, m.value()).event_id: decode(DECISIONS_POWER, m.value()) for m in msgs}

    got = read_until(settings, DECISIONS_POWER.name,
                     lambda msgs: want <= {(d.job_id, d.action.value) for d in distinct(msgs).values()}, 90)
    return distinct(got)


def test_a_restarted_worker_rebuilds_the_power_manager_from_its_snapshot(kafka_bootstrap: str, tmp_path: Path):
    tag = uuid.uuid4().hex[:8]
    settings = Settings(bootstrap=kafka_bootstrap, topic_prefix=f"sn{tag}.", app_id=f"nodeshare-sn{tag}",
                        power_budget_watts=600.0, snapshot_every_records=1)
    events = scenario()
    first, then = events[:-2], events[-2:]  # then: p1 ends, p4 starts where it ran
    with running_pipeline(settings, tmp_path / "one") as pipeline:
        with EventProducer(settings, client_id="snap-test") as producer:
            producer.send_all(first)
            producer.flush(30)
        _decided(settings, {("p1", "start"), ("p2", "start"), ("p3", "start")})
        pipeline.wait_for_decisions(60, lambda *_: None)
    raw = latest_snapshot(settings, settings.topic(SNAPSHOTS[POWER_LOG]))
    assert raw is not None
    offset, _, manager = snapshot.load(raw)
    assert offset > 0 and set(manager.machine.running) == {"p1", "p2", "p3"}
    with running_pipeline(settings, tmp_path / "two") as pipeline:
        with EventProducer(settings, client_id="snap-test") as producer:
            producer.send_all(then)
            producer.flush(30)
        decided = _decided(settings, {("p1", "release"), ("p4", "start")})
        pipeline.wait_for_decisions(60, lambda *_: None)
    log = (tmp_path / "two" / "worker.log").read_text()
    assert "power-manager: rebuilt its state from its snapshot at offset" in log, log[-3000:]
    assert all(d.machine_allocated_watts <= 600.0 for d in decided.values())
    [p4] = [d for d in decided.values() if (d.job_id, d.action.value) == ("p4", "start")]
    assert {c.node for c in p4.plan.caps} == {"pnode0000"}  # type: ignore[union-attr]
    # The node's sequence goes on from the rebuilt state (1 was p1's start), and its newest state is
    # p4's caps (carried by p4's start, or by p1's release when p4 was routed first and waited for it).
    states = [s for d in decided.values() for s in d.node_caps if s.node == "pnode0000"]
    newest = max(states, key=lambda s: s.sequence)
    assert newest.sequence >= 3 and {c.job_id for c in newest.caps} == {"p4"}
