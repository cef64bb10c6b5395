"""Schema evolution: records of an older version are read (and audited as they were made); a
newer, unknown version is refused with a reason that says so."""

from __future__ import annotations

import base64
import json
from pathlib import Path

from factories import POLICY, archive_records, batch, block, job_event, left

from nodeshare.schemas import (
    SCHEMA_VERSION,
    Charge,
    DeadLetter,
    JobEvent,
    JobLeftNode,
    JobState,
    NodeInventory,
    PowerDecision,
    decode_model,
    encode,
)
from nodeshare.schemas.events import ADDED_IN, carried
from nodeshare.sinks.audit import audit
from nodeshare.sinks.ledger import Ledger
from nodeshare.streams.core.accounting import Origin, PricingPolicy, fold_messages, process_message

RUN = [block(1.0, 1.4, 1.02, job="old", cycle=0), block(0.9, 1.3, 0.92, job="old", cycle=1),
       left("old", "n1", 2, 1), job_event("old", JobState.ENDED)]


def messages(version: int) -> list[tuple]:
    """RUN as the archive holds it (factories.archive_records): partition 0, offsets per topic."""
    offsets = {"node.ipc": 0, "jobs.lifecycle": 0}
    out = []
    for r in RUN:
        topic = "node.ipc" if r.kind != "job_event" else "jobs.lifecycle"
        out.append((Origin(topic, 0, offsets[topic]), b"old", as_version(r, version), 0.0))
        offsets[topic] += 1
    return out


def as_version(record: object, version: int, drop: tuple[str, ...] = ()) -> bytes:
    """The record as a writer of ``version`` wrote it: without ``drop`` and every field added later."""
    d = json.loads(encode(record))  # type: ignore[arg-type]
    d["schema_version"] = version
    later = {f for f, v in ADDED_IN.get(type(record), {}).items() if v > version}  # type: ignore[call-overload]
    for f in set(drop) | later:
        d.pop(f, None)
    return json.dumps(d).encode()


def test_this_build_writes_version_10_and_reads_1_to_10():
    assert SCHEMA_VERSION == 10
    assert ADDED_IN[PowerDecision] == {"node_caps": 6, "resumes": 6}
    assert ADDED_IN[NodeInventory] == {"usable": 5, "processors_only": 6}
    assert ADDED_IN[Charge] == {"degradation_corrected": 2, "estimator": 2, "degradation_shared": 4, "alone_s": 4,
                                "evidence_problems": 5, "node_summary": 5, "degradation_point": 6,
                                "degradation_low": 6, "degradation_high": 6, "interval_method": 6,
                                "interval_blocks": 6, "confidence": 6, "priced_at": 6, "prior_degradation_high": 6,
                                "levels": 6, "interval_margin_abs": 7, "interval_margin_rel": 7, "adjustment": 8,
                                "adjustment_credit": 8, "partition": 8, "billing_units": 8, "billing_weights": 8,
                                "short_margin": 10, "short_sample_us": 10, "short_margin_applied": 10}
    assert ADDED_IN[JobEvent] == {"partition": 8, "tres": 8, "nodes_requested": 9, "nodes_max": 9}
    assert ADDED_IN[DeadLetter] == {"rows": 3}
    assert ADDED_IN[JobLeftNode] == {"alone_us": 4}


def test_a_version_3_marker_has_no_alone_time_and_is_charged_as_then(tmp_path: Path):
    """Before version 4 a marker said nothing of the time the job ran alone: it reads as 0, so the
    shared-time estimate applies to the whole run as it did then, and a version-3 ledger row
    (without degradation_shared and alone_s) audits clean against the archive."""
    v3 = [(o, k, as_version(decode_model(type(r), v), 3, drop=("alone_us",) if r.kind == "job_left_node" else ()), t)
          for (o, k, v, t), r in zip(messages(SCHEMA_VERSION), RUN, strict=True)]
    [then], [now] = fold_messages(v3, POLICY), fold_messages(messages(SCHEMA_VERSION), POLICY)
    assert then.alone_s == now.alone_s == 0.0 and then.degradation == now.degradation_shared == now.degradation > 0
    archive, _, _ = archive_records(tmp_path, [*RUN[:2], (("node.ipc", b"old", v3[2][2])), RUN[3]])
    row = as_version(then, 3, drop=("degradation_shared", "alone_s"))
    old = tmp_path / "v3.duckdb"
    with Ledger(old) as ledger:
        ledger.append([(decode_model(Charge, row), row, 0, 0)])
    report = audit(archive, old, POLICY)
    assert report.ok and report.matches == 1, report.as_dict()


