"""A real Kafka-protocol broker for integration tests.

Order: NODESHARE_TEST_BOOTSTRAP if set; a testcontainers Kafka if a Docker engine answers;
else the bundled Tansu. Tests share one broker and isolate themselves by topic prefix.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from nodeshare.deploy.broker import BundledBroker, wait_for_metadata
from nodeshare.runtime.config import Settings


def _docker_answers() -> bool:
    try:
        import docker

        docker.from_env(timeout=2).ping()
        return True
    except Exception:
        return False


@pytest.fixture(scope="session")
def kafka_bootstrap(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    configured = os.environ.get("NODESHARE_TEST_BOOTSTRAP")
    if configured:
        wait_for_metadata(configured)
        yield configured
    elif _docker_answers():
        from testcontainers.kafka import KafkaContainer

        with KafkaContainer().with_kraft() as kafka:
            yield kafka.get_bootstrap_server()
    else:
        log = tmp_path_factory.mktemp("broker") / "tansu.log"
        with BundledBroker(log_path=log) as broker:
            yield broker.bootstrap


@pytest.fixture
def settings(kafka_bootstrap: str) -> Settings:
    """Settings with topics and consumer groups of this test's own."""
    run = uuid.uuid4().hex[:8]
    return Settings(bootstrap=kafka_bootstrap, topic_prefix=f"t{run}.", app_id=f"nodeshare-t{run}", partitions=4)


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    return tmp_path
