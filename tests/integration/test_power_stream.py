"""decisions.power through the real worker: inventory, power readings and lifecycle events in,
PPartition/PTune decisions out, in the order a scheduler must apply them."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
from power_events import scenario
from topic_reading import read_until
from typer.testing import CliRunner

from nodeshare.cli import app
from nodeshare.demo import running_pipeline
from nodeshare.producers.kafka_producer import EventProducer
from nodeshare.runtime.config import Settings
from nodeshare.schemas.catalog import DECISIONS_POWER, DECISIONS_POWER_NODES
from nodeshare.schemas.serde import decode

pytestmark = pytest.mark.integration


def test_power_decisions_flow_from_events_through_the_worker(kafka_bootstrap: str, tmp_path: Path) -> None:
    tag = uuid.uuid4().hex[:8]
    settings = Settings(bootstrap=kafka_bootstrap, topic_prefix=f"pw{tag}.", app_id=f"nodeshare-pw{tag}",
                        power_budget_watts=600.0)
    events = scenario()
    with running_pipeline(settings, tmp_path):
        with EventProducer(settings, client_id="power-test") as producer:
            for record in events:
                producer.send(record)

        def distinct(msgs: list) -> dict:
            return {decode(DECISIONS_POWER, m.value()).event_id: decode(DECISIONS_POWER, m.value()) for m in msgs}

        def complete(msgs: list) -> bool:  # every job started, and p1 released
            seen = {(d.job_id, d.action.value) for d in distinct(msgs).values()}
            return {("p1", "start"), ("p2", "start"), ("p3", "start"), ("p4", "start"), ("p1", "release")} <= seen

        try:
            got = read_until(settings, DECISIONS_POWER.name, complete, 90)
        except AssertionError:
            seen = read_until(settings, DECISIONS_POWER.name, lambda _: True, 10)
            raise AssertionError([(d.job_id, d.action.value, d.reason) for d in distinct(seen).values()]) from None
        decisions = list(distinct(sorted(got, key=lambda m: (m.partition(), m.offset()))).values())
        stated = {(s.node, s.sequence): s for d in decisions for s in d.node_caps}
        # ... and every node state a decision stated is on the compacted decisions.power.nodes too
        # (keyed by node), what an agent holds once decisions.power's retention deleted the decision
        nodes = read_until(settings, DECISIONS_POWER_NODES.name, lambda msgs: len(msgs) >= len(stated), 30)
    published = [decode(DECISIONS_POWER_NODES, m.value()) for m in nodes]
    assert stated and {(p.node, p.state.sequence): p.state for p in published} == stated
    assert all(m.key() == decode(DECISIONS_POWER_NODES, m.value()).node.encode() for m in nodes)
    # The worker's log has one order: lifecycle, power and inventory records as the router forwarded
    # them (jobs may arrive before the inventory: deferred, then started when processors appear).
    # Whatever that order, the bound holds at every decision.
    assert all(d.machine_allocated_watts <= d.machine_budget_watts == 600.0 for d in decisions)
    for d in decisions:
        for plan in (d.plan, *d.running_updates):
            if plan is not None:
                assert all(51.0 <= c.cap_watts <= 120.0 for c in plan.caps)
    # A scheduler's view: the example subscriber prints the same decisions.
    result = CliRunner().invoke(app, ["decisions", "tail", "--topic", "decisions.power", "--from-beginning",
                                      "--limit", str(len(decisions)), "--idle-exit", "20",
                                      "--bootstrap", kafka_bootstrap], env={"NODESHARE_TOPIC_PREFIX": f"pw{tag}."})
    assert result.exit_code == 0, result.output
    assert result.output.count(" start ") >= 3 and "release" in result.output and "machine=" in result.output

