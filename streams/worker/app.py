"""The stream worker: thin shells that move bytes between topics and the pure core.

One process runs two consumers:

* the **charge fold** (streams.worker.fold_consumer): ``node.ipc`` and ``jobs.lifecycle``, co-partitioned
  by job id, folded into each job's ``JobAccount`` (streams.core.accounting) on confluent-kafka batches,
  held in memory and rebuilt from the input topics when a partition is assigned (no changelog);
  it publishes charges, degradation estimates and dead letters;
* **faust agents** for the decision makers that need the whole cluster in one place: power
  (PPartition) and placement (Spread-n-Share, pairing), each a router and a single-partition log.

Exactly-once does not come from the broker (faust's exactly_once fails on Tansu, see
docs of the broker) but from the reducer's offset de-duplication and the ledger's idempotent key.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import faust
from confluent_kafka import KafkaException

from nodeshare.runtime import logs, metrics
from nodeshare.runtime.config import Settings
from nodeshare.schemas.catalog import (
    CLUSTER_INVENTORY,
    DECISIONS_PLACEMENT,
    DECISIONS_PLACEMENT_NODES,
    DECISIONS_POWER,
    DECISIONS_POWER_NODES,
    DLQ,
    JOBS_LIFECYCLE,
    NODE_IPC,
    NODE_LLC,
    NODE_POWER,
    PLACEMENT_LOG,
    POWER_LOG,
    PROFILES_PROGRAM,
    SNAPSHOTS,
    TOPIC_OF_RECORD,
    TopicSpec,
    key_of,
    spec_for_topic,
)
from nodeshare.schemas.serde import encode
from nodeshare.schemas.signing import AUTH_FIELD

from ..core import snapshot
from ..core.accounting import Message, Origin
from ..core.placement.stream import ROUTED, PlacementManager
from ..core.power.caps import node_states
from ..core.power.stream import PowerManager, envelope, open_envelope, screen
from .copartition import NotCoPartitioned, input_partitions
from .cursor import Cursor, blocking, committed_offsets, latest_snapshot, read_range
from .fold_consumer import FoldConsumer, FoldThread
from .kafka_security import faust_credentials
from .transport import use_short_fetch_wait

log = logging.getLogger(__name__)

def faust_app(settings: Settings, datadir: Path | None = None, loglevel: str = "warning") -> faust.App:
    """A faust App configured as nodeshare's workers are (broker, security, commits, logs), no agents."""
    if not settings.bootstrap:
        raise RuntimeError("the stream worker needs a broker: set NODESHARE_BOOTSTRAP")
    app = faust.App(
        settings.app_id,
        broker=[f"kafka://{h.strip()}" for h in settings.bootstrap.split(",")],
        broker_credentials=faust_credentials(settings.kafka),  # TLS / SASL as every other client has them
        store="memory://",  # no tables: state is rebuilt from the input topics (streams.worker.cursor)
        processing_guarantee="at_least_once",
        topic_partitions=settings.partitions,
        broker_session_timeout=settings.session_timeout_ms / 1000,
        broker_heartbeat_interval=1.0,
        broker_commit_interval=1.0,  # how stale the group's committed offsets (which the cursor checks) may be
        consumer_auto_offset_reset="earliest",
        producer_acks=-1,
        web_enabled=False,
        Worker="nodeshare.streams.worker.transport:Worker",  # no spinner: it puts the root logger at DEBUG
        key_serializer="raw",  # every topic and table carries bytes (none says otherwise): our serde does JSON
        value_serializer="raw",
        datadir=str(datadir or Path.cwd() / ".nodeshare-worker"),
        # faust's worker installs this instead of its coloured handler: the operator's format, secrets masked
        logging_config=logs.dict_config(settings.log_format, loglevel, settings.secret_values(),
                                        logs.fields(component="worker")),
    )
    use_short_fetch_wait(app)
    return app


def make_app(settings: Settings, datadir: Path | None = None, loglevel: str = "warning") -> faust.App:
    """The worker's faust agents: the power and placement decision makers. The charge fold runs
    beside them in the same process on confluent-kafka batches (streams.worker.fold_consumer)."""
    app = faust_app(settings, datadir, loglevel)
    cursors: list[Cursor] = []
    add_power_agents(app, settings, cursors)
    add_placement_agents(app, settings, cursors)
    add_skip_repair(app, settings, cursors)
    return app


