"""`topics create` sets each topic's retention (issue 42, item 4), on a real broker."""

from __future__ import annotations

import pytest
from confluent_kafka.admin import AdminClient, ConfigResource

from nodeshare.deploy.topics import RETENTION_MS, create_topics
from nodeshare.runtime.config import Settings
from nodeshare.schemas import TOPICS
from nodeshare.schemas.catalog import INTERNAL_TOPICS

pytestmark = pytest.mark.integration


def test_topics_are_created_with_their_retention(settings: Settings):
    create_topics(settings)
    names = [t.name for t in TOPICS] + list(INTERNAL_TOPICS)
    admin = AdminClient(settings.client_config())
    futures = admin.describe_configs([ConfigResource(ConfigResource.Type.TOPIC, settings.topic(n)) for n in names])
    got = {res.name: fut.result(timeout=15)["retention.ms"].value for res, fut in futures.items()}
    assert got == {settings.topic(n): str(RETENTION_MS[n]) for n in names}
    # the fold rebuilds from its snapshots (kept), so its inputs may expire (issue 44)
    assert got[settings.topic("node.ipc")] == got[settings.topic("jobs.lifecycle")] == str(30 * 86_400_000)
    assert got[settings.topic("accounting.snapshots")] == "-1"
