"""Settled accounts (streams/worker/fold_settled.py, issue 42 item 6): a charged account leaves the
worker's memory and a late record of its job reads it back, with the outputs of a fold that kept it;
a settled account that cannot be read back usable dead-letters the record, never charges it from
nothing; a write the broker refuses keeps the account in memory. Under rebalances, crashes, zombies
and retention: tests/unit/test_fold_partitions_property.py, which evicts at every commit."""

from __future__ import annotations

import pytest
from factories import T0
from unit.test_fold_partitions_property import IPC, LIFE, SETTINGS, SETTLED, Broker, Producer, records

from nodeshare.schemas import AdjustmentAction, Charge, ChargeAdjustment, DeadLetter, encode
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


def settle(f: FoldConsumer) -> None:
    """Two commits' evictions: the first sends what is due, the second (after the broker acknowledged
    it) lets it go."""
    f.evict()
    f.producer.flush(30)
    f.evict()


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
    settle(moved)
    settle(kept)
    assert set(kept.states[0]) == {k for _, k, _, _ in msgs}  # inf: nothing ever leaves
    gone = set(moved.settled.index[0])
    assert gone and gone.isdisjoint(moved.states[0]) and gone | set(moved.states[0]) == set(kept.states[0])
    assert {k for t, k, _ in broker.durable if t == SETTLED} == {
        fold_snapshot.settled_key(0, k, fold_snapshot.unpack(m)[1:]) for k, m in moved.settled.index[0].items()}
    assert feed(kept, late) == feed(moved, late)  # charges, copies refused, estimates: the same bytes
    assert broker.reads == len(gone & {k for _, k, _, _ in late})
    assert {k: a.model_dump() for k, a in moved.states[0].items()} == {
        k: a.model_dump() for k, a in kept.states[0].items() if k in moved.states[0]}


def test_an_operator_voids_a_settled_job_and_gets_the_revision_a_fold_that_kept_it_makes(monkeypatch):
    msgs, late = job_messages()
    kept, _ = fold(monkeypatch, float("inf"))
    moved, broker = fold(monkeypatch, 0.0)
    feed(kept, msgs), feed(moved, msgs)
    settle(moved)
    gone = sorted(moved.settled.index[0])
    assert gone
    at = late[0][0].offset
    voids = [(Origin(LIFE, 0, at + i), key, encode(ChargeAdjustment(
        event_id=f"void-{i}", source="operator/test", event_time=T0, job_id=key.decode(),
        action=AdjustmentAction.VOID, reason="refunded", operator="test")), 0.0) for i, key in enumerate(gone)]
    out = feed(moved, voids)
    assert out == feed(kept, voids) and broker.reads == len(gone)
    charges = [decode_model(Charge, v) for t, _, v in out if t.endswith("ledger.charges")]
    assert {c.job_id for c in charges} == {k.decode() for k in gone} and all(c.price == 0.0 for c in charges)


def test_a_settled_account_that_cannot_be_read_back_dead_letters_the_record_and_stays_settled(monkeypatch):
    msgs, late = job_messages()
    f, broker = fold(monkeypatch, 0.0)
    feed(f, msgs)
    settle(f)
    key, packed = next(iter(f.settled.index[0].items()))
    offset = fold_snapshot.unpack(packed)[0]
    topic, k, value = broker.durable[[i for i, m in enumerate(broker.durable) if m[0] == SETTLED][offset]]
    broker.durable[broker.durable.index((topic, k, value))] = (topic, k, value[:-3] + b"bad")  # damaged on disk
    record = next(m for m in late if m[1] == key)
    out = feed(f, [record])
    [(t, _, dl)] = out
    letter = decode_model(DeadLetter, dl)
    assert t == "t.dlq" and "no message under its key from there is usable: a damaged settled account" in letter.reason
    assert letter.origin_offset == record[0].offset
    assert key not in f.states[0] and f.settled.index[0][key] == packed  # never an empty account in its place
    assert fold_consumer.metrics.DEAD_LETTERS.labels(UNSETTLED)._value.get() >= 1


