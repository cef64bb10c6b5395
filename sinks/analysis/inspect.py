"""Operator views of the topics themselves: the catalog on the broker, and the dead letters."""

from __future__ import annotations

import base64
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from confluent_kafka import OFFSET_BEGINNING, OFFSET_END, Consumer, TopicPartition
from confluent_kafka.admin import AdminClient, ConfigResource

from nodeshare.runtime.config import Settings
from nodeshare.schemas import TOPICS, DeadLetter, DecodeError, decode_model


@dataclass(frozen=True)
class TopicState:
    name: str
    exists: bool
    partitions: int | None
    cleanup_policy: str | None  # as the broker reports it; None when it does not say
    expected_cleanup_policy: str


def describe_topics(settings: Settings, timeout_s: float = 15.0) -> list[TopicState]:
    admin = AdminClient(settings.client_config())
    meta = admin.list_topics(timeout=timeout_s).topics
    names = [settings.topic(t.name) for t in TOPICS]
    policies: dict[str, str | None] = {}
    present = [n for n in names if n in meta]
    if present:
        futures = admin.describe_configs([ConfigResource(ConfigResource.Type.TOPIC, n) for n in present])
        for res, fut in futures.items():
            try:
                entry = fut.result(timeout=timeout_s).get("cleanup.policy")
                policies[res.name] = entry.value if entry is not None else None
            except Exception:  # a broker that does not describe configs: say nothing rather than guess
                policies[res.name] = None
    return [TopicState(settings.topic(t.name), settings.topic(t.name) in meta,
                       len(meta[settings.topic(t.name)].partitions) if settings.topic(t.name) in meta else None,
                       policies.get(settings.topic(t.name)), t.cleanup_policy) for t in TOPICS]


@dataclass
class DeadLetterSummary:
    """The dead-letter topic as an operator reads it. A worker that restarts re-applies the input
    after its last committed offset and dead-letters those records again: each refused input
    (origin topic, partition, offset) counts once in ``total`` and by reason and origin; the
    copies are counted apart, in ``resent``."""

    total: int = 0
    by_reason: Counter[str] = field(default_factory=Counter)
    by_origin: Counter[str] = field(default_factory=Counter)
    first: list[DeadLetter] = field(default_factory=list)
    undecodable: int = 0  # records on the dead-letter topic that are not dead letters themselves
    resent: int = 0  # copies of a dead letter already counted (the same input, refused again)
    _seen: set[tuple[str, int | None, int | None]] = field(default_factory=set, repr=False)

    def add(self, value: bytes, first: int) -> None:
        """Count one record of the dead-letter topic."""
        try:
            dl = decode_model(DeadLetter, value)
        except DecodeError:
            self.undecodable += 1
            return
        origin = (dl.origin_topic, dl.origin_partition, dl.origin_offset)
        if dl.origin_offset is not None and origin in self._seen:
            self.resent += 1
            return
        self._seen.add(origin)
        self.total += 1
        self.by_reason[dl.reason] += 1
        self.by_origin[dl.origin_topic] += 1
        if len(self.first) < first:
            self.first.append(dl)

    def as_dict(self) -> dict[str, Any]:
        return {
            "total": self.total, "resent": self.resent, "undecodable": self.undecodable,
            "by_reason": dict(self.by_reason.most_common()), "by_origin": dict(self.by_origin.most_common()),
            "first": [{"origin": f"{d.origin_topic}[{d.origin_partition}]@{d.origin_offset}", "reason": d.reason,
                       "field": d.field, "value": preview(d.value_b64)} for d in self.first],
        }


def preview(value_b64: str, limit: int = 80) -> str:
    raw = base64.b64decode(value_b64)
    text = raw[:limit].decode("utf-8", errors="backslashreplace")
    return text + ("..." if len(raw) > limit else "")


