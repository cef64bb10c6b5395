"""Building dead-letter records: one constructor for every component that refuses input."""

from __future__ import annotations

import base64
import uuid
from datetime import UTC, datetime

from .events import DeadLetter, RowProblem

#: Namespace of the deterministic (uuid5) event ids nodeshare derives from what it read.
NODESHARE_NAMESPACE = uuid.UUID("4f0c6a52-1d1e-4b8e-9d2a-6c0e3b7a9f15")


def dead_letter(topic: str, partition: int | None, offset: int | None, key: bytes | None, value: bytes | None,
                timestamp_s: float, reason: str, *, field: str | None = None, source: str,
                rows: tuple[RowProblem, ...] = ()) -> DeadLetter:
    """A dead letter for bytes read at (topic, partition, offset). Its id derives from the origin,
    so a redelivered bad message produces the same dead letter, not a second one."""
    return DeadLetter(
        event_id=str(uuid.uuid5(NODESHARE_NAMESPACE, f"dlq:{topic}:{partition}:{offset}")),
        source=source,
        event_time=datetime.fromtimestamp(timestamp_s, UTC),
        origin_topic=topic, origin_partition=partition, origin_offset=offset,
        reason=reason[:256] or "rejected", field=field,
        key_b64=base64.b64encode(key).decode() if key is not None else None,
        value_b64=base64.b64encode(value or b"").decode(),
        rows=rows,
    )
