"""Fault tests: what the pipeline survives, with the figures printed (pytest -s shows them)."""

from __future__ import annotations

import os
import random
import re
import shutil
import signal
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import duckdb
import pyarrow.parquet as pq
import pytest
from topic_reading import read_until

from nodeshare.demo import DemoError, publish, running_pipeline
from nodeshare.deploy.broker import BrokerError, BundledBroker
from nodeshare.deploy.local_s3 import s3rver_binary
from nodeshare.deploy.processes import start_nodeshare, start_worker, stop_process
from nodeshare.deploy.topics import create_topics
from nodeshare.producers.batching import FlushPolicy
from nodeshare.producers.kafka_producer import EventProducer
from nodeshare.producers.simulator import SimConfig, simulate
from nodeshare.runtime import metrics
from nodeshare.runtime.config import Settings
from nodeshare.schemas import TOPIC_OF_RECORD, Charge, JobEvent, JobLeftNode, ShutterBatch, ShutterBlock, encode
from nodeshare.schemas.catalog import Role
from nodeshare.schemas.serde import decode_model
from nodeshare.sinks.audit import audit
from nodeshare.sinks.ledger import Ledger
from nodeshare.streams.core.accounting import Origin, fold_messages
from nodeshare.streams.worker.copartition import kafka_partition

pytestmark = [pytest.mark.integration, pytest.mark.slow]

# Crash tests of the faust worker on the bundled broker (README, Reliability). The default run has
# five SIGKILLs and the two-worker takeover; the `extended` ones (one kill; kills during start-up)
# add about 2.5 minutes: `./deploy/local.sh test -m extended`.


def _reference_charges(sim, policy):
    """The uninterrupted answer: the reducer over the simulated events (offsets as published)."""
    offsets: dict[str, int] = {}
    msgs = []
    for rec in sim.events:
        if not isinstance(rec, ShutterBatch | ShutterBlock | JobLeftNode | JobEvent):
            continue
        topic = TOPIC_OF_RECORD[type(rec)].name
        offsets[topic] = offsets.get(topic, -1) + 1
        msgs.append((Origin(topic, 0, offsets[topic]), rec.job_id.encode(), encode(rec), 0.0))
    return {(c.job_id, c.revision): c for c in fold_messages(msgs, policy)}


def _settings(kafka_bootstrap: str, letter: str, partitions: int = 1) -> Settings:
    tag = uuid.uuid4().hex[:8]
    # One partition per topic by default, so the reference fold sees the same offsets as the broker.
    return Settings(bootstrap=kafka_bootstrap, topic_prefix=f"{letter}{tag}.", app_id=f"nodeshare-{letter}{tag}",
                    partitions=partitions)


def _check(pipeline, sim, settings, kills: int) -> int:
    """Charges right, none lost, none duplicated, audit clean; returns how many copies of charges
    the worker re-sent (a kill between a charge's publication and its input's commit)."""
    with Ledger(pipeline.ledger_path, read_only=True) as ledger:
        rows = ledger.charges()
    expected = _reference_charges(sim, settings.policy())
    got = {(c.job_id, c.revision): c for c in rows}
    lost, extra = expected.keys() - got.keys(), got.keys() - expected.keys()
    # With one partition the reference's offsets are the broker's; with more, offsets differ.
    skip = set() if settings.partitions == 1 else {"event_range", "revision_reason"}
    wrong = [k for k in expected.keys() & got.keys()
             if got[k].model_dump(exclude=skip) != expected[k].model_dump(exclude=skip)]
    print(f"{kills} SIGKILLs; {len(rows)} ledger rows for {len(expected)} expected charges; "
          f"lost {len(lost)}, unexpected {len(extra)}, different {len(wrong)}")
    for k in sorted(wrong)[:5]:  # what differs, so that a failure says where to look
        a, b = expected[k].model_dump(), got[k].model_dump()
        print(f"  {k}: " + "; ".join(f"{f}: expected {a[f]!r}, got {b[f]!r}" for f in a if a[f] != b[f]))
    assert not lost and not extra and not wrong and len(rows) == len(expected)
    report = audit(pipeline.archive_path, pipeline.ledger_path, settings.policy())
    assert report.ok, report.as_dict()
    published = read_until(settings, "ledger.charges", lambda m: len(m) >= len(expected), deadline_s=30)
    print(f"ledger.charges carried {len(published)} messages for {len(expected)} charges: "
          f"{len(published) - len(expected)} redelivered copies absorbed by the ledger's key")
    return len(published) - len(expected)


