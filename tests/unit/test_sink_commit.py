"""A sink whose offset commit the group refuses (a rebalance, a restarted broker that forgot the
member, a moved coordinator) goes on: the batch is durable; its offsets are kept, committed with
the next batch's or retried, and forgotten when the partitions are assigned anew. Before, the
ledger sink raised UNKNOWN_MEMBER_ID and stopped, and billing with it (found by
``test_a_durable_broker_killed_and_restarted_mid_run_loses_nothing``). An error that would recur,
or refusals that last ``COMMIT_GIVE_UP_S``, still end it."""

from __future__ import annotations

import threading

import pytest
from confluent_kafka import KafkaError, KafkaException, TopicPartition

from nodeshare.runtime import consumer as consumer_mod
from nodeshare.runtime import metrics
from nodeshare.runtime.config import Settings
from nodeshare.runtime.consumer import BatchSink


class _Message:
    def __init__(self, offset: int, partition: int = 0) -> None:
        self._offset, self._partition = offset, partition

    def topic(self) -> str:
        return "node.ipc"

    def partition(self) -> int:
        return self._partition

    def offset(self) -> int:
        return self._offset

    def error(self) -> None:
        return None


class _Group:
    """A consumer whose commits fail with ``refusing`` while it is set; it records what it took."""

    def __init__(self, refusing: KafkaError | None = None) -> None:
        self.refusing, self.tries, self.committed = refusing, 0, {}

    def commit(self, offsets: list[TopicPartition], asynchronous: bool) -> None:
        self.tries += 1
        if self.refusing is not None:
            raise KafkaException(self.refusing)
        self.committed.update({(tp.topic, tp.partition): tp.offset for tp in offsets})


class _Sink(BatchSink):
    def __init__(self) -> None:
        super().__init__(Settings(bootstrap=""), ["node.ipc"], "t")
        self.written: list[object] = []

    def write(self, messages: list) -> None:  # type: ignore[override]
        self.written += messages


UNKNOWN_MEMBER = KafkaError(KafkaError.UNKNOWN_MEMBER_ID, "Commit failed: Unknown member")


def test_a_refused_commit_is_kept_and_committed_with_the_next_batch() -> None:
    sink, group = _Sink(), _Group(UNKNOWN_MEMBER)
    before = metrics.SINK_COMMITS_FAILED.labels("t", "UNKNOWN_MEMBER_ID")._value.get()
    sink._flush(group, [_Message(41), _Message(7, partition=1)])  # type: ignore[arg-type, list-item]
    assert len(sink.written) == 2 and sink.messages_written == 2 and group.committed == {}
    assert sink.pending_offsets == {("node.ipc", 0): 42, ("node.ipc", 1): 8}
    assert metrics.SINK_COMMITS_FAILED.labels("t", "UNKNOWN_MEMBER_ID")._value.get() == before + 1
    group.refusing = None
    sink._flush(group, [_Message(42)])  # type: ignore[arg-type, list-item]
    assert group.committed == {("node.ipc", 0): 43, ("node.ipc", 1): 8} and sink.pending_offsets == {}


def test_a_quiet_partition_s_refused_commit_is_retried_and_a_new_assignment_forgets_it(monkeypatch) -> None:
    monkeypatch.setattr(consumer_mod, "COMMIT_RETRY_S", 0.0)
    sink, group = _Sink(), _Group(UNKNOWN_MEMBER)
    sink._flush(group, [_Message(41)])  # type: ignore[arg-type, list-item]
    group.refusing = None
    stop = threading.Event()

    class Idle(_Group):
        def subscribe(self, topics: list[str], **callbacks: object) -> None: ...

        def consume(self, num_messages: int, timeout: float) -> list[object]:
            stop.set()  # one pass of the loop, with nothing to read
            return []

        def poll(self, timeout: float) -> None:
            return None

        def close(self) -> None: ...

        def assign(self, partitions: list[object]) -> None: ...

        def position(self, partitions: list[object]) -> list[object]:
            return []

        def assignment(self) -> list[object]:
            return []

    idle = Idle()
    sink.consumer = lambda: idle  # type: ignore[method-assign, assignment, return-value]
    sink.run(stop)
    assert idle.committed == {("node.ipc", 0): 42} and sink.pending_offsets == {}
    sink._flush(_Group(UNKNOWN_MEMBER), [_Message(50)])  # type: ignore[arg-type, list-item]
    sink._on_assign(idle, [])  # type: ignore[arg-type]
    assert sink.pending_offsets == {}  # the next owner's offsets are not ours to commit


@pytest.mark.parametrize("error", [KafkaError(KafkaError._FATAL, "fatal"),
                                   KafkaError(KafkaError.FENCED_INSTANCE_ID, "fenced static member"),
                                   KafkaError(KafkaError._NO_OFFSET, "no offset"),
                                   KafkaError(KafkaError.GROUP_AUTHORIZATION_FAILED, "not allowed"),
                                   KafkaError(KafkaError.OFFSET_METADATA_TOO_LARGE, "too large")],
                         ids=["fatal", "fenced", "no-offset", "authorization", "refused-offsets"])
def test_a_commit_error_that_would_recur_ends_the_sink(error: KafkaError) -> None:
    """(Swallowed, these would leave the group's offsets where they are for good; a commit's error
    never says ``fatal()``, so the codes decide.)"""
    with pytest.raises(KafkaException):
        _Sink()._flush(_Group(error), [_Message(1)])  # type: ignore[arg-type, list-item]


def test_refusals_that_last_end_the_sink(monkeypatch) -> None:
    sink, group = _Sink(), _Group(UNKNOWN_MEMBER)
    sink._flush(group, [_Message(1)])  # type: ignore[arg-type, list-item]
    monkeypatch.setattr(consumer_mod, "COMMIT_GIVE_UP_S", -1.0)
    with pytest.raises(KafkaException, match="no commit accepted for"):
        sink._flush(group, [_Message(2)])  # type: ignore[arg-type, list-item]


def test_a_revoke_commits_what_is_pending_once_and_an_assignment_starts_the_clock_again() -> None:
    """(A review: after a refusal the offsets were dropped at the next assignment, never committed
    while the old generation still held, and the give-up clock kept running: one refusal an hour
    later ended the sink.)"""
    sink = _Sink()
    sink._flush(_Group(UNKNOWN_MEMBER), [_Message(9)])  # type: ignore[arg-type, list-item]
    accepting = _Group()
    sink._on_revoke(accepting, [])  # type: ignore[arg-type]
    assert accepting.committed == {("node.ipc", 0): 10} and sink.pending_offsets == {}
    sink._flush(_Group(UNKNOWN_MEMBER), [_Message(11)])  # type: ignore[arg-type, list-item]
    sink._on_revoke(_Group(UNKNOWN_MEMBER), [])  # type: ignore[arg-type]  # refused again: left to the next owner
    assert sink.pending_offsets == {} and sink._failing_since is None
    sink._flush(_Group(UNKNOWN_MEMBER), [_Message(12)])  # type: ignore[arg-type, list-item]
    sink._on_lost(accepting, [])  # type: ignore[arg-type]
    assert sink.pending_offsets == {} and sink._failing_since is None
