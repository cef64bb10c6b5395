"""The charge fold's rebuild on assignment and its commits, without a broker (issue 44, item 3):
consumption starts exactly where the rebuild stopped, commits carry only partitions this member
owns, and a log whose head was deleted is refused, never folded truncated. The broker-level race
is tests/integration/test_rebuild.py."""

from __future__ import annotations

import logging

import pytest
from confluent_kafka import KafkaError, KafkaException, TopicPartition

from nodeshare.runtime.config import Settings
from nodeshare.streams.core.accounting import Message
from nodeshare.streams.worker import fold_consumer, fold_snapshots
from nodeshare.streams.worker.cursor import LogHeadGone, head_deleted
from nodeshare.streams.worker.fold_consumer import REFUSED, FoldConsumer, owned_offsets, resume_offsets

IPC, LIFE = "t.node.ipc", "t.jobs.lifecycle"


class _Producer:
    def send_raw(self, topic: str, key: bytes, value: bytes) -> None:
        raise AssertionError("an empty rebuild completes no charge")

    def flush(self, timeout: float = 30.0) -> None:
        pass


class _Consumer:
    """The calls the fold makes on its group consumer, against a committed-offsets table that a test
    may change between calls (another member's commit landing)."""

    def __init__(self, committed: dict[tuple[str, int], int]) -> None:
        self.group = dict(committed)
        self.assigned: list[tuple[str, int, int]] = []
        self.paused: list[tuple[str, int]] = []
        self.commits: list[list[tuple[str, int, int]]] = []
        self.fail_commits = False

    def committed(self, partitions: list[TopicPartition], timeout: float) -> list[TopicPartition]:
        return [TopicPartition(tp.topic, tp.partition, self.group.get((tp.topic, tp.partition), -1001))
                for tp in partitions]

    def assign(self, partitions: list[TopicPartition]) -> None:
        self.assigned = [(tp.topic, tp.partition, tp.offset) for tp in partitions]

    def pause(self, partitions: list[TopicPartition]) -> None:
        self.paused += [(tp.topic, tp.partition) for tp in partitions]

    def commit(self, offsets: list[TopicPartition], asynchronous: bool) -> None:
        if self.fail_commits:
            raise KafkaException(KafkaError(KafkaError.REQUEST_TIMED_OUT))
        self.commits.append([(tp.topic, tp.partition, tp.offset) for tp in offsets])
        self.group.update({(tp.topic, tp.partition): tp.offset for tp in offsets})


def _fold(monkeypatch: pytest.MonkeyPatch, read: object) -> FoldConsumer:
    settings = Settings.model_validate({"bootstrap": "127.0.0.1:1", "topic_prefix": "t."})
    monkeypatch.setattr(fold_consumer, "input_partitions", lambda *a, **k: {IPC: 2, LIFE: 2})
    monkeypatch.setattr(fold_consumer, "read_range", read)
    monkeypatch.setattr(fold_snapshots, "read_compacted", lambda *a, **k: [])  # no snapshot: folded from offset 0
    fold = FoldConsumer(settings)
    fold.producer = _Producer()  # type: ignore[assignment]
    return fold


def _tps(*partitions: int) -> list[TopicPartition]:
    return [TopicPartition(t, p) for p in partitions for t in (IPC, LIFE)]


def test_resume_offsets_are_the_committed_ones_and_zero_without_a_commit():
    assert resume_offsets([TopicPartition(IPC, 0, 7), TopicPartition(LIFE, 0, -1001)]) == {(IPC, 0): 7, (LIFE, 0): 0}


def test_only_offsets_of_owned_partitions_are_committed():
    pending = {(IPC, 0): 5, (LIFE, 0): 2, (IPC, 1): 9}
    assert [(tp.topic, tp.partition, tp.offset) for tp in owned_offsets(pending, {(IPC, 0), (LIFE, 0)})] == [
        (LIFE, 0, 2), (IPC, 0, 5)]
    assert owned_offsets(pending, set()) == []


def test_consumption_starts_where_the_rebuild_stopped_whatever_is_committed_meanwhile(monkeypatch):
    """A member that lost the partitions commits offsets 40 and 9 while the new owner rebuilds up to
    30 and 6: the new owner must assign at 30 and 6 (messages 30..39 were never folded into its
    state), and its first commit puts the group back there. (Mutation: ``assign(partitions)``
    without offsets, which fetches the committed offsets again once consumption starts.)"""
    consumer = _Consumer({(IPC, 0): 30, (LIFE, 0): 6})
    rebuilt_to: list[tuple[str, int, int]] = []

    def read(settings: Settings, topic: str, partition: int, start: int, stop: int,
             verifier: object = None) -> list[Message]:
        rebuilt_to.append((topic, partition, stop))
        consumer.group.update({(IPC, 0): 40, (LIFE, 0): 9})  # the stale commit lands mid-rebuild
        return []

    fold = _fold(monkeypatch, read)
    fold._on_assign(consumer, _tps(0))  # type: ignore[arg-type]
    assert sorted(rebuilt_to) == [(LIFE, 0, 6), (IPC, 0, 30)]
    assert sorted(consumer.assigned) == [(LIFE, 0, 6), (IPC, 0, 30)]
    fold.commit(consumer)  # type: ignore[arg-type]
    assert consumer.group == {(IPC, 0): 30, (LIFE, 0): 6}


