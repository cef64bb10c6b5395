"""The agent's spool never reorders a job's records, whatever fails and is sent again.

librdkafka's idempotent producer keeps order across its own retries, but a message that fails for
good (larger than a topic's max.message.bytes, say) is reported while later messages of its
partition may still be delivered (``enable.gapless.guarantee`` is off by default). The fake
producer below does exactly that; before the fix, the Forwarder re-sent the failed batch after
the job's JobLeftNode and the fold counted 4 of 8 blocks (price 11.11 instead of 6.25).
"""

from __future__ import annotations

from collections import defaultdict

from confluent_kafka import KafkaError
from hypothesis import given, settings
from hypothesis import strategies as st

from nodeshare.producers.agent.spool import Forwarder, Spool


class FlakyProducer:
    """Delivers what it is handed, in the order handed, at each poll; the attempts named in
    ``failures`` (value -> how many of its first attempts fail) are reported failed, non-fatally,
    while the others of the same poll are delivered."""

    def __init__(self, failures: dict[bytes, int]) -> None:
        self.failures = dict(failures)
        self.queue: list = []
        self.delivered: list[tuple[str, bytes | None, bytes]] = []

    def send_raw(self, topic, key, value, on_delivery=None) -> None:
        self.queue.append((topic, key, value, on_delivery))

    def poll(self, timeout: float = 0.0) -> None:
        queue, self.queue = self.queue, []
        for topic, key, value, done in queue:
            if self.failures.get(value, 0) > 0:
                self.failures[value] -= 1
                done(KafkaError(KafkaError.MSG_SIZE_TOO_LARGE), None)
            else:
                self.delivered.append((topic, key, value))
                done(None, None)

    def release(self, timeout: float = 1.0) -> None:
        pass


def _forward(tmp_path, events, failures, in_flight=5000, pumps=200) -> tuple[FlakyProducer, Spool]:
    spool = Spool(tmp_path / "spool.db")
    spool.put(events)
    fake = FlakyProducer(failures)
    forwarder = Forwarder(spool, lambda: fake, in_flight=in_flight)
    for _ in range(pumps):
        forwarder.pump(0)
        if not spool.rows:
            break
    return fake, spool


def test_a_failed_batch_is_delivered_before_the_marker_spooled_after_it(tmp_path):
    events = [("node.ipc", b"J", b"batch 0-3"), ("node.ipc", b"J", b"batch 4-7"), ("node.ipc", b"J", b"left J")]
    fake, spool = _forward(tmp_path, events, {b"batch 4-7": 1})
    assert [v for _, _, v in fake.delivered] == [b"batch 0-3", b"batch 4-7", b"left J"] and spool.rows == 0


def test_other_jobs_are_not_held_behind_a_failing_one(tmp_path):
    events = [("node.ipc", b"A", b"a0"), ("node.ipc", b"B", b"b0"), ("node.ipc", b"A", b"a1"),
              ("node.ipc", b"B", b"b1")]
    fake, _ = _forward(tmp_path, events, {b"a0": 3}, pumps=2)  # sent; then a0 failed and b0 delivered
    assert [v for _, _, v in fake.delivered] == [b"b0"]  # a0 failed, a1 waits for it; b goes on


@settings(max_examples=200, deadline=None, derandomize=True)
@given(st.lists(st.tuples(st.sampled_from([b"A", b"B", b"C"]), st.integers(0, 3)), min_size=1, max_size=30),
       st.integers(1, 6))
def test_every_record_arrives_once_and_each_job_in_spool_order(tmp_path_factory, records, in_flight):
    events = [("node.ipc", key, b"%s-%d" % (key, i)) for i, (key, _) in enumerate(records)]
    failures = {value: fails for (_, _, value), (_, fails) in zip(events, records, strict=True) if fails}
    fake, spool = _forward(tmp_path_factory.mktemp("spool"), events, failures, in_flight=in_flight, pumps=1000)
    assert spool.rows == 0 and sorted(fake.delivered) == sorted(events)
    sent, got = defaultdict(list), defaultdict(list)
    for _, key, value in events:
        sent[key].append(value)
    for _, key, value in fake.delivered:
        got[key].append(value)
    assert got == sent


def test_shutter_windows_under_one_key_are_not_held_one_at_a_time(tmp_path):
    """A node's windows share one key and come one a cycle: held one in flight per key, a backlog
    left by an outage drained no faster than it grew, for good. Only node.ipc keeps per-key order."""
    events = [("node.shutter", b"n1", b"w%d" % i) for i in range(300)]
    fake, spool = _forward(tmp_path, events, {}, pumps=2)
    assert spool.rows == 0 and len(fake.delivered) == 300


def test_a_record_refused_for_good_is_set_aside_and_the_jobs_marker_still_goes_out(tmp_path):
    events = [("node.ipc", b"J", b"batch 0-3"), ("node.ipc", b"J", b"too big"), ("node.ipc", b"J", b"left J")]
    fake, spool = _forward(tmp_path, events, {b"too big": 10**6})
    assert [v for _, _, v in fake.delivered] == [b"batch 0-3", b"left J"] and spool.rows == 0
    (_, topic, reason), = spool.refused()
    assert topic == "node.ipc" and "too large" in reason.lower()
