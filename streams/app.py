"""The faust application: thin shells that move bytes between topics and the pure core.

Agent ``job-accounting`` consumes ``node.ipc`` and ``jobs.lifecycle`` (co-partitioned by job
id), folds each event into the job's ``JobAccount`` (streams.accounting) held in a faust
Table, and publishes what the fold produced: charges, degradation estimates, dead letters.
Exactly-once does not come from the broker (faust's exactly_once fails on Tansu, see
BROKER.md) but from the reducer's offset de-duplication and the ledger's idempotent key.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import faust
from confluent_kafka import Consumer, TopicPartition

from nodeshare import logs, metrics
from nodeshare.config import Settings
from nodeshare.schemas.catalog import (
    CLUSTER_INVENTORY,
    DECISIONS_PLACEMENT,
    DECISIONS_POWER,
    DLQ,
    ESTIMATES_DEGRADATION,
    JOBS_LIFECYCLE,
    LEDGER_CHARGES,
    NODE_IPC,
    NODE_LLC,
    NODE_POWER,
    PROFILES_PROGRAM,
    TOPIC_OF_RECORD,
    TopicSpec,
    key_of,
)
from nodeshare.schemas.serde import encode

from .accounting import Origin, fold_states, process_message
from .kafka_security import faust_credentials
from .placement.stream import PLACEMENT_LOG, ROUTED, PlacementManager
from .power.stream import POWER_LOG, PowerManager, envelope, open_envelope, screen

log = logging.getLogger(__name__)

def read_range(settings: Settings, topic: str, partition: int, start: int, stop: int,
               timeout_s: float = 60.0) -> list[tuple[Origin, bytes | None, bytes | None, float]]:
    """Messages [start, stop) of one topic partition, in offset order. Waits on content, never on
    end offsets (wrong on the bundled broker); raises if the range cannot be read in time."""
    consumer = Consumer(settings.client_config(**{
        "group.id": f"{settings.app_id}-repair", "enable.auto.commit": False, "auto.offset.reset": "earliest"}))
    consumer.assign([TopicPartition(topic, partition, start)])
    out: list[tuple[Origin, bytes | None, bytes | None, float]] = []
    deadline = time.monotonic() + timeout_s
    try:
        while (not out or out[-1][0].offset < stop - 1) and time.monotonic() < deadline:
            for m in consumer.consume(5000, timeout=0.5):
                if m.error() is None and start <= (m.offset() or 0) < stop:
                    out.append((Origin(topic, partition, m.offset() or 0), m.key(), m.value(), m.timestamp()[1] / 1000))
    finally:
        consumer.close()
    if stop > start and (not out or out[-1][0].offset < stop - 1):
        raise RuntimeError(f"could not re-read {topic}[{partition}] offsets {start}..{stop - 1} within "
                           f"{timeout_s:.0f} s; rebuild from the archive with `nodeshare replay`")
    return out


def committed_offset(settings: Settings, topic: str, partition: int) -> int:
    """The stream worker group's committed offset of a partition (0 when none)."""
    consumer = Consumer(settings.client_config(**{"group.id": settings.app_id, "enable.auto.commit": False}))
    try:
        [tp] = consumer.committed([TopicPartition(topic, partition)], timeout=10)
        return max(0, tp.offset)
    finally:
        consumer.close()


def _job_id(key: bytes | None) -> str | None:
    """A message key as a log field: input keys are job ids, but a bad message's key may be anything."""
    return None if key is None else key[:64].decode("utf-8", "replace")


