"""The whole pipeline on a real broker: simulator -> faust worker -> ledger + archive -> audit."""

from __future__ import annotations

import base64
from collections import defaultdict
from pathlib import Path

import pytest
from topic_reading import read_until

from nodeshare.demo import DemoResult, from_events, run_demo
from nodeshare.producers.simulator import SimConfig, simulate
from nodeshare.runtime.config import Settings
from nodeshare.schemas import BY_NAME, DeadLetter, ShutterBatch, ShutterBlock, decode, decode_model
from nodeshare.sinks.analysis.report import co_runner_counts
from nodeshare.sinks.archive import ParquetArchive
from nodeshare.sinks.ledger import Ledger
from nodeshare.streams.core.blocks import block_rows
from nodeshare.streams.core.confidence import (
    DEFAULT_SHORT_MARGIN,
    degradation_interval,
    short_sample_margin,
    short_sample_widening,
)
from nodeshare.streams.core.degradation import DegradationSums, estimate
from nodeshare.streams.core.pricing import alone_time, billed_time, fair_charge, job_degradation

pytestmark = pytest.mark.integration

#: Bad input published before the simulation: (topic, key, value, what the DLQ must say)
BAD_INPUTS = [
    ("node.ipc", b"100000", b"\x00\x01 not json at all", "invalid JSON"),
    ("node.ipc", b"100001", b'{"kind": "shutter_block", "job_id": "100001"', "invalid JSON"),
    ("jobs.lifecycle", b"100002", b'{"kind": "job_event", "job_id": "100002", "state": "exploded"}', ""),
    ("node.ipc", b"100003", b'{"kind": "job_left_node", "event_id": "x", "source": "t", "event_time": '
                            b'"2026-01-01T00:00:00Z", "job_id": "999", "node": "n1", "blocks_sent": 0, '
                            b'"last_cycle": -1}', "does not match job_id"),
    ("node.power", b"node9", b'{"kind": "power_reading", "node": "node9"', "invalid JSON"),  # the power router's
]
CFG = SimConfig(nodes=5, jobs=10, seed=21)


@pytest.fixture(scope="module")
def run(kafka_bootstrap: str, tmp_path_factory: pytest.TempPathFactory) -> DemoResult:
    import uuid

    tag = uuid.uuid4().hex[:8]
    settings = Settings(bootstrap=kafka_bootstrap, topic_prefix=f"p{tag}.", app_id=f"nodeshare-p{tag}")
    out: Path = tmp_path_factory.mktemp("pipeline")
    return run_demo(settings, from_events(simulate(CFG)), out, timeout_s=120,
                    extra_inputs=[(t, k, v) for t, k, v, _ in BAD_INPUTS])


def test_every_ended_job_gets_exactly_one_charge(run: DemoResult) -> None:
    assert run.jobs_ended == CFG.jobs
    with Ledger(run.ledger, read_only=True) as ledger:
        rows = ledger.con.execute("SELECT job_id, count(*), max(revision) FROM charges GROUP BY job_id").fetchall()
    assert len(rows) == CFG.jobs
    assert all(n == 1 and rev == 0 for _, n, rev in rows)


def test_audit_finds_zero_mismatches(run: DemoResult) -> None:
    assert run.audit.ok, run.audit.as_dict()
    assert run.audit.charges_checked == CFG.jobs and run.audit.matches == CFG.jobs
    d = run.as_dict()
    assert {"jobs_ended", "charges", "audit_mismatches", "ledger", "archive"} <= set(d)
    assert d["audit_mismatches"] == 0


def test_charges_equal_the_pure_functions_on_the_archived_blocks(run: DemoResult) -> None:
    blocks: dict[str, list[ShutterBatch | ShutterBlock]] = defaultdict(list)
    paused: dict[str, list[int]] = defaultdict(list)
    alone: dict[str, list[float]] = defaultdict(list)
    for _, ev in ParquetArchive(run.archive).events(["node.ipc"]):
        try:
            rec = decode(BY_NAME["node.ipc"], ev.value)
        except ValueError:
            continue  # the injected garbage
        if ev.key != rec.job_id.encode():
            continue
        if isinstance(rec, ShutterBatch | ShutterBlock):
            blocks[rec.job_id].append(rec)
        else:
            paused[rec.job_id].append(rec.paused_us)
            alone[rec.job_id].append(rec.alone_us / 1e6)
    assert blocks, "no blocks archived"
    for c in run.charges:
        # the blocks' sums per sample length S (the adaptive schedule takes several), as the fold keeps them
        total, by_s = DegradationSums(), {}
        for b in blocks[c.job_id]:
            rows = block_rows(b)
            total.add_rows(rows, rows.valid, c.delta)
            by_s.setdefault(b.sample_us, DegradationSums()).add_rows(rows, rows.valid, c.delta)
        d = estimate(total, c.estimator, by_s if c.estimator == "mixed_s" else None)
        credit = max(paused[c.job_id]) / 1e6
        # the blocks measure D while the job shared a node; its time alone there was undisturbed
        billed = billed_time(c.run_time_s, credit)
        alone_s = alone_time(alone[c.job_id], len(c.nodes), billed)
        point = job_degradation(d.degradation, alone_s, billed)
        # priced at the point estimate, or at the upper end of D's interval (streams.core.confidence) when
        # the policy says so or the job has no estimate at all
        # an estimate from 3.2 ms samples that its longest S did not check has a wider interval, and
        # carries the short-sample margin (schema 10) in its price where its long samples were never
        # taken, unless evidence is missing
        m, s_us = c.short_margin or 0.0, c.short_sample_us or 1
        short, widen = (0.0, 0.0) if c.evidence_problems else (short_sample_margin(d, m, s_us),
                                                               short_sample_widening(d, m, s_us))
        interval = degradation_interval(d, c.confidence, c.prior_degradation_high, short=widen)
        no_evidence = interval.method == "prior" and d.status.value != "ok"
        applied = job_degradation(interval.high, alone_s, billed) if c.priced_at == "upper_bound" or no_evidence \
            else job_degradation(min(1.0, d.degradation + short), alone_s, billed)
        assert c.short_margin_applied == short and (c.short_margin, c.short_sample_us) == (DEFAULT_SHORT_MARGIN, 3200)
        amounts = fair_charge(c.rate_per_core_hour, c.cores, c.run_time_s, applied, pause_credit_s=credit)
        assert c.pause_credit_s == credit and c.alone_s == alone_s
        assert (c.degradation_shared, c.blocks_used, c.blocks_rejected) == (d.degradation, d.blocks_used,
                                                                            d.blocks_rejected)
        assert (c.degradation_point, c.degradation) == (point, applied)
        assert (c.degradation_low, c.degradation_high) == (job_degradation(interval.low, alone_s, billed),
                                                           job_degradation(interval.high, alone_s, billed))
        assert c.degradation_low <= point <= c.degradation_high
        assert (c.standard_price, c.price, c.dividend) == (amounts.standard_price, amounts.price, amounts.dividend)
    assert sum(c.dividend for c in run.charges) > 0  # co-located jobs were measured and discounted
    assert sum(c.pause_credit_s > 0 for c in run.charges) > 0  # and paused jobs were credited
    assert any(0 < c.alone_s < c.billed_time_s for c in run.charges)  # some ran alone part of the time


