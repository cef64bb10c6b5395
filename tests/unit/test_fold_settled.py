"""Settled accounts (streams/worker/fold_settled.py, issue 42 item 6): a charged account leaves the
worker's memory and a late record of its job reads it back, with the outputs of a fold that kept it;
a settled account that cannot be read back usable dead-letters the record, never charges it from
nothing; a write the broker refuses keeps the account in memory. Under rebalances, crashes, zombies
and retention: tests/unit/test_fold_partitions_property.py, which evicts at every commit."""

from __future__ import annotations

import pytest
from unit.test_fold_partitions_property import IPC, LIFE, SETTINGS, SETTLED, Broker, Producer, records

from nodeshare.schemas import DeadLetter
from nodeshare.schemas.serde import decode_model
from nodeshare.streams.core import fold_snapshot
from nodeshare.streams.core.accounting import Origin
from nodeshare.streams.worker import fold_consumer, fold_settled
from nodeshare.streams.worker.fold_consumer import UNSETTLED, FoldConsumer

JOB_SEED = 11


class RefusingProducer(Producer):
    """Refuses every message to the settled topic (its delivery report carries an error)."""

    def flush(self, timeout: float = 30.0) -> int:
        for i, report in self.reports:
            if self.buffer[i][0] == SETTLED:
                report("Broker: Topic authorization failed", None)
        self.reports = [(i, r) for i, r in self.reports if self.buffer[i][0] != SETTLED]
        self.buffer = [m for m in self.buffer if m[0] != SETTLED]
        return super().flush(timeout)


def fold(monkeypatch, evict_after_s: float, producer: type[Producer] = Producer) -> tuple[FoldConsumer, Broker]:
    monkeypatch.setattr(fold_consumer, "EventProducer", lambda *a, **k: None)
    f = FoldConsumer(SETTINGS.model_copy(update={"fold_evict_after_s": evict_after_s}))
    broker = Broker(log={})
    f.producer = producer(broker)  # type: ignore[assignment]
    f.settled.read_fn = broker.settled
    f._partitions = {IPC: 1, LIFE: 1}
    f._owned = {(IPC, 0), (LIFE, 0)}
    return f, broker


def feed(f: FoldConsumer, msgs: list) -> list[tuple[str, bytes, bytes]]:
    """Apply ``msgs`` and make what they produced durable; returns it."""
    for m in msgs:
        f.apply(m)
    out = list(f.producer.buffer)  # type: ignore[attr-defined]
    f.producer.flush(30)
    return out


def job_messages() -> tuple[list, list]:
    """One job's records on partition 0 that charge it, and a copy of each of its lifecycle records
    coming late (new offsets): corrections, copies, a later run are all possible."""
    offsets = {IPC: 0, LIFE: 0}
    msgs = []
    for r in records(JOB_SEED, 3):
        msgs.append((Origin(r.topic, 0, offsets[r.topic]), r.key, r.value, 0.0))
        offsets[r.topic] += 1
    late = []
    for _, key, value, ts in [m for m in msgs if m[0].topic == LIFE]:
        late.append((Origin(LIFE, 0, offsets[LIFE]), key, value, ts))
        offsets[LIFE] += 1
    return msgs, late


def test_a_late_record_of_a_settled_job_reads_its_account_back_with_the_outputs_of_a_fold_that_kept_it(
        monkeypatch):
    msgs, late = job_messages()
    kept, _ = fold(monkeypatch, float("inf"))
    moved, broker = fold(monkeypatch, 0.0)
    assert feed(kept, msgs) == feed(moved, msgs)
    moved.evict()
    kept.evict()
    assert set(kept.states[0]) == {k for _, k, _, _ in msgs}  # inf: nothing ever leaves
    gone = set(moved.settled.index[0])
    assert gone and gone.isdisjoint(moved.states[0]) and gone | set(moved.states[0]) == set(kept.states[0])
    assert {k for t, k, _ in broker.durable if t == SETTLED} == {fold_snapshot.settled_key(0, k) for k in gone}
    assert feed(kept, late) == feed(moved, late)  # charges, copies refused, estimates: the same bytes
    assert broker.reads == len(gone & {k for _, k, _, _ in late})
    assert {k: a.model_dump() for k, a in moved.states[0].items()} == {
        k: a.model_dump() for k, a in kept.states[0].items() if k in moved.states[0]}


def test_a_settled_account_that_cannot_be_read_back_dead_letters_the_record_and_stays_settled(monkeypatch):
    msgs, late = job_messages()
    f, broker = fold(monkeypatch, 0.0)
    feed(f, msgs)
    f.evict()
    key, offset = next(iter(f.settled.index[0].items()))
    topic, k, value = broker.durable[[i for i, m in enumerate(broker.durable) if m[0] == SETTLED][offset]]
    broker.durable[broker.durable.index((topic, k, value))] = (topic, k, value[:-3] + b"bad")  # damaged on disk
    record = next(m for m in late if m[1] == key)
    out = feed(f, [record])
    [(t, _, dl)] = out
    letter = decode_model(DeadLetter, dl)
    assert t == "t.dlq" and "damaged settled account" in letter.reason and letter.origin_offset == record[0].offset
    assert key not in f.states[0] and f.settled.index[0][key] == offset  # never an empty account in its place
    assert fold_consumer.metrics.DEAD_LETTERS.labels(UNSETTLED)._value.get() >= 1


def test_a_settled_write_the_broker_refuses_keeps_the_accounts_in_memory_and_is_tried_again(monkeypatch, caplog):
    msgs, _ = job_messages()
    f, broker = fold(monkeypatch, 0.0, RefusingProducer)
    feed(f, msgs)
    before = set(f.states[0])
    assert f.settled.evict(f.producer, f.states, {0}, 1, f.snapshot_config, 1.0) == 0
    assert set(f.states[0]) == before and not f.settled.index.get(0) and f.settled.due
    assert "not written to t.accounting.settled" in caplog.text
    f.producer = Producer(broker)  # type: ignore[assignment]  # the broker takes them again
    assert f.settled.evict(f.producer, f.states, {0}, 1, f.snapshot_config, 1.0) > 0


def test_an_account_stays_until_it_has_been_settled_for_the_time_set(monkeypatch):
    msgs, _ = job_messages()
    f, _ = fold(monkeypatch, 300.0)
    feed(f, msgs)
    f.evict()
    assert not f.settled.index.get(0)
    now = fold_settled.time.monotonic()
    monkeypatch.setattr(fold_settled.time, "monotonic", lambda: now + 301)
    f.evict()
    assert f.settled.index[0] and all(not fold_snapshot.settled(a) for a in f.states[0].values())


@pytest.mark.parametrize("value", [None, b"not an account"])
def test_a_settled_read_that_finds_nothing_usable_is_said_with_the_offset(monkeypatch, value):
    f, _ = fold(monkeypatch, 0.0)
    f.settled.index[0] = {b"7001": 4}
    f.settled.read_fn = lambda *a: value
    with pytest.raises(fold_settled.AccountUnavailable, match=r"7001.*accounting\.settled@4"):
        f.settled.load({}, 0, b"7001", 1, f.snapshot_config)