def read_dead_letters(settings: Settings, *, first: int = 10, idle_s: float = 3.0,
                      max_s: float = 120.0) -> DeadLetterSummary:
    """Read the dead-letter topic from the beginning until it has been quiet for ``idle_s``
    (this broker's end offsets cannot be trusted to say where the topic ends)."""
    consumer = Consumer(settings.client_config(**{
        "group.id": f"nodeshare-dlq-reader-{uuid.uuid4().hex[:8]}", "auto.offset.reset": "earliest",
        "enable.auto.commit": False, "session.timeout.ms": settings.session_timeout_ms}))
    consumer.subscribe([settings.topic("dlq")])
    summary = DeadLetterSummary()
    start = last = time.monotonic()
    try:
        while time.monotonic() - last < idle_s + (settings.session_timeout_ms / 1000 if not summary.total
                                                   and not summary.undecodable else 0):
            if time.monotonic() - start > max_s:
                break
            for m in consumer.consume(1000, timeout=0.5):
                if m.error() is not None:
                    continue
                last = time.monotonic()
                summary.add(m.value() or b"", first)
    finally:
        consumer.close()
    return summary


def format_decision(record: Any) -> str:
    """One line per decision: what a scheduler must apply."""
    from nodeshare.schemas.events import PowerDecision

    if not isinstance(record, PowerDecision):
        return str(record.model_dump_json())
    when = record.event_time.strftime("%Y-%m-%dT%H:%M:%S")
    head = f"{when} {record.job_id:<12} {record.action.value:<7}"
    plan = ""
    if record.plan is not None:
        caps = " ".join(f"{c.node}:{c.processor}={c.cap_watts:.1f}" for c in record.plan.caps)
        plan = f" budget={record.plan.budget_watts:.1f}W n={len(record.plan.caps)} caps[{caps}]"
    updates = ""
    if record.running_updates:
        updates = " re-tuned[" + " ".join(f"{u.job_id}={u.budget_watts:.1f}W" for u in record.running_updates) + "]"
    machine = f" machine={record.machine_allocated_watts:.1f}/{record.machine_budget_watts:.1f}W"
    return f"{head}{plan}{updates}{machine} ({record.reason})"


def tail_decisions(settings: Settings, topic: str, *, from_beginning: bool = False, limit: int | None = None,
                   idle_exit_s: float | None = None, as_json: bool = False) -> Any:
    """Yield decisions of a decision topic as they arrive (a fresh consumer group: it commits nothing)."""
    from nodeshare.schemas.catalog import BY_NAME
    from nodeshare.schemas.serde import decode

    spec = BY_NAME[topic]
    consumer = Consumer(settings.client_config(**{
        "group.id": f"nodeshare-tail-{uuid.uuid4().hex[:8]}", "enable.auto.commit": False,
        "auto.offset.reset": "earliest" if from_beginning else "latest"}))
    name = settings.topic(topic)
    meta = consumer.list_topics(name, timeout=15).topics.get(name)
    if meta is None or meta.error is not None or not meta.partitions:
        consumer.close()
        raise RuntimeError(f"topic {name} does not exist on {settings.bootstrap}; run `nodeshare topics create`")
    start = OFFSET_BEGINNING if from_beginning else OFFSET_END
    consumer.assign([TopicPartition(name, p, start) for p in sorted(meta.partitions)])  # no group to join
    seen: set[str] = set()  # decisions are re-published after a worker restart: same event id
    shown, last = 0, time.monotonic()
    try:
        while limit is None or shown < limit:
            msg = consumer.poll(0.5)
            if msg is None or msg.error() is not None:
                if idle_exit_s is not None and time.monotonic() - last > idle_exit_s:
                    return
                continue
            last = time.monotonic()
            try:
                record = decode(spec, msg.value())
            except DecodeError as exc:
                yield f"undecodable record at {msg.topic()}[{msg.partition()}]@{msg.offset()}: {exc}"
                continue
            if record.event_id in seen:
                continue
            seen.add(record.event_id)
            shown += 1
            yield record.model_dump_json() if as_json else format_decision(record)
    finally:
        consumer.close()
