"""The charge fold's inputs must be co-partitioned (issue 44): the pure checks behind the worker's
start-up refusal, its misrouted dead letters and `topics create`'s reconciliation."""

from __future__ import annotations

import ast
import base64
from pathlib import Path

import pytest
from factories import batch, block, job_event, left

from nodeshare.deploy.topics import TopicsError, input_partition_count
from nodeshare.runtime import metrics
from nodeshare.runtime.config import Settings
from nodeshare.schemas import DeadLetter, JobState, encode
from nodeshare.schemas.serde import decode_model
from nodeshare.streams.core.accounting import Origin, Outgoing
from nodeshare.streams.worker.copartition import copartition_problem, kafka_partition, routing_problem
from nodeshare.streams.worker.fold_consumer import MISROUTED, FoldConsumer

ROOT = Path(__file__).resolve().parents[2]

#: Apache Kafka's own murmur2 vectors (clients/.../common/utils/UtilsTest.java, testMurmur2), signed.
JAVA_MURMUR2 = {b"21": -973932308, b"foobar": -790332482, b"a-little-bit-long-string": -985981536,
                b"a-little-bit-longer-string": -1486304829,
                b"lkjh234lh9fiuh90y23oiuhsafujhadof229phr9h19h89h8": -58897971, b"abc": 479470107}


def test_input_topics_with_one_count_pass_and_different_counts_are_refused_naming_both_and_the_remedy():
    assert copartition_problem({}) is None
    assert copartition_problem({"node.ipc": 8}) is None  # the other does not exist yet: nothing to compare
    assert copartition_problem({"node.ipc": 4, "jobs.lifecycle": 4}) is None
    problem = copartition_problem({"x.node.ipc": 8, "x.jobs.lifecycle": 4})
    assert problem is not None
    assert "x.node.ipc has 8 partitions and x.jobs.lifecycle has 4 partitions" in problem
    assert "co-partitioned" in problem and "never charged" in problem
    assert "Grow x.jobs.lifecycle from 4 to 8 partitions" in problem and "deploy/SCALING.md" in problem


def test_the_partition_of_a_key_is_kafkas_default_partitioners():
    for key, signed in JAVA_MURMUR2.items():
        for n in (1, 4, 7, 12):
            assert kafka_partition(key, n) == (signed & 0x7FFFFFFF) % n


def test_a_record_off_its_keys_partition_is_misrouted_with_a_reason_and_one_on_it_is_not():
    key, n = b"1000003", 4
    home = kafka_partition(key, n)
    assert routing_problem(key, home, n) is None
    away = (home + 1) % n
    reason = routing_problem(key, away, n)
    assert reason is not None and reason.startswith("misrouted:")
    assert f"to partition {home} of {n}" in reason and f"read from partition {away}" in reason
    assert "murmur2" in reason and "re-publish" in reason
    assert routing_problem(None, away, n) is None  # no key: the reducer refuses it (key is not the job id)
    assert len(routing_problem(b"k" * 10_000, 1 - kafka_partition(b"k" * 10_000, 2), 2) or "") <= 256


class _Producer:
    """What the fold publishes, kept in memory (the broker is the integration tests')."""

    def __init__(self) -> None:
        self.sent: list[Outgoing] = []

    def send_raw(self, topic: str, key: bytes, value: bytes) -> None:
        self.sent.append(Outgoing(topic, key, value))


