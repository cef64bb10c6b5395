"""The faust application: thin shells that move bytes between topics and the pure core.

Agent ``job-accounting`` consumes ``node.ipc`` and ``jobs.lifecycle`` (co-partitioned by job
id), folds each event into the job's ``JobAccount`` (streams.accounting) held in a faust
Table, and publishes what the fold produced: charges, degradation estimates, dead letters.
Exactly-once does not come from the broker (faust's exactly_once fails on Tansu, see
BROKER.md) but from the reducer's offset de-duplication and the ledger's idempotent key.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import faust

from nodeshare.config import Settings
from nodeshare.schemas.catalog import DLQ, ESTIMATES_DEGRADATION, JOBS_LIFECYCLE, LEDGER_CHARGES, NODE_IPC

from .accounting import Origin, process_message


def make_app(settings: Settings, datadir: Path | None = None) -> faust.App:
    if not settings.bootstrap:
        raise RuntimeError("the stream worker needs a broker: set NODESHARE_BOOTSTRAP")
    app = faust.App(
        settings.app_id,
        broker=[f"kafka://{h.strip()}" for h in settings.bootstrap.split(",")],
        store="memory://",  # tables are rebuilt from their changelog topics on start
        processing_guarantee="at_least_once",
        topic_partitions=settings.partitions,
        broker_session_timeout=settings.session_timeout_ms / 1000,
        broker_heartbeat_interval=1.0,
        consumer_auto_offset_reset="earliest",
        producer_acks=-1,
        web_enabled=False,
        key_serializer="raw",  # topics and tables carry bytes; nodeshare's serde does the JSON
        value_serializer="raw",
        datadir=str(datadir or Path.cwd() / ".nodeshare-worker"),
    )
    policy = settings.policy()
    prefix = settings.topic_prefix

    def raw_topic(*names: str) -> Any:
        return app.topic(*[settings.topic(n) for n in names], key_serializer="raw", value_serializer="raw")

    inputs = raw_topic(NODE_IPC.name, JOBS_LIFECYCLE.name)
    outputs = {t.name: raw_topic(t.name) for t in (LEDGER_CHARGES, ESTIMATES_DEGRADATION, DLQ)}
    accounts = app.Table("job-accounts", default=None, partitions=settings.partitions)

    @app.agent(inputs, name="job-accounting")
    async def job_accounting(stream: Any) -> None:
        async for event in stream.events():
            msg = event.message
            origin = Origin(msg.topic, msg.partition, msg.offset)
            key = event.key
            state = accounts.get(key) if key is not None else None
            new_state, out = process_message(state, origin, key, event.value, msg.timestamp, policy, prefix)
            if new_state is not None:
                accounts[key] = new_state
            for o in out:
                await outputs[o.topic].send(key=o.key, value=o.value)

    return app


def run_worker(settings: Settings, datadir: Path | None = None, loglevel: str = "warning") -> None:
    """Run one stream worker in the foreground until SIGTERM/SIGINT."""
    app = make_app(settings, datadir)
    # The web server is off (BROKER.md: it would bind 0.0.0.0:6066 otherwise).
    sys.argv = ["nodeshare-worker", "worker", "--without-web", "--loglevel", loglevel]
    app.main()