def make_app(settings: Settings, datadir: Path | None = None, loglevel: str = "warning") -> faust.App:
    if not settings.bootstrap:
        raise RuntimeError("the stream worker needs a broker: set NODESHARE_BOOTSTRAP")
    app = faust.App(
        settings.app_id,
        broker=[f"kafka://{h.strip()}" for h in settings.bootstrap.split(",")],
        broker_credentials=faust_credentials(settings.kafka),  # TLS / SASL as every other client has them
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
        # faust's worker installs this instead of its coloured handler: the operator's format, secrets masked
        logging_config=logs.dict_config(settings.log_format, loglevel, settings.secret_values(),
                                        logs.fields(component="worker")),
    )
    policy = settings.policy()
    prefix = settings.topic_prefix

    def raw_topic(*names: str) -> Any:
        return app.topic(*[settings.topic(n) for n in names], key_serializer="raw", value_serializer="raw")

    inputs = raw_topic(NODE_IPC.name, JOBS_LIFECYCLE.name)
    outputs = {t.name: raw_topic(t.name) for t in (LEDGER_CHARGES, ESTIMATES_DEGRADATION, DLQ)}
    accounts = app.Table("job-accounts", default=None, partitions=settings.partitions)
    input_topics = [settings.topic(NODE_IPC.name), settings.topic(JOBS_LIFECYCLE.name)]

    async def apply(origin: Origin, key: bytes | None, value: bytes | None, ts: float) -> None:
        started = time.perf_counter()
        state = accounts.get(key) if key is not None else None
        new_state, out, block_accepted = process_message(state, origin, key, value, ts, policy, prefix)
        if new_state is not None:
            accounts[key] = new_state
        metrics.EVENTS_IN.labels(origin.topic).inc()
        if block_accepted is not None:
            metrics.SHUTTER_BLOCKS.labels("accepted" if block_accepted else "rejected").inc()
        for o in out:
            await outputs[o.topic].send(key=o.key, value=o.value)
            metrics.EVENTS_OUT.labels(settings.topic(o.topic)).inc()
            if o.kind:
                metrics.DEAD_LETTERS.labels(o.kind).inc()
                log.warning("dead letter (%s) for %s[%d]@%d; `nodeshare dlq show` has the reason", o.kind,
                            origin.topic, origin.partition, origin.offset, extra=logs.fields(
                                kind=o.kind, topic=origin.topic, partition=origin.partition, job_id=_job_id(key)))
            elif o.topic == LEDGER_CHARGES.name:
                metrics.CHARGES_EMITTED.inc()
                log.info("charge published", extra=logs.fields(job_id=_job_id(key), topic=origin.topic,
                                                               partition=origin.partition))
        metrics.PROCESSING_SECONDS.observe(time.perf_counter() - started)

    async def rebuild(partition: int, topic: str, offset: int) -> None:
        """Before the first event of a partition since this process started (or since a rebalance):
        rebuild its job states from the input topics, up to where consumption resumes. The table
        restored from the changelog is not trusted: after SIGKILLs on the bundled broker it was seen
        to lack events whose offsets were committed (README, Reliability)."""
        loop = asyncio.get_running_loop()
        messages = []
        for t in input_topics:
            if t == topic:
                stop = offset  # the event in hand is where consumption resumes
            else:  # where it resumes for the other topic: at least what this process already applied live
                committed = await loop.run_in_executor(None, committed_offset, settings, t, partition)
                stop = max(committed, applied_live.get((t, partition), -1) + 1)
            if stop > 0:
                messages += await loop.run_in_executor(None, read_range, settings, t, partition, 0, stop)
        states, charges = fold_states(messages, policy, prefix)
        log.warning("job-accounting: rebuilt %d job states of partition %d from %d input messages; "
                    "re-sending %d charges", len(states), partition, len(messages), len(charges),
                    extra=logs.fields(topic=topic, partition=partition))
        for key, state in states.items():
            accounts[key] = state
        for o in charges:
            await outputs[o.topic].send(key=o.key, value=o.value)

    checked: set[int] = set()
    applied_live: dict[tuple[str, int], int] = {}  # (topic, partition) -> last offset this process applied
    seen_rebalances = [app.rebalancing_count]

    @app.agent(inputs, name="job-accounting")
    async def job_accounting(stream: Any) -> None:
        async for event in stream.events():
            # Never apply an event to a table that is being rebalanced or recovered.
            while app.rebalancing or app.in_recovery:
                await asyncio.sleep(0.05)
            if app.rebalancing_count != seen_rebalances[0]:  # partitions may have moved: check again
                seen_rebalances[0] = app.rebalancing_count
                checked.clear()
            msg = event.message
            if msg.partition not in checked:
                await rebuild(msg.partition, msg.topic, msg.offset)
                checked.add(msg.partition)
            await apply(Origin(msg.topic, msg.partition, msg.offset), event.key, event.value, msg.timestamp)
            applied_live[(msg.topic, msg.partition)] = msg.offset

    add_power_agents(app, settings)
    add_placement_agents(app, settings)
    return app