def test_a_failed_commit_on_revoke_is_dropped_never_committed_for_partitions_given_away(monkeypatch, caplog):
    """The commit on revoke fails: the revoked partitions' offsets are logged and dropped; the next
    commit, after partition 1 is assigned, carries partition 1 only, even with an offset of partition
    0 pending. (Mutations: keeping ``_pending`` after the failed commit, as before; committing every
    pending offset, owned or not: either commits partition 0 over its new owner's progress.)"""
    consumer = _Consumer({})
    fold = _fold(monkeypatch, lambda *a, **k: [])
    fold._on_assign(consumer, _tps(0))  # type: ignore[arg-type]
    fold._pending.update({(IPC, 0): 12, (LIFE, 0): 3})  # applied, not yet committed
    consumer.fail_commits = True
    with caplog.at_level(logging.WARNING, logger=fold_consumer.__name__):
        fold._on_revoke(consumer, _tps(0))  # type: ignore[arg-type]
    assert "could not commit on revoke" in caplog.text and "dropping" in caplog.text
    assert fold._pending == {} and 0 not in fold.states
    consumer.fail_commits = False
    fold._on_assign(consumer, _tps(1))  # type: ignore[arg-type]
    fold._pending[(IPC, 1)] = 4
    fold.commit(consumer)  # type: ignore[arg-type]
    assert {(t, p) for c in consumer.commits for t, p, _ in c} == {(IPC, 1), (LIFE, 1)}
    fold._pending[(IPC, 0)] = 99  # however it got there: not this member's partition
    fold.commit(consumer)  # type: ignore[arg-type]
    assert (IPC, 0) not in consumer.group


@pytest.mark.parametrize(("start", "first", "low", "gone"), [
    (0, 0, None, False),   # read from where it was asked
    (0, 3, 0, False),      # a gap the log still has (transaction markers on Apache Kafka)
    (0, 3, 3, True),       # retention deleted 0..2
    (0, 50, 50, True),     # everything up to the stop deleted: the position jumped, nothing read
    (10, 12, 11, True),    # a read-back from 10 (the cursor) whose 10 is gone
    (10, 12, 10, False),
])
def test_a_read_whose_head_was_deleted_is_told_from_one_with_a_gap(start, first, low, gone):
    assert head_deleted(start, first, low) is gone


def test_a_partition_whose_log_lost_its_head_is_refused_paused_and_reported(monkeypatch, caplog):
    """Retention deleted the head of partition 1's node.ipc: partition 1 (both topics) is assigned
    paused, has no state, is never committed, the gauge says 1 and an error names it; partition 0
    is folded as usual. A revoke clears it. (Mutation: folding what is left, as read_range did
    before it checked, charges the partition's jobs short.)"""
    def read(settings: Settings, topic: str, partition: int, start: int, stop: int,
             verifier: object = None) -> list[Message]:
        if (topic, partition) == (IPC, 1):
            raise LogHeadGone(topic, partition, start, 17)
        return []

    consumer = _Consumer({(IPC, 0): 5, (LIFE, 0): 1, (IPC, 1): 40, (LIFE, 1): 4})
    fold = _fold(monkeypatch, read)
    with caplog.at_level(logging.ERROR, logger=fold_consumer.__name__):
        fold._on_assign(consumer, _tps(0, 1))  # type: ignore[arg-type]
    assert fold.refused == {1} and REFUSED._value.get() == 1
    assert sorted(consumer.paused) == [(LIFE, 1), (IPC, 1)]
    assert set(fold.states) == {0}
    assert "refusing partition 1" in caplog.text and "begins at offset 17" in caplog.text
    assert "nodeshare replay" in caplog.text
    fold._pending[(IPC, 1)] = 41
    fold.commit(consumer)  # type: ignore[arg-type]
    assert {(t, p) for c in consumer.commits for t, p, _ in c} == {(IPC, 0), (LIFE, 0)}
    fold._on_revoke(consumer, _tps(0, 1))  # type: ignore[arg-type]
    assert fold.refused == set() and REFUSED._value.get() == 0


def test_a_parked_partition_is_reused_only_when_nobody_committed_it_meanwhile(monkeypatch):
    """A partition revoked and given back keeps its accounts if the group's offsets are where this
    member left them; if another member folded and committed it meanwhile, the accounts are
    rebuilt up to the new offsets. (Mutation: reusing any parked state starts consumption at the
    other member's offsets with accounts that miss what it folded. The property test in
    test_fold_partitions_property.py reaches this only through a rare chain of zombie commits.)"""
    reads: list[tuple[str, int, int]] = []

    def read(settings: Settings, topic: str, partition: int, start: int, stop: int,
             verifier: object = None) -> list[Message]:
        reads.append((topic, partition, stop))
        return []

    consumer = _Consumer({(IPC, 0): 5, (LIFE, 0): 1})
    fold = _fold(monkeypatch, read)
    fold._on_assign(consumer, _tps(0))  # type: ignore[arg-type]
    assert sorted(reads) == [(LIFE, 0, 1), (IPC, 0, 5)]
    fold._on_revoke(consumer, _tps(0))  # type: ignore[arg-type]
    fold._on_assign(consumer, _tps(0))  # type: ignore[arg-type]
    assert len(reads) == 2 and 0 in fold.states  # untouched: reused, not read again
    fold._on_revoke(consumer, _tps(0))  # type: ignore[arg-type]
    consumer.group[(IPC, 0)] = 9  # another member folded 5..8 and committed
    fold._on_assign(consumer, _tps(0))  # type: ignore[arg-type]
    assert sorted(reads[2:]) == [(LIFE, 0, 1), (IPC, 0, 9)]
    assert sorted(consumer.assigned) == [(LIFE, 0, 1), (IPC, 0, 9)]
