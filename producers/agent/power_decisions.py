"""The node agent applies ``decisions.power``: the caps the power manager decided for this node.

A thread of the agent reads the topic from its start, every partition, with no consumer group of
its own to commit: the caps a node must hold are a fold of every decision (``streams.power.caps``),
and the agent restores every limit it changed on exit, so each start folds the history again. It
folds what is already there without writing (a cap superseded long ago must not flash on), writes
the caps the fold ends with once it has read every partition to the end offset it saw at start and
a fetch then comes back empty (the bundled broker reports a batch's first offset as the end, so
the end offset alone is not enough: docs/broker.md), then writes each change as decisions arrive.
Quiet time alone is not enough either: a consumer still joining reads nothing for a while. A
refused cap (no domain, out of range, no permission) is logged and counted; the processor keeps
its limit and the agent goes on.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition

from nodeshare import metrics
from nodeshare.schemas import DecodeError, PowerDecision, decode_model
from nodeshare.schemas.catalog import DECISIONS_POWER
from nodeshare.streams.power.caps import CapChanges, NodeCaps

from .powercap import CapRefused, Powercap

log = logging.getLogger(__name__)


class CapFollower:
    """Folds ``decisions.power`` for ``node`` and writes its caps through ``powercap``."""

    def __init__(self, settings: Any, node: str, powercap: Powercap) -> None:
        self.settings = settings
        self.powercap = powercap
        self.caps = NodeCaps(node)
        self.applied = 0
        self.refused: list[str] = []
        self.caught_up = threading.Event()  # the history is folded and its caps written
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None

    def handle(self, value: bytes | None, write: bool) -> None:
        try:
            decision = decode_model(PowerDecision, value)
        except DecodeError as exc:  # the worker dead-letters its own input; here a bad record is skipped
            log.warning("decisions.power: skipped a record that does not decode: %s", exc.reason)
            return
        changes = self.caps.apply(decision)
        if write:
            self.write(changes)

    def write(self, changes: CapChanges) -> None:
        for processor, watts in changes.items():
            try:
                self.powercap.set(processor, watts)
            except CapRefused as exc:
                self.refused.append(str(exc))
                metrics.POWER_CAPS.labels("refused").inc()
                log.warning("power cap refused: %s", exc)
                continue
            self.applied += 1
            metrics.POWER_CAPS.labels("applied" if watts is not None else "restored").inc()
            log.info("processor %d: %s", processor, f"capped at {watts:g} W" if watts is not None else "limit restored")

    def run(self) -> None:
        topic = self.settings.topic(DECISIONS_POWER.name)
        consumer = Consumer(self.settings.client_config(**{
            "group.id": f"{self.settings.app_id}-agent-{self.caps.node}-power",  # never committed
            "enable.auto.commit": False, "fetch.wait.max.ms": 100}))
        try:
            partitions = consumer.list_topics(topic, timeout=10).topics[topic].partitions
            ends = {p: consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10) for p in partitions}
            behind = {p: high for p, (low, high) in ends.items() if high > low}  # history still to fold
            consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in partitions])
            while not self._stop.is_set():
                batch = [m for m in consumer.consume(500, timeout=0.2) if m.error() is None]
                for m in batch:
                    self.handle(m.value(), write=self.caught_up.is_set())
                    if behind.get(m.partition(), 0) <= (m.offset() or 0) + 1:
                        behind.pop(m.partition(), None)
                if not self.caught_up.is_set() and not behind and not batch:
                    self.write(dict(self.caps.caps()))  # what the history ends with, once
                    self.caught_up.set()
        except BaseException as exc:
            self.error = exc
            log.exception("decisions.power: the cap follower stopped; the limits it wrote are restored at exit")
        finally:
            consumer.close()

    def start(self) -> None:
        self._thread = threading.Thread(target=self.run, name="power-caps", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