def test_the_fold_dead_letters_a_misrouted_record_with_its_bytes_and_folds_the_rest():
    """A job whose end event sits on another partition than its blocks would never be charged
    there: the end event is refused as misrouted (bytes kept for re-publishing), the job's
    correctly routed records are folded. (Mutation: skipping the check folds the end event into
    an account of the wrong partition, and no dead letter is sent.)"""
    settings = Settings.model_validate({"bootstrap": "127.0.0.1:1", "topic_prefix": "t."})
    fold = FoldConsumer(settings)
    fold.producer = _Producer()  # type: ignore[assignment]
    fold._partitions = {"t.node.ipc": 4, "t.jobs.lifecycle": 4}
    job = "1000003"
    home, away = kafka_partition(job.encode(), 4), (kafka_partition(job.encode(), 4) + 1) % 4
    ipc = [batch(*[block(1.0, 1.3, 1.01, job=job, cycle=c) for c in range(3)]), left(job, "n1", 3, 2)]
    end = job_event(job, JobState.ENDED)
    before = metrics.DEAD_LETTERS.labels(MISROUTED)._value.get()
    for offset, record in enumerate(ipc):
        fold.apply((Origin("t.node.ipc", home, offset), job.encode(), encode(record), 0.0))
    fold.apply((Origin("t.jobs.lifecycle", away, 0), job.encode(), encode(end), 0.0))
    [dl_out] = [o for o in fold.producer.sent if o.topic == "t.dlq"]  # type: ignore[attr-defined]
    dl = decode_model(DeadLetter, dl_out.value)
    assert (dl.origin_topic, dl.origin_partition, dl.origin_offset, dl.field) == ("t.jobs.lifecycle", away, 0, "key")
    assert dl.reason.startswith("misrouted:") and base64.b64decode(dl.value_b64) == encode(end)
    assert base64.b64decode(dl.key_b64 or "") == job.encode()
    assert metrics.DEAD_LETTERS.labels(MISROUTED)._value.get() == before + 1
    assert set(fold.states) == {home} and fold.states[home][job.encode()].nodes["n1"].closed
    assert not [o for o in fold.producer.sent if o.topic == "t.ledger.charges"]  # type: ignore[attr-defined]
    fold.apply((Origin("t.jobs.lifecycle", home, 1), job.encode(), encode(end), 0.0))  # re-published right
    assert [o for o in fold.producer.sent if o.topic == "t.ledger.charges"]  # type: ignore[attr-defined]


def test_reconciling_the_input_topics_keeps_one_count_refuses_two_and_never_shrinks():
    assert input_partition_count({}, 4) == 4  # none exists: the configured count
    assert input_partition_count({"node.ipc": 6}, 4) == 6  # the missing one follows the existing one
    assert input_partition_count({"node.ipc": 6, "jobs.lifecycle": 6}, 4) == 6
    with pytest.raises(TopicsError, match=r"node\.ipc has 8 partitions and jobs\.lifecycle has 4 partitions.*"
                                          r"Nothing was created or changed"):
        input_partition_count({"node.ipc": 8, "jobs.lifecycle": 4}, 4)
    assert input_partition_count({"node.ipc": 8, "jobs.lifecycle": 4}, 4, grow_to=8) == 8
    assert input_partition_count({"node.ipc": 4, "jobs.lifecycle": 4}, 4, grow_to=12) == 12
    with pytest.raises(TopicsError, match="Kafka only adds partitions"):
        input_partition_count({"node.ipc": 8, "jobs.lifecycle": 4}, 4, grow_to=6)


def test_every_producer_of_ours_is_the_one_wrapper_and_hashes_keys_with_murmur2():
    """Records of ours must land where the fold looks for them: one confluent-kafka Producer in the
    code (EventProducer), with librdkafka's Java-compatible murmur2 partitioner, and no caller that
    overrides it. (Replay keeps each archived record's partition: see docs/topics.md.)"""
    wrapper = ROOT / "producers" / "kafka_producer.py"
    assert '"partitioner": "murmur2_random"' in wrapper.read_text()
    for folder in ("producers", "streams", "sinks", "nodeshare", "deploy"):
        for path in (ROOT / folder).rglob("*.py"):
            tree = ast.parse(path.read_text())
            for node in ast.walk(tree):
                if isinstance(node, ast.Call):
                    name = getattr(node.func, "id", getattr(node.func, "attr", ""))
                    assert name != "Producer" or path == wrapper, f"{path}: a producer other than EventProducer"
                    if name == "EventProducer":
                        assert all(k.arg is None or "partition" not in k.arg for k in node.keywords), path
                        assert all(not (isinstance(k.value, ast.Dict) and any(
                            isinstance(d, ast.Constant) and d.value == "partitioner" for d in k.value.keys))
                            for k in node.keywords if k.arg is None), f"{path}: overrides the partitioner"
