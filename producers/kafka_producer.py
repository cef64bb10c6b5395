"""The one producer wrapper: every record goes to its catalog topic, keyed by its key field,
through an idempotent confluent-kafka producer whose delivery reports are checked; a record for an
input topic is signed when the settings give a key or the site secret (``schemas.signing``)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Any

from confluent_kafka import KafkaError, Message, Producer

from nodeshare.runtime.config import Settings
from nodeshare.schemas import TOPIC_OF_RECORD, Record, encode, key_of
from nodeshare.schemas.signing import AUTH_HEADER

DeliveryCallback = Callable[[KafkaError | None, Message], None]


class DeliveryError(RuntimeError):
    """Some records were not acknowledged by the broker."""


class EventProducer:
    """Publishes records; ``flush()`` raises if any record was not delivered."""

    def __init__(self, settings: Settings, *, client_id: str = "nodeshare-producer", **overrides: Any) -> None:
        self._settings = settings
        self._producer = Producer(settings.client_config(**{
            "client.id": client_id,
            "enable.idempotence": True,  # acks=all, no duplicates or reordering on retry
            "linger.ms": 5,
            "batch.size": 1_000_000,
            "compression.type": "lz4",
            # Java clients and faust (aiokafka) hash keys with murmur2; so must we, or the same
            # job id would land on different partitions depending on who wrote it.
            "partitioner": "murmur2_random",
            **overrides,
        }))
        #: signs what goes to the input topics (None: the site hands out no keys)
        self._signer = settings.signer(service=f"service/{client_id}")
        self._inputs = settings.input_topics()
        self._lock = threading.Lock()
        self.delivered = 0
        self.failed: list[str] = []

    def send(self, record: Record, on_delivery: DeliveryCallback | None = None) -> None:
        spec = TOPIC_OF_RECORD[type(record)]
        identity = None
        if self._signer is not None:
            identity = self._signer.identity_for(record.kind, getattr(record, "node", None),
                                                 getattr(record, "operator", None))
        self.send_raw(self._settings.topic(spec.name), key_of(record), encode(record), identity=identity,
                      on_delivery=on_delivery)

    def send_all(self, records: Sequence[Record]) -> None:
        for record in records:
            self.send(record)

    def send_raw(self, topic: str, key: bytes | None, value: bytes | None, *, partition: int | None = None,
                 timestamp_ms: int | None = None, on_delivery: DeliveryCallback | None = None,
                 auth: bytes | None = None, identity: str | None = None) -> None:
        """Publish bytes as they are (replay, and tests that inject bad input); replay also keeps
        the original partition and timestamp. A caller that passes ``on_delivery`` handles its
        own delivery reports (the node agent's spool); they are then not counted here.

        A message to an input topic carries ``auth`` as its signature header when given (replay
        re-sends the archived one; b"": none), else this producer's own signature (as ``identity``
        when signing with the site secret), else none."""
        if auth is None and self._signer is not None and topic in self._inputs:
            auth = self._signer.header(self._inputs[topic], key, value, identity)
        headers: list[tuple[str, str | bytes | None]] | None = [(AUTH_HEADER, auth)] if auth else None
        while True:
            try:
                self._producer.produce(
                    topic, value=value, key=key, headers=headers, on_delivery=on_delivery or self._on_delivery,
                    partition=-1 if partition is None else partition,  # -1: let the partitioner choose
                    timestamp=timestamp_ms or 0,  # 0: now
                )
                break
            except BufferError:  # local queue full: serve delivery reports, then retry
                self._producer.poll(0.1)
        self._producer.poll(0)

    def poll(self, timeout: float = 0.0) -> None:
        """Serve delivery reports."""
        self._producer.poll(timeout)

    def _on_delivery(self, err: KafkaError | None, msg: Message) -> None:
        with self._lock:
            if err is None:
                self.delivered += 1
            else:
                self.failed.append(f"{msg.topic()}: {err.str()}")

    def flush(self, timeout: float = 30.0) -> None:
        remaining = self._producer.flush(timeout)
        if remaining:
            raise DeliveryError(f"{remaining} records still undelivered after {timeout:.0f} s")
        if self.failed:  # reported once: a caller that retries starts clean
            failed, self.failed = self.failed, []
            raise DeliveryError(f"{len(failed)} records failed, first: {failed[0]}")

    def close(self, timeout: float = 30.0) -> None:
        """Flush, then release the client (its threads and connections) now rather than at GC."""
        try:
            self.flush(timeout)
        finally:
            self._release()

    def release(self, timeout: float = 1.0) -> None:
        """Flush for up to ``timeout``, purge what is still undelivered and release the client
        without raising: for callers that keep their own copy of what was not acknowledged (the
        node agent's spool). Without the purge, closing waits out message.timeout.ms."""
        try:
            self._producer.flush(timeout)
            self._producer.purge()
            self._producer.poll(0)  # deliver the purge reports
        finally:
            self._release()

    def _release(self) -> None:
        if hasattr(self._producer, "close"):  # confluent-kafka >= 2.13
            self._producer.close()
        del self._producer

    def __enter__(self) -> EventProducer:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if exc_type is None:
            self.close()
        else:  # do not mask the original error, but still try to deliver what was accepted
            self._producer.flush(5.0)
            del self._producer