def test_a_settled_write_the_broker_refuses_keeps_the_accounts_in_memory_and_is_tried_again(monkeypatch, caplog):
    msgs, _ = job_messages()
    f, broker = fold(monkeypatch, 0.0, RefusingProducer)
    feed(f, msgs)
    before = set(f.states[0])
    settle(f)
    assert set(f.states[0]) == before and not f.settled.index.get(0) and f.settled.sending  # sent again
    assert "not written to t.accounting.settled" in caplog.text
    f.producer.flush(30)  # refused again
    f.producer = Producer(broker)  # type: ignore[assignment]  # the broker takes them now
    settle(f)
    assert f.settled.index[0] and set(f.settled.index[0]) | set(f.states[0]) == before


def test_an_account_that_gets_a_record_while_it_is_in_flight_stays_in_memory(monkeypatch):
    msgs, late = job_messages()
    f, _ = fold(monkeypatch, 0.0)
    feed(f, msgs)
    f.evict()  # sent
    going = {k for _, k in f.settled.sending}
    # a copy of a job's last terminal event (refused as a duplicate: the account stays settled) comes
    # while its account is in flight, and the broker acknowledges the account as it was before
    record = [m for m in late if m[1] in going][-1]
    first = f.settled.sending[(0, record[1])].applied
    out = feed(f, [record])
    assert [t for t, _, _ in out if t != SETTLED] == ["t.dlq"]
    f.evict()
    assert record[1] in f.states[0] and record[1] not in f.settled.index.get(0, {})  # stays: the copy sent is stale
    account = f.states[0][record[1]]
    assert account.applied != first and fold_snapshot.settled(account)
    assert f.settled.sending[(0, record[1])].applied == account.applied  # sent again, as it stands now
    settle(f)
    assert record[1] in f.settled.index[0] and record[1] not in f.states[0]


def test_an_account_stays_until_it_has_been_settled_for_the_time_set(monkeypatch):
    msgs, _ = job_messages()
    f, _ = fold(monkeypatch, 300.0)
    feed(f, msgs)
    settle(f)
    assert not f.settled.index.get(0) and not f.settled.sending
    now = fold_settled.time.monotonic()
    monkeypatch.setattr(fold_settled.time, "monotonic", lambda: now + 301)
    settle(f)
    assert f.settled.index[0] and all(not fold_snapshot.settled(a) for a in f.states[0].values())


@pytest.mark.parametrize("value", [None, b"not an account"])
def test_a_settled_read_that_finds_nothing_usable_is_said_with_the_offset(monkeypatch, value):
    f, _ = fold(monkeypatch, 0.0)
    f.settled.index[0] = {b"7001": fold_snapshot.pack((4, 10, 3))}
    f.settled.read_fn = lambda s, t, o, k, accept: value if accept(value) else None
    with pytest.raises(fold_settled.AccountUnavailable, match=r"7001.*accounting\.settled@4"):
        f.settled.load({}, 0, b"7001", 1, f.snapshot_config)


def test_a_record_refused_before_any_account_is_needed_never_reads_a_settled_one(monkeypatch):
    """(A review: the account was read back before the record was decoded or its key checked: an
    undecodable record keyed with a settled job's id cost a broker read each, and a forged one was
    dead-lettered as unsettled.)"""
    msgs, _ = job_messages()
    f, broker = fold(monkeypatch, 0.0)
    feed(f, msgs)
    settle(f)
    key = next(iter(f.settled.index[0]))
    other = next(v for o, k, v, _ in msgs if o.topic == LIFE and k != key)  # another job's record, under its key
    bad = [(Origin(LIFE, 0, 900), key, b"{not json", 0.0), (Origin(LIFE, 0, 901), key, other, 0.0)]
    letters = [decode_model(DeadLetter, v) for _, _, v in feed(f, bad)]
    assert broker.reads == 0 and key in f.settled.index[0] and key not in f.states[0]
    assert len(letters) == 2 and letters[1].reason.startswith("message key") and "settled" not in letters[0].reason


