"""Replay: re-publish the archive into a broker so that every derived state can be rebuilt.

Each archived event goes back with its original key, bytes and timestamp, in offset order, to
the partition Kafka's default partitioner (murmur2, as every producer of ours) gives its key
among the target topic's partitions. Into fresh topics with the same partition counts that is the
partition it was read from, so the replayed events get their original offsets back and the
rebuilt charges (offset ranges included) equal the originals. Into topics with more partitions
(a cluster that grew), each job's records land together on the partition its key gives there, as
the worker requires (a record kept on its old partition number would be a ``misrouted`` dead
letter); only the offset ranges in the charges differ. A record its producer had misrouted goes
where murmur2 puts it, so a replay charges what the original run dead-lettered as misrouted (the
remedy docs/topics.md gives). An event without a key keeps its partition, which must exist.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from confluent_kafka.admin import AdminClient

from nodeshare.runtime.config import Settings
from nodeshare.schemas import INPUT_TOPICS
from nodeshare.sinks.archive import ParquetArchive

from .kafka_producer import EventProducer


class ReplayError(RuntimeError):
    pass


@dataclass
class ReplayReport:
    events: int = 0
    per_topic: dict[str, int] = field(default_factory=dict)


def replay(archive_root: Path, settings: Settings, *, topics: list[str] | None = None,
           progress: Callable[[int, int], None] | None = None) -> ReplayReport:
    """Publish the archived events of ``topics`` (default: every input topic) to the broker in
    ``settings``, under its topic prefix. The target topics must exist and be empty."""
    archive = ParquetArchive(archive_root)
    names = topics or [t.name for t in INPUT_TOPICS]
    _check_partitions(archive, settings, names)
    total = archive.count()
    report = ReplayReport()
    with EventProducer(settings, client_id="nodeshare-replay") as producer:
        for topic, ev in archive.events(names):
            # the signature as archived, never a new one: a replay must not vouch for what it re-sends
            producer.send_raw(settings.topic(topic), ev.key, ev.value,
                              partition=ev.partition if ev.key is None else None, timestamp_ms=ev.timestamp_ms,
                              auth=ev.auth or b"")
            report.events += 1
            report.per_topic[topic] = report.per_topic.get(topic, 0) + 1
            if progress and report.events % 1000 == 0:
                progress(report.events, total)
    if progress:
        progress(report.events, report.events)
    return report


def _check_partitions(archive: ParquetArchive, settings: Settings, names: list[str]) -> None:
    metadata = AdminClient(settings.client_config()).list_topics(timeout=30)
    needed = {topic: max(held) + 1 for topic in names if (held := archive.partitions_held([topic]))}  # file names only
    for topic, count in sorted(needed.items()):
        meta = metadata.topics.get(settings.topic(topic))
        if meta is None:
            raise ReplayError(f"target topic {settings.topic(topic)} does not exist: run `nodeshare topics create`")
        if len(meta.partitions) < count and archive_has_keyless(archive, topic):
            raise ReplayError(f"{settings.topic(topic)} has {len(meta.partitions)} partitions; the archive's events "
                              f"without a key need {count} to keep their original partitions")


def archive_has_keyless(archive: ParquetArchive, topic: str) -> bool:
    """Whether any archived event of ``topic`` has no key (it is replayed to its own partition)."""
    return any(ev.key is None for _, ev in archive.events([topic]))