def test_archive_holds_every_input_event_once(run: DemoResult) -> None:
    assert run.events_archived == run.events_published + len(BAD_INPUTS)
    assert ParquetArchive(run.archive).count() == run.events_archived
    assert not list(run.archive.rglob("*.tmp"))


def test_the_ledger_counts_co_runners_as_the_archive_has_them(run: DemoResult) -> None:
    with Ledger(run.ledger, read_only=True) as ledger:
        counts = ledger.co_runner_counts()
        pairs = ledger.con.execute("SELECT count(*), sum(shutters) FROM degradation_by_pair").fetchone()
    assert counts and counts == co_runner_counts(run.archive)  # every window once, none twice
    assert pairs[0] > 0 and pairs[1] > 0


def test_malformed_input_lands_in_the_dead_letter_topic(run: DemoResult) -> None:
    wanted = {v for _, _, v, _ in BAD_INPUTS}

    def all_there(msgs: list) -> bool:
        got = {base64.b64decode(decode_model(DeadLetter, m.value()).value_b64) for m in msgs}
        return wanted <= got

    msgs = read_until(run.settings, "dlq", all_there)
    letters = {base64.b64decode(dl.value_b64): dl for dl in (decode_model(DeadLetter, m.value()) for m in msgs)}
    for topic, _, value, reason in BAD_INPUTS:
        dl = letters[value]
        assert dl.origin_topic == run.settings.topic(topic) and dl.origin_offset is not None
        assert reason in dl.reason
    # ... and the run went on: every job was still charged (first test), nothing else was rejected.
    assert len(letters) == len(BAD_INPUTS)


def test_replaying_the_archive_rebuilds_the_same_ledger(run: DemoResult, tmp_path: Path) -> None:
    """Replay into fresh topics, run a new worker and sinks on them: the same charges, bit for bit."""
    from replaying import replayed_ledger

    again = replayed_ledger(run, tmp_path)
    original = {(c.job_id, c.revision): c for c in run.charges}
    assert again.keys() == original.keys()
    assert all(again[k] == original[k] for k in original)  # offsets included: replay kept them


def test_replaying_into_topics_with_more_partitions_charges_every_job_the_same(run: DemoResult,
                                                                            tmp_path: Path) -> None:
    """A cluster that grew its topics: replayed records go where murmur2 puts their key among the new
    partitions (kept on their old numbers, every job off its key's partition was a 'misrouted' dead
    letter and uncharged); each charge is the same but for its offset ranges."""
    import uuid

    from nodeshare.demo import running_pipeline
    from nodeshare.producers.replay import replay

    tag = uuid.uuid4().hex[:8]
    fresh = run.settings.model_copy(update={"topic_prefix": f"g{tag}.", "app_id": f"nodeshare-g{tag}",
                                            "partitions": 2 * run.settings.partitions})
    with running_pipeline(fresh, tmp_path) as pipeline:
        report = replay(run.archive, fresh)
        pipeline.wait(len(run.charges), report.events, 120, lambda *_: None)
    with Ledger(pipeline.ledger_path, read_only=True) as rebuilt:
        again = {(c.job_id, c.revision): c for c in rebuilt.charges()}
    original = {(c.job_id, c.revision): c for c in run.charges}
    assert again.keys() == original.keys()
    assert all(again[k].model_dump(exclude={"event_range"}) == original[k].model_dump(exclude={"event_range"})
               for k in original)


def test_operators_see_the_dead_letters_and_the_topics(run: DemoResult) -> None:
    from nodeshare.sinks.analysis.inspect import describe_topics, read_dead_letters

    summary = read_dead_letters(run.settings, first=2, idle_s=2.0)
    assert summary.total == len(BAD_INPUTS) and summary.undecodable == 0
    assert sum(summary.by_reason.values()) == len(BAD_INPUTS) and len(summary.first) == 2
    assert summary.by_origin[run.settings.topic("node.ipc")] == 3
    topics = describe_topics(run.settings)
    assert all(t.exists for t in topics) and {t.partitions for t in topics} == {run.settings.partitions}
