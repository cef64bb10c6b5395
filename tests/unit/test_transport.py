"""The stream worker's faust consumer asks the broker to hold an empty fetch for 100 ms, not 1.5 s."""

from __future__ import annotations

import asyncio
from pathlib import Path

from nodeshare.runtime.config import Settings
from nodeshare.streams.worker.app import make_app
from nodeshare.streams.worker.transport import FETCH_MAX_WAIT_MS, Transport


def test_worker_consumer_waits_at_most_the_short_fetch_wait(tmp_path: Path) -> None:
    app = make_app(Settings.model_validate({"bootstrap": "127.0.0.1:1"}), datadir=tmp_path)
    assert isinstance(app.transport, Transport)

    async def build() -> int:  # aiokafka builds its consumer only inside a running loop; nothing connects
        consumer = app.consumer._thread._create_worker_consumer(app.transport)
        return consumer._fetch_max_wait_ms

    assert FETCH_MAX_WAIT_MS == 100
    assert asyncio.run(build()) == 100


def test_the_count_only_yardstick_is_configured_as_the_worker_with_one_agent_on_node_ipc(tmp_path: Path) -> None:
    from nodeshare.streams.worker.app import make_counting_app

    settings = Settings.model_validate({"bootstrap": "127.0.0.1:1", "topic_prefix": "t."})
    app = make_counting_app(settings, datadir=tmp_path)
    assert isinstance(app.transport, Transport)  # same consumer settings as the worker it is compared with
    [agent] = app.agents.values()
    assert agent.name == "count-only"
    assert agent.channel.topics == ("t.node.ipc",)