First = Callable[[str, int, int], Awaitable[None]]


def follow(app: faust.App, cursor: Cursor, first: First) -> Callable[[Any], Awaitable[None]]:
    """An agent body that hands each event to ``cursor`` (which reads back what faust skipped).
    Before the first event of a (topic, partition) since the start or the last rebalance, ``first``
    (topic, partition, offset) prepares it and starts the cursor there."""
    cursor.generation = app.rebalancing_count

    async def agent(stream: Any) -> None:
        async for event in stream.events():
            # No waiting for a rebalance to end while holding an event: faust's revocation waits for
            # the events in hand to be acknowledged, and a two-worker takeover hung so for minutes.
            # Handling it is harmless: this process's state of the partition is consistent, and
            # copies downstream are absorbed; the count check below rebuilds what may have moved.
            msg = event.message
            async with cursor.lock:
                if app.rebalancing_count != cursor.generation:  # partitions may have moved
                    cursor.generation = app.rebalancing_count
                    cursor.forget()
                if not cursor.knows(msg.topic, msg.partition):
                    await first(msg.topic, msg.partition, msg.offset)
                signer = cursor.signer(msg.topic, event.key, event.value, msg.headers)
                await cursor.deliver((Origin(msg.topic, msg.partition, msg.offset, signer), event.key, event.value,
                                      msg.timestamp))

    return agent


def add_skip_repair(app: faust.App, settings: Settings, cursors: list[Cursor]) -> None:
    """A timer that reads back messages faust skipped at the end of a partition (streams.worker.cursor)."""

    @app.timer(interval=settings.skip_check_interval_s, name="skip-repair")
    async def repair() -> None:
        if app.rebalancing or app.in_recovery:
            return
        for cursor in cursors:
            # After a rebalance the cursor's partitions may belong to another worker now: its agent
            # forgets them at its next event, and until then there is nothing to repair here.
            if cursor.generation == app.rebalancing_count:
                await cursor.tail()


class _Fold:
    """The manager's current fold, replaced whole by each re-fold (the agent's closures share it),
    and what it has folded since its last snapshot."""

    fold: Any = None
    after: int | None = None  # the log offset after the last record folded
    unsaved: int = 0  # records folded since the last snapshot
    since: float = 0.0  # monotonic time of the first of them


