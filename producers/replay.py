"""Replay: re-publish the archive into a broker so that every derived state can be rebuilt.

Each archived event goes back to the partition it was read from, with its original key,
bytes and timestamp, in offset order. Into fresh topics with the same partition counts, the
replayed events get their original offsets back, so the rebuilt charges (offset ranges
included) equal the originals.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from confluent_kafka.admin import AdminClient

from nodeshare.config import Settings
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
            producer.send_raw(settings.topic(topic), ev.key, ev.value, partition=ev.partition,
                              timestamp_ms=ev.timestamp_ms)
            report.events += 1
            report.per_topic[topic] = report.per_topic.get(topic, 0) + 1
            if progress and report.events % 1000 == 0:
                progress(report.events, total)
    if progress:
        progress(report.events, report.events)
    return report


def _check_partitions(archive: ParquetArchive, settings: Settings, names: list[str]) -> None:
    metadata = AdminClient(settings.client_config()).list_topics(timeout=30)
    needed: dict[str, int] = {}
    for (topic, partition), _ in archive.high_water().items():
        if topic in names:
            needed[topic] = max(needed.get(topic, 0), partition + 1)
    for topic, count in sorted(needed.items()):
        meta = metadata.topics.get(settings.topic(topic))
        if meta is None:
            raise ReplayError(f"target topic {settings.topic(topic)} does not exist: run `nodeshare topics create`")
        if len(meta.partitions) < count:
            raise ReplayError(f"{settings.topic(topic)} has {len(meta.partitions)} partitions; the archive needs "
                              f"{count} to keep every event on its original partition")