def test_version_1_input_is_read_and_charged_like_version_2():
    v1, v2 = fold_messages(messages(1), POLICY), fold_messages(messages(2), POLICY)
    assert v1 == v2 and len(v1) == 1


def test_version_2_blocks_are_charged_like_the_same_blocks_in_one_version_3_batch():
    """Schema evolution v2 -> v3: single blocks (each a batch of one) and one batch of the same
    blocks give the same charge; only the offsets it names differ (one message instead of two)."""
    v3 = [(Origin("node.ipc", 0, 0), b"old", encode(batch(*RUN[:2])), 0.0),
          (Origin("node.ipc", 0, 1), b"old", encode(RUN[2]), 0.0),
          (Origin("jobs.lifecycle", 0, 0), b"old", encode(RUN[3]), 0.0)]
    [old], [new] = fold_messages(messages(2), POLICY), fold_messages(v3, POLICY)
    assert new.model_dump(exclude={"event_range"}) == old.model_dump(exclude={"event_range"})
    assert new.blocks_used + new.blocks_rejected == 2 and new.nodes[0].blocks == 2


def test_a_newer_version_is_dead_lettered_naming_the_versions():
    v3 = as_version(RUN[0], SCHEMA_VERSION + 1)
    new_state, out, _ = process_message(None, Origin("node.ipc", 0, 9), b"old", v3, 0.0, POLICY)
    [dl] = [decode_model(DeadLetter, o.value) for o in out]
    assert new_state is None and dl.field == "schema_version"
    assert dl.reason == f"unknown schema version {SCHEMA_VERSION + 1}; this build reads versions 1..{SCHEMA_VERSION}"
    assert base64.b64decode(dl.value_b64) == v3  # the bytes are kept, to re-read once the reader is upgraded


def test_a_version_1_ledger_still_audits(tmp_path: Path):
    """A ledger written before version 2: its rows have no estimator and no corrected estimate.
    They read as POPPA's Alg. 4 (the only estimator then), and the audit recomputes them so."""
    archive, _, _ = archive_records(tmp_path, RUN)
    [made_then] = fold_messages(messages(1), PricingPolicy(rate_per_core_hour=POLICY.rate_per_core_hour,
                                                           estimator="poppa_alg4", price_at_bound=False))
    v1 = as_version(made_then, 1, drop=("degradation_corrected", "estimator"))
    row = decode_model(Charge, v1)
    assert (row.schema_version, row.estimator, row.degradation_corrected) == (1, "poppa_alg4", None)
    assert not carried(row, "degradation_corrected") and carried(row, "price")
    old = tmp_path / "v1.duckdb"
    with Ledger(old) as ledger:
        ledger.append([(row, v1, 0, 0)])
    report = audit(archive, old, POLICY)
    assert report.ok and report.matches == 1, report.as_dict()
    # ... and it is still checked: a version-1 row with an edited price does not pass
    edited = as_version(made_then.model_copy(update={"price": made_then.price * 0.5}), 1,
                        drop=("degradation_corrected", "estimator"))
    tampered = tmp_path / "v1-edited.duckdb"
    with Ledger(tampered) as ledger:
        ledger.append([(decode_model(Charge, edited), edited, 0, 0)])
    bad = audit(archive, tampered, POLICY)
    assert not bad.ok and any(m.field == "price" for m in bad.mismatches)


