"""`nodeshare bench broker-acks` (issue 39): does the bundled broker on durable storage keep every
record it acknowledged when it is killed mid-write?

The project's producer (``EventProducer``: idempotent, so ``acks=all``) sends numbered records to
one partition of ``nodeshare broker --data``'s Tansu. Halfway, Tansu is SIGKILLed and started
again on the same storage and port (``BundledBroker.kill_and_restart``), and the producer goes on.
Then every record is read back from offset 0: each acknowledged number must be there once, at the
offset its acknowledgement gave.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable
from datetime import date
from pathlib import Path
from typing import Any

from confluent_kafka import Consumer, KafkaError, Message, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic

from nodeshare.bench.machine import machine_stamp
from nodeshare.deploy.broker import BundledBroker
from nodeshare.producers.kafka_producer import DeliveryError, EventProducer
from nodeshare.runtime.config import Settings

TOPIC = "acks"
Progress = Callable[[int, int], None]  # (records sent, total)


def ranges(values: list[int]) -> list[tuple[int, int]]:
    """Sorted values as runs of consecutive numbers, e.g. [1, 2, 3, 7] -> [(1, 3), (7, 7)]."""
    out: list[tuple[int, int]] = []
    for v in sorted(values):
        if out and v == out[-1][1] + 1:
            out[-1] = (out[-1][0], v)
        else:
            out.append((v, v))
    return out


def _read_all(bootstrap: str, expected: int, timeout_s: float = 60.0) -> list[tuple[int, int]]:
    """(number, offset) of every record the partition holds, from offset 0."""
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"nodeshare-acks-{time.time_ns()}",
                         "enable.auto.commit": False, "auto.offset.reset": "earliest"})
    consumer.assign([TopicPartition(TOPIC, 0, 0)])
    seen: list[tuple[int, int]] = []
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            batch = consumer.consume(1000, 2.0)
            if not batch and len(seen) >= expected:
                break
            seen += [(int(m.value() or b"-1"), m.offset() or 0) for m in batch if m.error() is None]
    finally:
        consumer.close()
    return seen


def run_broker_acks(records: int = 4000, workdir: Path | None = None, progress: Progress | None = None,
                    ) -> dict[str, Any]:
    """Send ``records`` numbered records, kill and restart the durable broker after half of them,
    and compare what was acknowledged with what can be read back."""
    root = Path(tempfile.mkdtemp(prefix="nodeshare-acks-")) if workdir is None else workdir
    root.mkdir(parents=True, exist_ok=True)
    acked: dict[int, int] = {}
    failed: list[tuple[int, str]] = []

    def delivered(err: KafkaError | None, msg: Message) -> None:
        n = int(msg.value() or b"-1")
        if err is None:
            acked[n] = msg.offset() or 0
        else:
            failed.append((n, str(err)))

    with BundledBroker(log_path=root / "tansu.log", data_dir=root / "data") as broker:
        admin = AdminClient({"bootstrap.servers": broker.bootstrap})
        admin.create_topics([NewTopic(TOPIC, 1, 1)])[TOPIC].result(30)
        # the project's producer (idempotent, so acks=all), waiting out the restart
        producer = EventProducer(Settings(bootstrap=broker.bootstrap), client_id="nodeshare-bench-acks",
                                 **{"message.timeout.ms": 120_000})
        acked_at_kill = 0
        for n in range(records):
            producer.send_raw(TOPIC, b"k", str(n).encode(), partition=0, on_delivery=delivered)
            if n == records // 2:
                acked_at_kill = len(acked)
                broker.kill_and_restart()
            if progress is not None and n % 100 == 0:
                progress(n, records)
            time.sleep(0.0005)  # records in flight at the kill, as a busy agent's would be
        try:
            producer.close(180)
            unflushed = 0
        except DeliveryError as exc:  # counted: each record's report says whether it was acknowledged
            unflushed = records - len(acked) - len(failed)
            failed.append((-1, str(exc)))
        seen = _read_all(broker.bootstrap, len(acked))
    numbers = [v for v, _ in seen]
    lost = sorted(set(acked) - set(numbers))
    return {
        "records": records, "acknowledged_at_kill": acked_at_kill, "acknowledged": len(acked),
        "failed": len(failed), "unflushed": unflushed, "read": len(numbers),
        "acknowledged_but_lost": len(lost), "lost_ranges": ranges(lost)[:20],
        "duplicates": len(numbers) - len(set(numbers)),
        "at_another_offset": sum(1 for v, o in seen if v in acked and acked[v] != o),
        "offsets_reused": len(seen) - len({o for _, o in seen}),
        "first_read": seen[:3], "machine": machine_stamp(), "date": date.today().isoformat(),
    }