def add_log_manager(app: faust.App, settings: Settings, name: str, log_topic: str, inputs: Any,
                    screened: tuple[TopicSpec, ...], fresh: Callable[[], Any],
                    publish: Callable[[Any], Awaitable[None]]) -> None:
    """A decision maker that needs the whole cluster in one place: ``<name>-router`` forwards
    every record of ``inputs`` (bad ones of the ``screened`` topics go to the dead-letter topic
    instead) to the single-partition ``log_topic``, and ``<name>-manager`` folds that log with
    ``fresh().apply(topic, value)`` and publishes what each step returns. After a start or a
    rebalance the manager first re-folds the log up to where it resumes, without publishing."""
    log_name = settings.topic(log_topic)
    log_ = app.topic(log_name, partitions=1, key_serializer="raw", value_serializer="raw")
    dlq = app.topic(settings.topic(DLQ.name), key_serializer="raw", value_serializer="raw")
    state: dict[str, Any] = {}
    seen_rebalances = [app.rebalancing_count]

    async def route(stream: Any) -> None:
        async for event in stream.events():
            msg = event.message
            bad = screen(msg.topic, msg.partition, msg.offset, event.key, event.value, msg.timestamp,
                         settings.topic_prefix, screened)
            if bad is not None:  # bad input stops here, with its reason
                await dlq.send(key=bad.origin_topic.encode(), value=encode(bad))
                metrics.DEAD_LETTERS.labels(metrics.DECODE if bad.field != "event_time" else metrics.CLOCK).inc()
                continue
            await log_.send(key=b"cluster", value=envelope(msg.topic, event.value))

    async def manage(stream: Any) -> None:
        async for event in stream.events():
            while app.rebalancing or app.in_recovery:
                await asyncio.sleep(0.05)
            if app.rebalancing_count != seen_rebalances[0]:
                seen_rebalances[0] = app.rebalancing_count
                state.clear()
            msg = event.message
            if "m" not in state:
                m = fresh()
                if msg.offset > 0:
                    loop = asyncio.get_running_loop()
                    history = await loop.run_in_executor(None, read_range, settings, log_name, msg.partition, 0,
                                                         msg.offset)
                    for _origin, _key, value, _ts in history:
                        m.apply(*open_envelope(value or b""))
                    log.warning("%s-manager: rebuilt its state from %d log records", name, len(history),
                                extra=logs.fields(topic=log_name, partition=msg.partition))
                state["m"] = m
            for record in state["m"].apply(*open_envelope(event.value or b"")):
                await publish(record)

    app.agent(inputs, name=f"{name}-router")(route)
    app.agent(log_, name=f"{name}-manager")(manage)


def add_power_agents(app: faust.App, settings: Settings) -> None:
    """PPartition needs the whole machine in one place: lifecycle, power and inventory records go
    through the single-partition ``power.machine`` log to the PowerManager (streams.power.stream),
    which publishes ``decisions.power``."""
    inputs = app.topic(*[settings.topic(t.name) for t in (JOBS_LIFECYCLE, NODE_POWER, CLUSTER_INVENTORY)],
                       key_serializer="raw", value_serializer="raw")
    decisions = app.topic(settings.topic(DECISIONS_POWER.name), key_serializer="raw", value_serializer="raw")

    async def publish(decision: Any) -> None:
        await decisions.send(key=decision.job_id.encode(), value=encode(decision))
        metrics.EVENTS_OUT.labels(settings.topic(DECISIONS_POWER.name)).inc()
        metrics.POWER_DECISIONS.labels(decision.action.value).inc()

    add_log_manager(app, settings, "power", POWER_LOG, inputs, (NODE_POWER, CLUSTER_INVENTORY),
                    lambda: PowerManager(settings.power_budget_watts, settings.power_policy(), settings.topic_prefix),
                    publish)


def add_placement_agents(app: faust.App, settings: Settings) -> None:
    """Spread-n-Share and the pair model need the whole cluster in one place: lifecycle, inventory,
    shutter blocks, CAT episodes and final degradation estimates go through the single-partition
    ``placement.cluster`` log to the PlacementManager (streams.placement.stream), which publishes
    ``profiles.program`` and ``decisions.placement``."""
    inputs = app.topic(*[settings.topic(t.name) for t in ROUTED], key_serializer="raw", value_serializer="raw")
    outputs = {t.name: app.topic(settings.topic(t.name), key_serializer="raw", value_serializer="raw")
               for t in (PROFILES_PROGRAM, DECISIONS_PLACEMENT)}

    async def publish(record: Any) -> None:
        spec = TOPIC_OF_RECORD[type(record)]
        await outputs[spec.name].send(key=key_of(record), value=encode(record))
        metrics.EVENTS_OUT.labels(settings.topic(spec.name)).inc()

    add_log_manager(app, settings, "placement", PLACEMENT_LOG, inputs, (NODE_LLC,),
                    lambda: PlacementManager(settings.placement_policy, settings.placement_age_limit_s,
                                             settings.placement_pairing, prefix=settings.topic_prefix), publish)


def run_worker(settings: Settings, datadir: Path | None = None, loglevel: str = "warning") -> None:
    """Run one stream worker in the foreground until SIGTERM/SIGINT."""
    app = make_app(settings, datadir, loglevel)
    metrics.serve(settings.metrics_port, settings.metrics_addr)
    # The web server is off (BROKER.md: it would bind 0.0.0.0:6066 otherwise).
    # With JSON logs, --quiet leaves out faust's banner so that every line is one JSON object.
    quiet = ["--quiet"] if settings.log_format == "json" else []
    sys.argv = ["nodeshare-worker", *quiet, "worker", "--without-web", "--loglevel", loglevel]
    app.main()
