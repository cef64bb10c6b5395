"""Co-partitioning of the charge fold's input topics, checked (issue 44): the fold keeps a job's
account by partition number, so ``node.ipc`` and ``jobs.lifecycle`` must have the same partition
count, and a record must sit on the partition its key hashes to (murmur2, Kafka's default
partitioner). ``streams.worker.fold_consumer`` refuses to run otherwise; ``topics create`` and
``deploy/SCALING.md`` use the same rule."""

from __future__ import annotations

from collections.abc import Mapping
from functools import lru_cache

from aiokafka.partitioner import murmur2
from confluent_kafka import Consumer
from confluent_kafka.admin import AdminClient

from nodeshare.runtime.config import Settings

from .cursor import accounting_topics


class NotCoPartitioned(RuntimeError):
    """The charge fold's input topics have different partition counts."""


def copartition_problem(counts: Mapping[str, int]) -> str | None:
    """Why the charge fold cannot run on input topics with these partition counts (topic name ->
    count, for the topics that exist), or None when they agree. The fold keeps a job's account
    by partition number: with different counts a job's two topics put it on different numbers,
    and it would never be charged."""
    if len(set(counts.values())) < 2:
        return None
    most = max(counts.values())
    said = " and ".join(f"{topic} has {n} partitions" for topic, n in counts.items())
    grow = " and ".join(f"{topic} from {n}" for topic, n in counts.items() if n < most)
    return (f"{said}: the charge fold needs them co-partitioned (the same count), or a job whose two topics "
            f"put it on different partition numbers is never charged. Grow {grow} to {most} partitions "
            f"(deploy/SCALING.md, Adding partitions), then start the worker again")


@lru_cache(maxsize=1 << 16)
def kafka_partition(key: bytes, partitions: int) -> int:
    """The partition Kafka's default partitioner (Java's, librdkafka's ``murmur2_random``, faust's)
    gives ``key`` among ``partitions``. Cached: a job's id comes back with each of its batches."""
    return (murmur2(key) & 0x7FFFFFFF) % partitions


def routing_problem(key: bytes | None, partition: int, partitions: int) -> str | None:
    """Why a record read from ``partition`` (of ``partitions``) cannot be folded there, or None.
    A record without a key is left to the reducer, which refuses it (its key is not its job id)."""
    if key is None:
        return None
    expected = kafka_partition(key, partitions)
    if expected == partition:
        return None
    return (f"misrouted: key {key[:64]!r} hashes (murmur2) to partition {expected} of {partitions}, "
            f"read from partition {partition}; its producer does not partition as Kafka's default does: "
            f"re-publish these bytes with a murmur2 partitioner")


def input_partitions(settings: Settings, client: Consumer | AdminClient | None = None,
                     timeout_s: float = 30.0) -> dict[str, int]:
    """The partition count of each input topic of the charge fold that exists on the broker now;
    raises NotCoPartitioned when they differ (KafkaException without metadata). Reads every topic's
    metadata: asking for one by name may create it on a broker that creates topics on demand."""
    topics = (client or AdminClient(settings.client_config())).list_topics(timeout=timeout_s).topics
    counts = {t: len(topics[t].partitions) for t in accounting_topics(settings) if t in topics}
    problem = copartition_problem(counts)
    if problem is not None:
        raise NotCoPartitioned(problem)
    return counts
