"""The worker says which ended jobs wait for a node (issue 39): ``nodeshare_jobs_awaiting_nodes``
and the age of the oldest, ``nodeshare_jobs_awaiting_nodes_oldest_seconds``. A node lost for good shows
as a job waiting for hours, until its stream is closed (``nodeshare nodes down``)."""

from __future__ import annotations

from datetime import timedelta

import pytest
from confluent_kafka import TopicPartition
from factories import T0, block, job_event, left
from prometheus_client import REGISTRY

from nodeshare.runtime.config import Settings
from nodeshare.schemas import JobState, NodeDown, Record, encode
from nodeshare.streams.core.accounting import Origin
from nodeshare.streams.worker import fold_consumer
from nodeshare.streams.worker.fold_consumer import FoldConsumer

IPC, LIFE = "t.node.ipc", "t.jobs.lifecycle"


class _Producer:
    def __init__(self) -> None:
        self.sent: list[str] = []

    def send_raw(self, topic: str, key: bytes, value: bytes) -> None:
        self.sent.append(topic)

    def flush(self, timeout: float = 30.0) -> None:
        pass


def _apply(fold: FoldConsumer, topic: str, offset: int, record: Record) -> None:
    fold.apply((Origin(topic, 0, offset), record.job_id.encode(), encode(record), 0.0))  # type: ignore[attr-defined]


def test_a_job_waiting_for_a_node_is_counted_with_its_age_until_the_node_is_closed(monkeypatch: pytest.MonkeyPatch):
    settings = Settings.model_validate({"bootstrap": "127.0.0.1:1", "topic_prefix": "t."})
    monkeypatch.setattr(fold_consumer, "input_partitions", lambda *a, **k: {})
    fold = FoldConsumer(settings)
    fold.producer = _Producer()  # type: ignore[assignment]
    _apply(fold, IPC, 0, block(1.0, 1.1, 1.0, job="w", node="n1"))
    _apply(fold, IPC, 1, left("w", "n1", 1, 0))
    _apply(fold, LIFE, 0, job_event("w", JobState.STARTED, nodes=("n1", "n2")))
    assert fold.awaiting() == (0, 0.0)  # running: nothing to charge yet
    ended = job_event("w", JobState.ENDED, nodes=("n1", "n2"), run_s=600)
    _apply(fold, LIFE, 1, ended)
    assert ended.end_time is not None
    assert fold.awaiting(now=ended.end_time + timedelta(hours=3)) == (1, 3 * 3600.0)
    assert REGISTRY.get_sample_value("nodeshare_jobs_awaiting_nodes") == 1
    assert REGISTRY.get_sample_value("nodeshare_jobs_awaiting_nodes_oldest_seconds") > 3600  # T0 is months ago
    _apply(fold, IPC, 2, NodeDown(event_id="d", source="operator/root", event_time=T0 + timedelta(hours=4),
                                  job_id="w", node="n2", reason="gone"))
    assert fold.awaiting() == (0, 0.0) and REGISTRY.get_sample_value("nodeshare_jobs_awaiting_nodes") == 0
    assert "t.ledger.charges" in fold.producer.sent  # type: ignore[attr-defined]


def test_a_revoked_partitions_waiting_jobs_are_no_longer_this_workers(monkeypatch: pytest.MonkeyPatch):
    settings = Settings.model_validate({"bootstrap": "127.0.0.1:1", "topic_prefix": "t."})
    monkeypatch.setattr(fold_consumer, "input_partitions", lambda *a, **k: {})
    fold = FoldConsumer(settings)
    fold.producer = _Producer()  # type: ignore[assignment]
    _apply(fold, LIFE, 0, job_event("x", JobState.ENDED, nodes=("n1",)))
    assert fold.awaiting()[0] == 1
    fold._forget([TopicPartition(IPC, 0), TopicPartition(LIFE, 0)])
    assert fold.awaiting() == (0, 0.0)


def test_a_commit_the_group_refuses_after_a_broker_restart_drops_the_offsets_and_keeps_folding(
        monkeypatch: pytest.MonkeyPatch):
    """The broker restarted with the group's state lost: the periodic commit failed with
    UNKNOWN_MEMBER_ID and the worker stopped (the broker-outage fault test, once in two CI runs).
    Now the uncommitted offsets are dropped (the partitions are rebuilt from the committed ones when
    assigned again); any other commit failure still stops the fold."""
    from confluent_kafka import KafkaError, KafkaException

    settings = Settings.model_validate({"bootstrap": "127.0.0.1:1", "topic_prefix": "t."})
    monkeypatch.setattr(fold_consumer, "input_partitions", lambda *a, **k: {})
    fold = FoldConsumer(settings)
    fold.producer = _Producer()  # type: ignore[assignment]
    fold._owned = {(IPC, 0), (LIFE, 0)}

    class Refusing:
        def __init__(self, code: int) -> None:
            self.code = code

        def commit(self, **_: object) -> None:
            raise KafkaException(KafkaError(self.code))

    _apply(fold, IPC, 0, block(1.0, 1.1, 1.0, job="w", node="n1"))
    fold._pending[(IPC, 0)] = 1  # what ``take`` notes after applying offset 0
    fold.commit_or_rejoin(Refusing(KafkaError.UNKNOWN_MEMBER_ID))  # type: ignore[arg-type]
    assert not fold._pending
    _apply(fold, IPC, 1, block(1.0, 1.1, 1.0, job="w", node="n1", cycle=1))
    fold._pending[(IPC, 0)] = 2
    with pytest.raises(KafkaException):
        fold.commit_or_rejoin(Refusing(KafkaError._MSG_TIMED_OUT))  # type: ignore[arg-type]
