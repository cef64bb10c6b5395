"""Create the catalog's topics, idempotently, and keep the charge fold's inputs co-partitioned.

``node.ipc`` and ``jobs.lifecycle`` must have the same partition count: the charge fold finds a
job's events by partition number (streams/worker/fold_consumer.py). Topics that exist are not
taken as they are: a missing input topic is created with the count of the one that exists, and
input topics whose counts differ are refused, or grown to one count when asked
(``grow_inputs_to``; the procedure around it is in deploy/SCALING.md, Adding partitions).
"""

from __future__ import annotations

from collections.abc import Mapping

from confluent_kafka import KafkaError, KafkaException
from confluent_kafka.admin import AdminClient, NewPartitions, NewTopic

from nodeshare.runtime.config import Settings
from nodeshare.schemas import TOPICS
from nodeshare.schemas.catalog import INTERNAL_CLEANUP, INTERNAL_TOPICS
from nodeshare.streams.worker.copartition import copartition_problem
from nodeshare.streams.worker.cursor import accounting_topics

DAY_MS = 86_400_000
#: ``retention.ms`` each topic is created with (-1: kept for ever), by catalog name. Why each value,
#: and how to change one on a running cluster: docs/operations.md, "Topic retention".
RETENTION_MS: dict[str, int] = {
    # The charge fold rebuilds a partition from its newest snapshot (accounting.snapshots, every
    # 50,000 messages or 600 s) and refuses one whose log no longer holds what follows it
    # (docs/reliability.md): 30 days outlive a snapshot, the archive sink's outage and a worker's.
    "node.ipc": 30 * DAY_MS,
    "jobs.lifecycle": 30 * DAY_MS,
    # Read by the sinks (archived, co-runner counts) and the placement manager: a week covers a sink's outage.
    "node.shutter": 7 * DAY_MS,
    "node.llc": 7 * DAY_MS,
    "node.power": 7 * DAY_MS,
    # Compacted: the latest record per key is the state; nothing expires.
    "cluster.inventory": -1,
    "estimates.degradation": -1,
    "profiles.program": -1,
    "decisions.power.nodes": -1,  # each node's latest caps: an agent starting after decisions.power's retention
    "decisions.placement.nodes": -1,  # each node's cache shares: what an agent with --resctrl reads
    # Read from their end by agents, whose state is the compacted ``.nodes`` topics above; the Slurm
    # adapter follows them live. 30 days: a tail for operators (``decisions tail``) and audits.
    "decisions.power": 30 * DAY_MS,
    "decisions.placement": 30 * DAY_MS,
    "power.machine": 30 * DAY_MS,  # the managers' logs: a restart folds only what follows their snapshot
    "placement.cluster": 30 * DAY_MS,
    # Compacted: each manager's latest snapshot (streams/core/snapshot.py) is its state; kept for ever.
    "power.machine.snapshots": -1,
    "placement.cluster.snapshots": -1,
    "accounting.snapshots": -1,  # the charge fold's accounts per input partition (compacted)
    # Compacted: settled jobs' accounts, one key per state a job left memory in, read back when a
    # late record of the job comes (a correction, a lost node's data) at any time: kept for ever.
    "accounting.settled": -1,
    # The ledger and the dead-letter report read these; the ledger is the record.
    "ledger.charges": 30 * DAY_MS,
    "dlq": 30 * DAY_MS,
}


def topic_config(name: str, cleanup_policy: str) -> dict[str, str]:
    """The configuration a catalog or internal topic is created with."""
    return {"cleanup.policy": cleanup_policy, "retention.ms": str(RETENTION_MS[name])}


class TopicsError(RuntimeError):
    """The topics on the broker cannot be made what the catalog needs without an operator's step."""


def input_partition_count(existing: Mapping[str, int], default: int, grow_to: int | None = None) -> int:
    """The partition count of the co-partitioned input topics, given the counts of those that exist
    (topic -> count): theirs when they agree, ``default`` when none exists, ``grow_to`` when asked.
    Raises TopicsError when they differ and no growth was asked, or when it would shrink one."""
    if grow_to is not None:
        if grow_to < max(existing.values(), default=0):
            raise TopicsError(f"cannot grow the input topics to {grow_to} partitions: "
                              + " and ".join(f"{t} has {n}" for t, n in existing.items())
                              + ", and Kafka only adds partitions")
        return grow_to
    problem = copartition_problem(existing)
    if problem is not None:
        raise TopicsError(f"{problem}. Nothing was created or changed")
    return next(iter(existing.values()), default)


def create_topics(settings: Settings, timeout_s: float = 30.0, *,
                  grow_inputs_to: int | None = None) -> dict[str, str]:
    """Create every catalog topic that does not exist yet; returns topic -> 'created' | 'exists' |
    'grown'. The input topics get one partition count (``input_partition_count``): with
    ``grow_inputs_to`` both are grown to it, only after the steps of deploy/SCALING.md."""
    admin = AdminClient(settings.client_config())
    metadata = admin.list_topics(timeout=timeout_s).topics
    inputs = accounting_topics(settings)
    counts = {name: len(metadata[name].partitions) for name in inputs if name in metadata}
    n_inputs = input_partition_count(counts, settings.partitions, grow_inputs_to)  # refuses before any change
    existing = set(metadata)
    wanted = [
        NewTopic(name, num_partitions=n_inputs if name in inputs else t.partitions or settings.partitions,
                 replication_factor=-1,  # the broker's default (1 locally, 3 on a production cluster)
                 config=topic_config(t.name, t.cleanup_policy))
        for t in TOPICS if (name := settings.topic(t.name)) not in existing
    ] + [
        NewTopic(settings.topic(name), num_partitions=n, replication_factor=-1,
                 config=topic_config(name, INTERNAL_CLEANUP.get(name, "delete")))
        for name, n in INTERNAL_TOPICS.items() if settings.topic(name) not in existing
    ]
    names = [settings.topic(t.name) for t in TOPICS] + [settings.topic(n) for n in INTERNAL_TOPICS]
    result = {name: "exists" for name in names if name in existing}
    result.update(_grow({name: n for name, n in counts.items() if n < n_inputs}, n_inputs, admin, timeout_s))
    if wanted:
        for name, fut in admin.create_topics(wanted, request_timeout=timeout_s).items():
            try:
                fut.result()
                result[name] = "created"
            except KafkaException as exc:
                if exc.args[0].code() != KafkaError.TOPIC_ALREADY_EXISTS:  # lost a race: still fine
                    raise
                result[name] = "exists"
    return result


def _grow(smaller: dict[str, int], partitions: int, admin: AdminClient, timeout_s: float) -> dict[str, str]:
    """Add partitions to the given input topics (topic -> count now) up to ``partitions``."""
    if not smaller:
        return {}
    futures = admin.create_partitions([NewPartitions(name, partitions) for name in smaller],
                                      request_timeout=timeout_s)
    for name, fut in futures.items():
        try:
            fut.result()
        except KafkaException as exc:
            unsupported = exc.args[0].code() == KafkaError._UNSUPPORTED_FEATURE
            raise TopicsError(f"could not grow {name} from {smaller[name]} to {partitions} partitions: "
                              f"{exc.args[0].str()}"
                              + ("; this broker cannot add partitions (the bundled Tansu cannot): create the "
                                 "topics anew with the count you need (deploy/SCALING.md)" if unsupported else "")
                              ) from None
    return {name: "grown" for name in smaller}