def test_version_6_adds_the_node_down_record_and_a_version_5_run_is_charged_as_then(tmp_path: Path):
    """Version 6 adds a record (``NodeDown`` on node.ipc), an estimate status (``node_lost``) and a
    charge's interval (test_confidence.py):
    a version-5 run, which has neither, folds to the charge it made then, and its version-5 ledger
    row audits clean; a node-down record of this build reads back as itself."""
    from nodeshare.schemas import EstimateStatus, NodeDown
    from nodeshare.schemas.catalog import NODE_IPC, adapter

    [then], [now] = fold_messages(messages(5), POLICY), fold_messages(messages(SCHEMA_VERSION), POLICY)
    assert then == now and now.estimate_status is not EstimateStatus.NODE_LOST
    archive, _, _ = archive_records(tmp_path, [(("node.ipc" if r.kind != "job_event" else "jobs.lifecycle"),
                                                b"old", as_version(r, 5)) for r in RUN])
    row = as_version(then, 5)
    old = tmp_path / "v5.duckdb"
    with Ledger(old) as ledger:
        ledger.append([(decode_model(Charge, row), row, 0, 0)])
    report = audit(archive, old, POLICY)
    assert report.ok and report.matches == 1, report.as_dict()
    down = NodeDown(event_id="d", source="slurm/c", event_time=RUN[-1].event_time, job_id="old", node="n1",
                    reason="NODE_FAIL")
    assert adapter(NODE_IPC).validate_json(encode(down)) == down and down.schema_version == SCHEMA_VERSION


def _power_log() -> list[PowerDecision]:
    from datetime import UTC, datetime, timedelta

    from nodeshare.schemas.catalog import CLUSTER_INVENTORY, JOBS_LIFECYCLE
    from nodeshare.schemas.events import JobEvent, NodeInventory, ProcessorSpec
    from nodeshare.streams.core.power.stream import PowerManager

    t0 = datetime(2026, 3, 1, tzinfo=UTC)
    pm = PowerManager(300.0)
    pm.apply(CLUSTER_INVENTORY.name, encode(NodeInventory(
        event_id="inv", source="t", event_time=t0, node="A", cores=48, sockets=4, llc_ways=20, mem_bandwidth_gbps=1.0,
        processors=tuple(ProcessorSpec(processor=i, min_watts=51.0, max_watts=120.0) for i in range(4)))))
    out: list[PowerDecision] = []
    for i, (job, state) in enumerate([("b", JobState.STARTED), ("c", JobState.STARTED), ("b", JobState.ENDED)]):
        t = t0 + timedelta(seconds=i + 1)
        out += pm.apply(JOBS_LIFECYCLE.name, encode(JobEvent(
            event_id=f"{job}-{state.value}", source="t", event_time=t, job_id=job, state=state, user="u", account="a",
            program="EP", cores=12, nodes=("A",), submit_time=t0, start_time=t0,
            end_time=t if state is JobState.ENDED else None)))
    return out


def test_a_version_5_power_decision_reads_without_node_caps_and_is_folded_in_arrival_order():
    """Version 6 added ``node_caps`` (each changed node's sequence and caps). A version-5 decision has
    none: the agent's fold applies it as it arrives (the rule before version 6); once the node holds
    a sequenced state, version-5 decisions (older: written before the upgrade) change nothing."""
    from nodeshare.schemas.events import carried
    from nodeshare.streams.core.power.caps import CapFold

    log = _power_log()
    seqs = [d.node_caps[0].sequence for d in log]
    assert seqs == sorted(set(seqs)) and all(len(d.node_caps) == 1 for d in log)  # strictly increasing
    v5 = [decode_model(PowerDecision, as_version(d, 5, drop=("node_caps", "resumes"))) for d in log]
    assert all(d.node_caps == () and not carried(d, "node_caps") for d in v5) and carried(log[0], "node_caps")
    old, new = CapFold("A"), CapFold("A")
    for d5, d6 in zip(v5, log, strict=True):
        old.apply(d5)
        new.apply(d6)
    assert old.caps() == new.caps() and old.sequence == 0 and new.sequence == seqs[-1]
    # after the upgrade: a late version-5 record (c's start, re-delivered) does not move a sequenced node
    assert new.apply(v5[1]) == {} and new.apply(v5[0]) == {}
    assert new.jobs() == {"c"}  # b released: forgotten


def test_a_version_6_power_decision_carries_the_changed_nodes_sequence_and_caps():
    first = _power_log()[0]
    d = json.loads(encode(first))
    assert d["schema_version"] == SCHEMA_VERSION
    # the sequence starts at the decision's time in microseconds (it grows across manager restarts)
    micros = int(first.event_time.timestamp()) * 1_000_000 + first.event_time.microsecond
    assert d["node_caps"] == [{"node": "A", "sequence": micros, "caps": [
        {"processor": 0, "job_id": "b", "cap_watts": d["plan"]["caps"][0]["cap_watts"]}]}]