def add_log_manager(app: faust.App, settings: Settings, name: str, log_topic: str, inputs: Any,
                    screened: tuple[TopicSpec, ...], fresh: Callable[[], Any],
                    publish: Callable[[Any], Awaitable[None]], cursors: list[Cursor],
                    restate: Callable[[Any], Awaitable[None]] | None = None) -> None:
    """A decision maker that needs the whole cluster in one place: ``<name>-router`` forwards
    every record of ``inputs`` (bad ones of the ``screened`` topics go to the dead-letter topic
    instead) to the single-partition ``log_topic``, and ``<name>-manager`` folds that log with
    ``fresh().apply(topic, value)`` and publishes what each step returns. After a start or a
    rebalance the manager first re-folds the log up to where it resumes, without publishing
    (``restate``, when given, then publishes what the rebuilt manager holds)."""
    log_name = settings.topic(log_topic)
    log_ = app.topic(log_name, partitions=1)
    dlq = app.topic(settings.topic(DLQ.name))
    snapshots_name = settings.topic(SNAPSHOTS[log_topic])
    snapshots = app.topic(snapshots_name, partitions=1)
    held = _Fold()

    async def route(message: Message) -> None:
        origin, key, value, ts = message
        bad = screen(origin.topic, origin.partition, origin.offset, key, value, ts, settings.topic_prefix, screened,
                     origin.signer)
        if bad is not None:  # bad input stops here, with its reason
            if spec_for_topic(origin.topic, settings.topic_prefix) in screened:  # else its owner dead-letters it
                await dlq.send(key=bad.origin_topic.encode(), value=encode(bad))
                metrics.DEAD_LETTERS.labels({"event_time": metrics.CLOCK, AUTH_FIELD: metrics.FORGED}.get(
                    bad.field or "", metrics.DECODE)).inc()
            return
        await log_.send(key=b"cluster", value=envelope(origin.topic, value))

    router = Cursor(settings, f"{name}-router", route)

    async def route_from(topic: str, partition: int, offset: int) -> None:
        """Routing is stateless: it continues after what this process routed before a rebalance, or
        else where the group committed (messages skipped before the first one are read back)."""
        handled = router.before_rebalance.get((topic, partition))
        if handled is None:
            committed = await blocking(f"{name}-router: committed offsets", committed_offsets, settings,
                                       [(topic, partition)])
            handled = committed.get((topic, partition), offset)
        router.start(topic, partition, handled)

    async def save() -> None:
        """The manager's state after the records folded so far, on its compacted snapshot topic."""
        if held.unsaved and held.after is not None:
            await app.producer.flush()  # the decisions of the records it holds acknowledged first
            await snapshots.send(key=b"snapshot", value=snapshot.dump(held.fold, held.after))
            held.unsaved = 0

    async def manage(message: Message) -> None:  # under the cursor's lock, as a snapshot is taken
        for record in held.fold.apply(*open_envelope(message[2] or b"")):
            await publish(record)
        held.after = message[0].offset + 1  # folded and its decisions sent: a snapshot may include it
        if not held.unsaved:
            held.since = time.monotonic()
        held.unsaved += 1
        if held.unsaved >= settings.snapshot_every_records:
            await save()

    @app.timer(interval=min(settings.snapshot_every_s, 60.0), name=f"{name}-snapshot")
    async def save_in_time() -> None:  # records not yet in a snapshot, before retention can delete them
        async with manager.lock:  # never between a record's fold and its decisions
            if held.unsaved and time.monotonic() - held.since >= settings.snapshot_every_s:
                await save()

    manager = Cursor(settings, f"{name}-manager", manage)

    async def refold(topic: str, partition: int, offset: int) -> None:
        """The manager's latest snapshot (or a fresh manager) folds the log after it up to where
        consumption resumes, without publishing. A snapshot past that point (taken after records
        whose offsets were not committed yet) already holds them and their decisions were sent:
        consumption resumes after it."""
        raw = await blocking(f"{name}-manager: reading its snapshot", latest_snapshot, settings, snapshots_name)
        try:
            start, m = snapshot.usable(raw, fresh())
        except snapshot.SnapshotError as exc:
            log.warning("%s-manager: snapshot not used, folding the log from its start: %s", name, exc)
            start, m = 0, fresh()
        history = await blocking(f"{name}-manager: re-folding {topic}", read_range, settings, topic, partition,
                                 start, offset)
        offset = max(offset, start)
        for _origin, _key, value, _ts in history:
            m.apply(*open_envelope(value or b""))
        if history or start:
            log.warning("%s-manager: rebuilt its state from %s and %d log records", name,
                        f"its snapshot at offset {start}" if start else "nothing", len(history),
                        extra=logs.fields(topic=topic, partition=partition))
        held.fold, held.after, held.unsaved = m, offset, 0
        if restate is not None:
            await restate(m)
        manager.start(topic, partition, offset)

    cursors += [router, manager]
    app.agent(inputs, name=f"{name}-router")(follow(app, router, route_from))
    app.agent(log_, name=f"{name}-manager")(follow(app, manager, refold))


def add_power_agents(app: faust.App, settings: Settings, cursors: list[Cursor]) -> None:
    """PPartition needs the whole machine in one place: lifecycle, power and inventory records go
    through the single-partition ``power.machine`` log to the PowerManager (streams.core.power.stream),
    which publishes ``decisions.power``, and each node state a decision states on the compacted
    ``decisions.power.nodes`` (keyed by node: what an agent holds once retention deleted the decision)."""
    inputs = app.topic(*[settings.topic(t.name) for t in (JOBS_LIFECYCLE, NODE_POWER, CLUSTER_INVENTORY)])
    decisions = app.topic(settings.topic(DECISIONS_POWER.name))
    nodes = app.topic(settings.topic(DECISIONS_POWER_NODES.name))

    async def publish(decision: Any) -> None:
        await decisions.send(key=decision.job_id.encode(), value=encode(decision))
        for state in node_states(decision):
            await nodes.send(key=state.node.encode(), value=encode(state))
        metrics.EVENTS_OUT.labels(settings.topic(DECISIONS_POWER.name)).inc()
        metrics.POWER_DECISIONS.labels(decision.action.value).inc()

    async def restate(manager: PowerManager) -> None:  # caps decided before decisions.power.nodes existed
        for state in manager.restatement():
            await nodes.send(key=state.node.encode(), value=encode(state))

    add_log_manager(app, settings, "power", POWER_LOG, inputs, (NODE_POWER, CLUSTER_INVENTORY),
                    lambda: PowerManager(settings.power_budget_watts, settings.power_policy(), settings.topic_prefix),
                    publish, cursors, restate)


