"""Reading topics in tests: by content, with a deadline (never by end offsets: docs/broker.md)."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable

from confluent_kafka import Consumer, Message

from nodeshare.runtime.config import Settings


def read_until(settings: Settings, topic: str, done: Callable[[list[Message]], bool],
               deadline_s: float = 60.0) -> list[Message]:
    """Read a topic from the beginning until ``done(messages)`` or the deadline (then fail)."""
    consumer = Consumer(settings.client_config(**{
        "group.id": f"test-reader-{uuid.uuid4().hex[:8]}", "auto.offset.reset": "earliest",
        "enable.auto.commit": False, "session.timeout.ms": settings.session_timeout_ms,
    }))
    consumer.subscribe([settings.topic(topic)])
    got: list[Message] = []
    end = time.monotonic() + deadline_s
    try:
        while time.monotonic() < end:
            got += [m for m in consumer.consume(500, timeout=0.5) if m.error() is None]
            if done(got):
                return got
    finally:
        consumer.close()
    raise AssertionError(f"{topic}: condition not met within {deadline_s:.0f} s ({len(got)} messages read)")
