"""Create the catalog's topics, idempotently."""

from __future__ import annotations

from confluent_kafka import KafkaError, KafkaException
from confluent_kafka.admin import AdminClient, NewTopic

from nodeshare.config import Settings
from nodeshare.schemas import TOPICS
from nodeshare.schemas.catalog import INTERNAL_TOPICS


def create_topics(settings: Settings, timeout_s: float = 30.0) -> dict[str, str]:
    """Create every catalog topic that does not exist yet; returns topic -> 'created' | 'exists'."""
    admin = AdminClient(settings.client_config())
    existing = set(admin.list_topics(timeout=timeout_s).topics)
    wanted = [
        NewTopic(settings.topic(t.name), num_partitions=t.partitions or settings.partitions,
                 replication_factor=-1,  # the broker's default (1 locally, 3 on a production cluster)
                 config={"cleanup.policy": t.cleanup_policy})
        for t in TOPICS if settings.topic(t.name) not in existing
    ] + [
        NewTopic(settings.topic(name), num_partitions=n, replication_factor=-1, config={"cleanup.policy": "delete"})
        for name, n in INTERNAL_TOPICS.items() if settings.topic(name) not in existing
    ]
    names = [settings.topic(t.name) for t in TOPICS] + [settings.topic(n) for n in INTERNAL_TOPICS]
    result = {name: "exists" for name in names if name in existing}
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