def add_placement_agents(app: faust.App, settings: Settings, cursors: list[Cursor]) -> None:
    """Spread-n-Share and the pair model need the whole cluster in one place: lifecycle, inventory,
    CAT episodes and degradation estimates (with each job's IPC moments) go through the single-partition
    ``placement.cluster`` log to the PlacementManager (streams.core.placement.stream), which publishes
    ``profiles.program``, ``decisions.placement`` and each node's cache shares on the compacted
    ``decisions.placement.nodes`` (what the agents read: restated for every node after a rebuild)."""
    inputs = app.topic(*[settings.topic(t.name) for t in ROUTED])
    outputs = {t.name: app.topic(settings.topic(t.name))
               for t in (PROFILES_PROGRAM, DECISIONS_PLACEMENT, DECISIONS_PLACEMENT_NODES)}

    async def publish(record: Any) -> None:
        spec = TOPIC_OF_RECORD[type(record)]
        await outputs[spec.name].send(key=key_of(record), value=encode(record))
        metrics.EVENTS_OUT.labels(settings.topic(spec.name)).inc()

    async def restate(manager: PlacementManager) -> None:  # shares decided before the topic existed, or lost
        for state in manager.restatement():
            await publish(state)

    add_log_manager(app, settings, "placement", PLACEMENT_LOG, inputs, (NODE_LLC,),
                    lambda: PlacementManager(settings.placement_policy, settings.placement_age_limit_s,
                                             settings.placement_pairing, prefix=settings.topic_prefix), publish,
                    cursors, restate)


def make_counting_app(settings: Settings, datadir: Path | None = None, loglevel: str = "warning") -> faust.App:
    """A yardstick for `nodeshare bench stream`: a worker whose one agent reads ``node.ipc`` and
    only counts (``nodeshare_events_in_total``). What it sustains is faust's own ceiling here."""
    app = faust_app(settings, datadir, loglevel)
    topic = app.topic(settings.topic(NODE_IPC.name))
    counter = metrics.EVENTS_IN.labels(settings.topic(NODE_IPC.name))

    @app.agent(topic, name="count-only")
    async def count(stream: Any) -> None:
        async for _event in stream.events():
            counter.inc()

    return app


def run_worker(settings: Settings, datadir: Path | None = None, loglevel: str = "warning",
               count_only: bool = False) -> None:
    """Run one stream worker in the foreground until SIGTERM/SIGINT. Exits with a message, before
    anything starts, when the charge fold's input topics are not co-partitioned."""
    if not count_only:
        try:
            input_partitions(settings)
        except NotCoPartitioned as exc:
            raise SystemExit(f"nodeshare worker: refusing to start: {exc}") from None
        except KafkaException as exc:  # the broker may come up later: the fold checks at its first assignment
            log.warning("could not read the input topics' partition counts yet: %s", exc)
    app = (make_counting_app if count_only else make_app)(settings, datadir, loglevel)
    metrics.serve(settings.metrics_port, settings.metrics_addr)
    # The web server is off (the bundled broker's notes: it would bind 0.0.0.0:6066 otherwise).
    # With JSON logs, --quiet leaves out faust's banner so that every line is one JSON object.
    quiet = ["--quiet"] if settings.log_format == "json" else []
    sys.argv = ["nodeshare-worker", *quiet, "worker", "--without-web", "--loglevel", loglevel]
    stop, failed = threading.Event(), threading.Event()
    fold = None
    if not count_only:
        def fail(_exc: BaseException) -> None:  # no worker without its charge fold: stop faust too
            failed.set()
            os.kill(os.getpid(), signal.SIGTERM)

        fold = FoldThread(FoldConsumer(settings), stop, fail)
        fold.start()
    try:
        app.main()
    finally:
        stop.set()
        if fold is not None:
            fold.join(timeout=30)  # commits what it applied and leaves the group
        if failed.is_set():
            raise SystemExit(1)