@pytest.mark.extended  # the five-kill test below covers it
def test_worker_killed_once_while_processing_loses_and_duplicates_nothing(kafka_bootstrap: str, tmp_path: Path) -> None:
    """One SIGKILL at a random moment while the worker is producing charges, then a restart."""
    settings = _settings(kafka_bootstrap, "o")
    sim = simulate(SimConfig(nodes=16, jobs=160, seed=31))
    with running_pipeline(settings, tmp_path) as pipeline:
        publish(settings, sim, lambda *_: None)
        while pipeline.ledger_sink.rows_inserted < 5:
            time.sleep(0.05)
        time.sleep(random.Random(7).uniform(0.0, 0.5))
        pipeline.worker.kill()
        pipeline.worker.wait()
        print(f"kill 1: {pipeline.ledger_sink.rows_inserted}/{len(sim.truth)} charges in the ledger")
        pipeline.worker = start_worker(settings, tmp_path / "worker", tmp_path / "worker.log")
        pipeline.wait(len(sim.truth), len(sim.events), 120, lambda *_: None)
        time.sleep(2)
    _check(pipeline, sim, settings, 1)


def test_worker_killed_five_times_while_processing_loses_and_duplicates_nothing(
        kafka_bootstrap: str, tmp_path: Path) -> None:
    """Each kill lands while the restarted worker is producing charges, at a random moment: the run
    is published in six parts, one before each kill (batched input is folded too fast for one)."""
    settings = _settings(kafka_bootstrap, "k")
    # small batches: more messages, so a kill lands among them rather than after them
    sim = simulate(SimConfig(nodes=12, jobs=100, seed=31, flush=FlushPolicy(max_blocks=4)))
    rng = random.Random(5)
    part = -(-len(sim.events) // 6)
    with running_pipeline(settings, tmp_path) as pipeline:
        for kill in range(1, 6):
            time.sleep(1.5)  # let the killed worker's last charges drain into the ledger first
            before = pipeline.ledger_sink.rows_inserted
            events = sim.events[(kill - 1) * part:kill * part]
            publish(settings, SimpleNamespace(events=events, truth=sim.truth), lambda *_: None)
            deadline = time.monotonic() + 60
            while pipeline.ledger_sink.rows_inserted == before and time.monotonic() < deadline:
                time.sleep(0.02)  # the (re)started worker is processing once new charges appear
            assert pipeline.ledger_sink.rows_inserted > before, f"kill {kill}: no charge of its part in 60 s"
            time.sleep(rng.uniform(0.0, 0.2))
            pipeline.worker.kill()  # SIGKILL: no cleanup, no commit, no changelog flush
            pipeline.worker.wait()
            print(f"kill {kill}: {pipeline.ledger_sink.rows_inserted}/{len(sim.truth)} charges in the ledger")
            pipeline.worker = start_worker(settings, tmp_path / "worker", tmp_path / "worker.log")
        publish(settings, SimpleNamespace(events=sim.events[5 * part:], truth=sim.truth), lambda *_: None)
        pipeline.wait(len(sim.truth), len(sim.events), 180, lambda *_: None)
        time.sleep(2)  # late redelivered copies reach the sink before counting
    resent = _check(pipeline, sim, settings, 5)
    # a kill landed after charges were published and before their input was committed: the
    # restarted worker re-sent them, and the ledger's key absorbed them (212 copies on 2026-11-24)
    assert resent > 0, "no kill landed between a charge's publication and its commit"


@pytest.mark.extended
def test_worker_killed_while_starting_up_loses_nothing(kafka_bootstrap: str, tmp_path: Path) -> None:
    settings = _settings(kafka_bootstrap, "s")
    sim = simulate(SimConfig(nodes=16, jobs=160, seed=31))
    with running_pipeline(settings, tmp_path) as pipeline:
        publish(settings, sim, lambda *_: None)
        while pipeline.ledger_sink.rows_inserted < 5:
            time.sleep(0.05)
        pipeline.worker.kill()
        pipeline.worker.wait()
        for delay in (2.0, 5.0, 9.0):  # during join, during recovery, just after
            pipeline.worker = start_worker(settings, tmp_path / "worker", tmp_path / "worker.log")
            time.sleep(delay)
            pipeline.worker.kill()
            pipeline.worker.wait()
        pipeline.worker = start_worker(settings, tmp_path / "worker", tmp_path / "worker.log")
        pipeline.wait(len(sim.truth), len(sim.events), 60, lambda *_: None)
    _check(pipeline, sim, settings, 4)


def _rebuilt_partitions(log: Path) -> set[int]:
    """The partitions a worker's log says it rebuilt job states for (streams.worker.fold_consumer)."""
    found = re.findall(r"rebuilt \d+ job states of partition (\d+)", log.read_text(errors="replace"))
    return {int(p) for p in found}


def _assigned(log: Path) -> str:
    """The charge fold's last partition assignment as the worker logged it (empty before the first)."""
    lines = [ln for ln in log.read_text(errors="replace").splitlines() if "accounting: assigned" in ln]
    return lines[-1] if lines else ""


def test_two_workers_one_killed_the_other_takes_over(kafka_bootstrap: str, tmp_path: Path) -> None:
    """Two workers share four partitions; one is SIGKILLed while charges flow and never restarted."""
    settings = _settings(kafka_bootstrap, "r", partitions=4)
    sim = simulate(SimConfig(nodes=12, jobs=100, seed=37))
    second_log = tmp_path / "worker2.log"
    with running_pipeline(settings, tmp_path) as pipeline:
        second = start_worker(settings, tmp_path / "worker2", second_log)
        try:
            deadline = time.monotonic() + 60
            while settings.topic("node.ipc") not in _assigned(second_log) and time.monotonic() < deadline:
                time.sleep(0.1)  # publish once the second worker holds input partitions
            # half the run first: the kill lands while the second half still has to flow through
            half = len(sim.events) // 2
            publish(settings, SimpleNamespace(events=sim.events[:half], truth=sim.truth), lambda *_: None)
            while pipeline.ledger_sink.rows_inserted < 20 and time.monotonic() < deadline + 60:
                time.sleep(0.05)
            owned, first_before = _rebuilt_partitions(second_log), _rebuilt_partitions(tmp_path / "worker.log")
            second.kill()
            second.wait()
            killed_at = pipeline.ledger_sink.rows_inserted
            publish(settings, SimpleNamespace(events=sim.events[half:], truth=sim.truth), lambda *_: None)
            pipeline.wait(len(sim.truth), len(sim.events), 120, lambda *_: None)
            deadline = time.monotonic() + 60  # the group notices the dead member after its session timeout
            while not owned <= _rebuilt_partitions(tmp_path / "worker.log") - first_before \
                    and time.monotonic() < deadline:
                time.sleep(0.2)
            time.sleep(2)
        finally:
            stop_process(second)
    taken_over = _rebuilt_partitions(tmp_path / "worker.log") - first_before
    print(f"second worker owned partitions {sorted(owned)} when killed at {killed_at}/{len(sim.truth)} charges; "
          f"the first had {sorted(first_before)} and rebuilt {sorted(taken_over)} after the kill")
    assert owned and owned <= taken_over, "the surviving worker did not take over the killed one's partitions"
    _check(pipeline, sim, settings, 1)


def _partitioned_reference(sim, settings: Settings) -> dict[tuple[str, int], Charge]:
    """The uninterrupted answer with the broker's own origins: each input record on the partition
    murmur2 gives its job id, at the offset publication order gives it there (one idempotent
    producer keeps each partition's order), folded in one go."""
    offsets: dict[tuple[str, int], int] = {}
    msgs = []
    for rec in sim.events:
        if not isinstance(rec, ShutterBatch | ShutterBlock | JobLeftNode | JobEvent):
            continue
        topic, key = TOPIC_OF_RECORD[type(rec)].name, rec.job_id.encode()
        where = (topic, kafka_partition(key, settings.partitions))
        offsets[where] = offsets.get(where, -1) + 1
        msgs.append((Origin(topic, where[1], offsets[where]), key, encode(rec), 0.0))
    return {(c.job_id, c.revision): c for c in fold_messages(msgs, settings.policy())}


def test_four_partitions_two_workers_one_killed_mid_fold_and_restarted_charge_each_revision_once(
        kafka_bootstrap: str, tmp_path: Path) -> None:
    """Four partitions per input topic, jobs on all of them. A worker folds the first quarter; a second
    worker joins and the second quarter flows (the group splits the partitions); the first is
    SIGKILLed while it folds its share; the third quarter flows while the second worker takes its
    partitions over (rebuilt at the offsets the killed one committed); the first is restarted, the
    group gives it partitions back (rebuilt again), and the last quarter follows. Every (job,
    revision) must be in the ledger exactly once, equal field for field, event ranges included, to
    one uninterrupted fold of the same records on the same partitions and offsets; every copy the
    workers published must be that row (no divergent copy); and the offline audit must find 0
    mismatches and nothing missing. Each partition is snapshotted every 20 messages, so the
    rebuilds fold a snapshot and the records after it (issue 44: rebuilds bounded by snapshots)."""
    settings = _settings(kafka_bootstrap, "m", partitions=4).model_copy(update={"fold_snapshot_every_records": 20})
    sim = simulate(SimConfig(nodes=12, jobs=90, seed=44, flush=FlushPolicy(max_blocks=4)))
    expected = _partitioned_reference(sim, settings)
    spread = {kafka_partition(job.encode(), 4) for job, _ in expected}
    assert spread == {0, 1, 2, 3}, f"the simulated jobs sit on partitions {sorted(spread)} only"
    divergent_before = metrics.DIVERGENT_CHARGES._value.get()
    quarter = -(-len(sim.events) // 4)
    parts = [SimpleNamespace(events=sim.events[i * quarter:(i + 1) * quarter], truth=sim.truth) for i in range(4)]
    first_log, second_log = tmp_path / "worker.log", tmp_path / "worker2.log"
    with running_pipeline(settings, tmp_path) as pipeline:
        second = None
        try:
            publish(settings, parts[0], lambda *_: None)
            deadline = time.monotonic() + 60
            while pipeline.ledger_sink.rows_inserted < 5 and time.monotonic() < deadline:
                time.sleep(0.05)
            second = start_worker(settings, tmp_path / "worker2", second_log)  # joins: a rebalance mid-fold
            while settings.topic("node.ipc") not in _assigned(second_log) and time.monotonic() < deadline + 60:
                time.sleep(0.1)
            assert settings.topic("node.ipc") in _assigned(second_log), "the second worker was never assigned"
            before = pipeline.ledger_sink.rows_inserted
            publish(settings, parts[1], lambda *_: None)
            while pipeline.ledger_sink.rows_inserted == before and time.monotonic() < deadline + 120:
                time.sleep(0.02)  # both fold their shares of the second third now
            time.sleep(random.Random(44).uniform(0.0, 0.2))
            pipeline.worker.kill()  # SIGKILL mid-fold: no commit, no flush, no revoke
            pipeline.worker.wait()
            killed_at = pipeline.ledger_sink.rows_inserted
            held = {p for p in range(4) if f"{settings.topic('node.ipc')}[{p}]" in _assigned(second_log)}
            publish(settings, parts[2], lambda *_: None)  # the second worker alone, once the group drops the first
            deadline = time.monotonic() + 60
            all_four = [f"{settings.topic('node.ipc')}[{p}]" for p in range(4)]
            while time.monotonic() < deadline:  # after the session timeout: every partition to the survivor
                last = _assigned(second_log)
                if all(tp in last for tp in all_four):
                    break
                time.sleep(0.2)
            while _rebuilt_partitions(second_log) < {0, 1, 2, 3} and time.monotonic() < deadline:
                time.sleep(0.2)
            taken = _rebuilt_partitions(second_log) - held
            first_rebuilds = len(re.findall("rebuilt .* job states", first_log.read_text(errors="replace")))
            pipeline.worker = start_worker(settings, tmp_path / "worker", first_log)  # rejoins: partitions move back
            publish(settings, parts[3], lambda *_: None)
            pipeline.wait(len(sim.truth), len(sim.events), 180, lambda *_: None)
            deadline = time.monotonic() + 60  # the restarted worker rejoined and took partitions back
            while (len(re.findall("rebuilt .* job states", first_log.read_text(errors="replace"))) == first_rebuilds
                   and time.monotonic() < deadline):
                time.sleep(0.2)
            time.sleep(2)  # late re-sent copies reach the sink before counting
        finally:
            if second is not None:
                stop_process(second)
    restarted = re.findall("rebuilt .* job states", first_log.read_text(errors="replace"))[first_rebuilds:]
    print(f"SIGKILL at {killed_at}/{len(expected)} charges; the second worker held partitions {sorted(held)} "
          f"and took over {sorted(taken)}; the restarted first rebuilt {len(restarted)} partitions")
    assert 0 < killed_at < len(expected), "the kill did not land while charges were being made"
    assert held and taken == {0, 1, 2, 3} - held, "the second worker did not take over the killed one's partitions"
    assert restarted, "the restarted worker was given no partition back"
    rebuilds = re.findall("rebuilt .* job states .*", first_log.read_text(errors="replace") + second_log.read_text(
        errors="replace"))
    assert any("from snapshot" in line for line in rebuilds), rebuilds  # a rebuild read a snapshot, not offset 0

    with Ledger(pipeline.ledger_path, read_only=True) as ledger:
        rows = ledger.charges()
    got = {(c.job_id, c.revision): c for c in rows}
    lost, extra = sorted(expected.keys() - got.keys()), sorted(got.keys() - expected.keys())
    wrong = sorted(k for k in expected.keys() & got.keys() if got[k].model_dump() != expected[k].model_dump())
    assert len(rows) == len(got), "a (job, revision) has two ledger rows"
    assert not lost and not extra and not wrong, f"lost {lost[:5]}, unexpected {extra[:5]}, wrong {wrong[:5]}"
    published = read_until(settings, "ledger.charges", lambda m: len(m) >= len(expected), deadline_s=30)
    copies = [decode_model(Charge, m.value()) for m in published]
    want = {k: c.model_dump() for k, c in expected.items()}
    differing = [(c.job_id, c.revision) for c in copies if c.model_dump() != want.get((c.job_id, c.revision))]
    assert not differing, f"published copies that differ from the uninterrupted fold: {differing[:5]}"
    assert metrics.DIVERGENT_CHARGES._value.get() == divergent_before
    # the same charges as on one partition per topic, but for where their evidence was read
    single = _reference_charges(sim, settings.policy())
    where = {"event_range", "revision_reason"}
    assert {k: c.model_dump(exclude=where) for k, c in single.items()} == {
        k: c.model_dump(exclude=where) for k, c in got.items()}
    report = audit(pipeline.archive_path, pipeline.ledger_path, settings.policy())
    print(f"{len(published)} charge messages for {len(expected)} charges; audit: {report.as_dict()}")
    assert report.ok and not report.mismatches and not report.missing_in_ledger, report.as_dict()
    assert report.matches == len(expected), report.as_dict()


def _archived_rows(root: Path) -> int:
    """Events in the archive's visible files (from their footers; files appear whole, by rename)."""
    return sum(pq.read_metadata(f).num_rows for f in root.rglob("*.parquet"))


def _ledger_rows(path: Path) -> int:
    """Rows in the ledger, read between the sink's writes (it holds the file only while writing)."""
    try:
        with Ledger(path, read_only=True) as ledger:
            return len(ledger.charges())
    except (duckdb.IOException, duckdb.CatalogException, FileNotFoundError):
        return -1  # being written, or not created yet


def test_sinks_killed_mid_write_leave_no_partial_file_and_no_duplicate(kafka_bootstrap: str, tmp_path: Path) -> None:
    """Both sinks run as processes and are SIGKILLed together four times, each time while the archive
    sink has a Parquet file half written, then restarted on the same ledger and archive."""
    settings = _settings(kafka_bootstrap, "w")
    sim = simulate(SimConfig(nodes=16, jobs=160, seed=41))
    inputs = sum(1 for e in sim.events if TOPIC_OF_RECORD[type(e)].role is Role.INPUT)
    ledger_path, archive_path = tmp_path / "ledger.duckdb", tmp_path / "archive"
    create_topics(settings)
    worker = start_worker(settings, tmp_path / "worker", tmp_path / "worker.log")
    start = lambda: [start_nodeshare(settings, ["sink", k, f"--{k}", str(p)], tmp_path / f"{k}.log")  # noqa: E731
                     for k, p in (("ledger", ledger_path), ("archive", archive_path))]
    sinks = start()
    mid_write = 0
    try:
        for chunk in range(4):  # a quarter of the run before each kill, so that there is writing to interrupt
            with EventProducer(settings, client_id="nodeshare-simulator") as producer:
                producer.send_all(sim.events[chunk * len(sim.events) // 4:(chunk + 1) * len(sim.events) // 4])
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:  # kill while the archive sink has a file half written:
                if list(archive_path.rglob("*.tmp")):
                    os.kill(sinks[1].pid, signal.SIGSTOP)  # frozen, it cannot finish the file before the kill
                    if list(archive_path.rglob("*.tmp")):
                        break
                    os.kill(sinks[1].pid, signal.SIGCONT)  # it finished between the look and the stop
                time.sleep(0.001)
            mid_write += bool(list(archive_path.rglob("*.tmp")))
            for p in sinks:
                p.kill()
                p.wait()
            sinks = start()
        deadline = time.monotonic() + 120  # both sinks caught up: the charges, and every input event archived
        while time.monotonic() < deadline and (_ledger_rows(ledger_path) < len(sim.truth)
                                               or _archived_rows(archive_path) < inputs):
            time.sleep(0.5)
    finally:
        for p in sinks:
            stop_process(p)
        stop_process(worker)
    files = sorted(archive_path.rglob("*.parquet"))
    for f in files:
        pq.read_metadata(f)  # every file a reader can see is whole
    leftovers = list(archive_path.rglob("*.tmp"))  # each restarted sink removed what its killed one left
    total, distinct = duckdb.connect().execute(
        "SELECT count(*), count(DISTINCT (kafka_topic, partition, \"offset\")) "
        "FROM read_parquet(?, union_by_name = true)", [[str(f) for f in files]]).fetchone()
    print(f"4 SIGKILLs of both sinks, {mid_write} with a Parquet file half written (its .tmp is never read); "
          f"{len(files)} archive files, {total} events archived ({distinct} distinct) of {inputs} published, "
          f"{len(leftovers)} half-written files left")
    assert mid_write == 4, f"{mid_write} of 4 kills landed while a file was being written"
    assert not leftovers, leftovers
    assert total == distinct == inputs
    _check(SimpleNamespace(ledger_path=ledger_path, archive_path=archive_path), sim, settings, 4)


OUTAGE_S = 30.0


class _AckedOffsets(EventProducer):
    """The simulator's producer, keeping the (topic, partition, offset) of every acknowledgement: a
    broker that acknowledges two records at one offset has overwritten the first (docs/broker.md)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.acked: list[tuple[str, int, int]] = []

    def _on_delivery(self, err, msg) -> None:
        super()._on_delivery(err, msg)
        if err is None:
            with self._lock:
                self.acked.append((msg.topic(), msg.partition(), msg.offset()))

    def reused(self) -> dict[tuple[str, int], int]:
        """(topic, partition) -> how many of its offsets were acknowledged more than once."""
        seen: set[tuple[str, int, int]] = set()
        twice: dict[tuple[str, int], int] = {}
        for ack in self.acked:
            if ack in seen:
                twice[ack[:2]] = twice.get(ack[:2], 0) + 1
            seen.add(ack)
        return twice


@contextmanager
def _first_half_charged(broker: BundledBroker, tmp_path: Path, letter: str, seed: int) -> Iterator[tuple]:
    """The pipeline running on this broker, the simulator's first half acknowledged and 3 charged:
    (settings, sim, half, pipeline, producer), for a broker fault in the middle of a run."""
    settings = _settings(broker.bootstrap, letter)
    sim = simulate(SimConfig(nodes=8, jobs=60, seed=seed))
    half = len(sim.events) // 2
    with running_pipeline(settings, tmp_path) as pipeline, \
            _AckedOffsets(settings, client_id="nodeshare-simulator") as producer:
        producer.send_all(sim.events[:half])
        producer.flush()
        deadline = time.monotonic() + 120
        while pipeline.ledger_sink.rows_inserted < 3:
            assert time.monotonic() < deadline, "no charge of the first half"
            time.sleep(0.05)
        yield settings, sim, half, pipeline, producer


def test_broker_stopped_30s_mid_run_loses_nothing(tmp_path: Path) -> None:
    """The broker process is SIGSTOPped for 30 s while the simulator publishes and the worker and
    both sinks run; the producer buffers, everyone reconnects, and the charges are those of an
    uninterrupted run."""
    # a broker of its own: stopping the shared one would stall every other test
    with BundledBroker(log_path=tmp_path / "tansu.log") as broker:
        with _first_half_charged(broker, tmp_path, "b", 43) as (settings, sim, half, pipeline, producer):
            assert broker.pid is not None
            os.kill(broker.pid, signal.SIGSTOP)
            try:
                producer.send_all(sim.events[half:])  # into the producer's buffer: nothing is acknowledged
                time.sleep(OUTAGE_S)
                during = pipeline.ledger_sink.rows_inserted
            finally:
                os.kill(broker.pid, signal.SIGCONT)
            producer.flush(120)
            resumed = time.monotonic()
            pipeline.wait(len(sim.truth), len(sim.events), 180, lambda *_: None)
            caught_up = time.monotonic() - resumed
            time.sleep(2)
        print(f"broker stopped {OUTAGE_S:.0f} s with {during}/{len(sim.truth)} charges in; "
              f"{len(sim.events) - half} events buffered by the producer; caught up {caught_up:.1f} s after SIGCONT")
        assert producer.delivered == len(sim.events) and not producer.failed
        _check(pipeline, sim, settings, 0)


_NO_S3 = pytest.mark.skipif(shutil.which("npm") is None and not s3rver_binary(install=False).exists(),
                            reason="no npm to install s3rver with (deploy/local.sh test installs it when it can)")


@_NO_S3
def test_a_durable_broker_killed_and_restarted_mid_run_loses_nothing(tmp_path: Path) -> None:
    """Issue 39: the bundled broker on durable storage (``nodeshare broker --data``) is SIGKILLed
    mid-run, between the simulator's two halves, while the worker and both sinks run, and started
    again on the same storage: every topic and acknowledged record is there, and the charges are
    those of an uninterrupted run. The restarted broker forgets the groups' members: the sinks'
    refused commits are kept and land later (none left pending). (With the second half in flight
    at the kill the run is not right yet: docs/broker.md.)"""
    with BundledBroker(log_path=tmp_path / "tansu.log", data_dir=tmp_path / "data") as broker:
        with _first_half_charged(broker, tmp_path, "d", 47) as (settings, sim, half, pipeline, producer):
            before = broker.pid
            broker.kill_and_restart()
            assert broker.pid != before
            producer.send_all(sim.events[half:])
            producer.flush(120)
            try:
                pipeline.wait(len(sim.truth), len(sim.events), 240, lambda *_: None)
            except DemoError:
                _xfail_if_offsets_reused(producer)
                raise
            deadline = time.monotonic() + 30  # a refused commit is retried within COMMIT_RETRY_S
            while pipeline.ledger_sink.pending_offsets or pipeline.archive_sink.pending_offsets:
                assert time.monotonic() < deadline, (pipeline.ledger_sink.pending_offsets,
                                                     pipeline.archive_sink.pending_offsets)
                time.sleep(0.2)
        print(f"broker SIGKILLed and restarted with {half}/{len(sim.events)} events acknowledged")
        assert producer.delivered == len(sim.events) and not producer.failed
        restarted = sorted(p.parent.name for p in (Path(pipeline.archive_path) / "epochs").glob("*/p*.json"))
        _xfail_if_offsets_reused(producer)
        assert not restarted, f"the archive started a new epoch of {restarted} but no offset was acknowledged twice"
        _check(pipeline, sim, settings, 0)


def _xfail_if_offsets_reused(producer: _AckedOffsets) -> None:
    """Tansu 0.6.0's S3 engine hands out acknowledged offsets again after some SIGKILLs, even
    between acknowledged writes (2 fresh-clone CI runs in about 12; docs/broker.md): the broker's
    defect, which no consumer can repair. A consumer already past those offsets never sees the
    records written over them (a CI run of 2026-11-28 waited 240 s for 122 of them), and one that
    reads them again sees a second log (the archive starts an epoch). Shown by the acknowledgements
    themselves, it is an expected failure; anything else fails."""
    if reused := producer.reused():
        pytest.xfail(f"the broker acknowledged offsets twice after its SIGKILL: {reused} (docs/broker.md)")


def test_the_memory_broker_loses_its_topics_when_restarted(tmp_path: Path) -> None:
    """Why ``--data`` exists: the same restart in memory leaves no topic behind."""
    with BundledBroker(log_path=tmp_path / "tansu.log") as broker:
        settings = _settings(broker.bootstrap, "m")
        create_topics(settings)
        assert _topics(broker.bootstrap, settings)
        broker.kill_and_restart()
        assert not _topics(broker.bootstrap, settings)


@_NO_S3
def test_the_durable_broker_keeps_its_topics_and_its_directory_is_its_own(tmp_path: Path) -> None:
    with BundledBroker(log_path=tmp_path / "tansu.log", data_dir=tmp_path / "data") as broker:
        settings = _settings(broker.bootstrap, "k")
        create_topics(settings)
        names = _topics(broker.bootstrap, settings)
        broker.kill_and_restart()
        assert _topics(broker.bootstrap, settings) == names and names
        assert (tmp_path / "data").stat().st_mode & 0o777 == 0o700
        with pytest.raises(BrokerError, match="another broker uses"):
            BundledBroker(log_path=tmp_path / "second.log", data_dir=tmp_path / "data").start()
        with pytest.raises(BrokerError, match="is in use"):  # the port of a running broker
            BundledBroker(port=broker.port, log_path=tmp_path / "third.log").start()
        assert broker.alive()


def _topics(bootstrap: str, settings: Settings) -> set[str]:
    from confluent_kafka.admin import AdminClient

    admin = AdminClient({"bootstrap.servers": bootstrap})
    return {t for t in admin.list_topics(timeout=10).topics if t.startswith(settings.topic_prefix)}