def test_a_copy_of_an_earlier_state_is_never_read_back_in_place_of_the_indexed_one(monkeypatch):
    """(A review: a member that lost the partition, a zombie, wrote an earlier state of the job after
    the owner's; compaction kept only the last message of the key, and the read took it: two
    different charges of one revision.) Keys name the state, and a copy behind the index is refused."""
    msgs, late = job_messages()
    f, broker = fold(monkeypatch, 0.0)
    feed(f, msgs)
    key = next(k for k, a in f.states[0].items() if fold_snapshot.settled(a))
    earlier = f.states[0][key].model_copy(deep=True)
    feed(f, [m for m in late if m[1] == key][-1:])  # one more record of it: a later state
    settle(f)
    packed = f.settled.index[0][key]
    mark = fold_snapshot.unpack(packed)
    assert mark[1:] != fold_snapshot.progress(earlier, 0)
    stale = fold_snapshot.settled_key(0, key, fold_snapshot.progress(earlier, 0))
    broker.durable.append((SETTLED, stale, fold_snapshot.encode_settled(0, 1, f.snapshot_config, earlier)))
    back = f.settled.load({}, 0, key, 1, f.snapshot_config)  # the zombie's copy is under another key
    assert back is not None and fold_snapshot.progress(back, 0) == mark[1:]
    f.settled.index[0][key] = packed
    f.settled.read_fn = lambda s, t, o, k, accept: next(  # only the earlier copy is left
        (v for t2, k2, v in broker.durable if k2 == stale and accept(v)), None)
    with pytest.raises(fold_settled.AccountUnavailable, match="a copy of an earlier state"):
        f.settled.load({}, 0, key, 1, f.snapshot_config)


def test_a_read_that_keeps_failing_stops_the_fold_with_the_topic_named(monkeypatch):
    f, _ = fold(monkeypatch, 0.0)
    monkeypatch.setattr(fold_settled, "READ_BACKOFF_S", 0.0)
    f.settled.index[0] = {b"7001": fold_snapshot.pack((4, 10, 3))}
    calls = []

    def away(*a):
        calls.append(a)
        raise RuntimeError("still reading after 60 s")

    f.settled.read_fn = away
    with pytest.raises(fold_settled.SettledUnreadable, match=r"t\.accounting\.settled@4") as raised:
        f.settled.load({}, 0, b"7001", 1, f.snapshot_config)
    assert raised.value.topic == SETTLED and len(calls) == fold_settled.READ_ATTEMPTS


def test_nothing_is_listed_when_accounts_never_leave_and_a_parked_index_goes_with_the_next_assignment(monkeypatch):
    msgs, _ = job_messages()
    f, _ = fold(monkeypatch, float("inf"))
    feed(f, msgs)
    assert not f.settled.due  # inf: no list that grows with every charged job
    f.settled.index[3] = {b"7001": fold_snapshot.pack((4, 10, 3))}
    f.settled.forget({3}, park=True)
    assert f.settled._parked
    f.settled.assigned()
    assert not f.settled._parked and 3 not in f.settled.index


def test_a_settled_account_that_cannot_be_read_stops_its_partition_only(monkeypatch):
    """(A second review: the live fold let the read failure end the worker; the record was never
    committed, so every restart and every member that took the partition over met it again.)"""
    from unit.test_fold_partitions_property import Rec, _Msg

    msgs, late = job_messages()
    f, _ = fold(monkeypatch, 0.0)
    monkeypatch.setattr(fold_settled, "READ_BACKOFF_S", 0.0)
    f._partitions = {IPC: 2, LIFE: 2}
    f._owned = {(t, p) for t in (IPC, LIFE) for p in (0, 1)}
    monkeypatch.setattr(f, "misrouted", lambda origin, key: None)  # the same jobs' records stand in for partition 1's
    feed(f, msgs)
    settle(f)
    key = next(iter(f.settled.index[0]))

    def away(*a):
        raise RuntimeError("still reading after 60 s")

    f.settled.read_fn = away
    _, _, value, _ = next(m for m in late if m[1] == key)
    f._pending.clear()
    f.take([_Msg(LIFE, 0, 50, Rec(0, LIFE, key, value)), _Msg(LIFE, 0, 51, Rec(1, LIFE, key, value)),
            _Msg(IPC, 1, 0, Rec(2, IPC, msgs[0][1], msgs[0][2]))])  # type: ignore[list-item]
    assert f.refused == {0} and f._to_pause == {0}
    assert 0 not in f.states and not any(p == 0 for _, p in f._owned)  # dropped: its next owner rebuilds it
    assert f._pending == {(IPC, 1): 1}  # the other partition folds on, and nothing of partition 0 is committed
    assert fold_consumer.REFUSED._value.get() == 1
