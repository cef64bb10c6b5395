"""A node agent's reader of a topic: a decision topic from its start, caught up before it acts, or
a topic of events to act on once each, from where its consumer group committed.

The state a node must hold (power caps, cache shares) is a fold of every decision, and the agent
undoes what it applied on exit, so each start folds the whole history again: every partition from
its beginning, with a consumer group of its own that never commits. Records of the history are
folded without acting (a decision superseded long ago must not flash on); once every partition is
read to the end offset seen at start and a fetch then comes back empty, ``settle`` acts on what the
history ends with, and each later record is folded live. The end offset alone is not enough (the
bundled broker reports a batch's first offset as the end: docs/broker.md), nor is quiet time
alone (a consumer still joining reads nothing for a while).

Topics in ``from_end`` are read from the end offsets seen at start, not from their beginning: a
follower whose state another topic it reads holds in full (the power follower: each node's caps on
the compacted ``decisions.power.nodes``) takes only what comes after its start from them, so a start
reads what the compacted topic holds (one record per node, whatever the age of the cluster), not
every decision retention still keeps; with that topic missing (``topics create`` not run after an
upgrade) they are read from their beginning, as before. A follower whose own topic is missing waits
for it as for a broker away (below), never caught up on nothing.

A follower with ``commits`` (the agent's follower of ``jobs.lifecycle``) acts on every record it
reads instead, so ``handle`` must be idempotent: a start resumes after the offsets its group
committed (each batch is committed once handled, so a crash reads at most that batch again), and
a group with no committed offset starts at the topic's beginning; what is too old to act on,
``handle`` decides.

A follower never ends silently. A broker it cannot reach (``KafkaException``), at start or later,
is waited out: the follower starts again, as at a start, after a back-off that doubles from
``RETRY_S`` up to ``RETRY_MAX_S`` and starts over once the broker answered;
``nodeshare_agent_follower_connected{follower}`` is 0 while it waits (alert when it stays 0) and
``nodeshare_agent_follower_retries_total{follower}`` counts the attempts. Anything else
(``WatchdogLost``: nothing would undo a cap if the agent died now; a bug) stops it: ``failed``
undoes what it applied, the gauge
``nodeshare_agent_follower_up{follower}`` drops to 0, the log says why, and the agent's loop
(``check``) raises, so the agent exits non-zero after its usual restore, and its supervisor
(systemd's ``Restart=on-failure``) starts it again with a new watchdog, which folds the history again.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, KafkaException, TopicPartition
from prometheus_client import Counter, Gauge

from nodeshare.runtime.consumer import next_offsets

from .watchdog import WatchdogLost

log = logging.getLogger(__name__)

FOLLOWER_UP = Gauge("nodeshare_agent_follower_up",
                    "1 while the agent's follower of a topic runs, 0 once a failure stopped it (the agent exits)",
                    ["follower"])
FOLLOWER_CONNECTED = Gauge("nodeshare_agent_follower_connected",
                           "1 while the agent's follower of a topic reads from the broker, 0 while it waits for "
                           "a broker it cannot reach", ["follower"])
FOLLOWER_RETRIES = Counter("nodeshare_agent_follower_retries_total",
                           "Times the agent's follower of a topic could not reach the broker and waited to try again",
                           ["follower"])
#: seconds before the first attempt again to reach a broker that is away; doubled at each failure
RETRY_S = 5.0
#: the longest wait between two attempts
RETRY_MAX_S = 60.0
ASK_S = 2.0  # how long one metadata or offsets request may wait for the broker


class FollowerStopped(RuntimeError):
    """A follower of the agent stopped on a failure; the message says which and why."""


class Follower:
    """Subclasses implement ``handle(value, write)`` (fold one record; act on it when ``write``)
    and ``settle()`` (act on what the history ends with)."""

    topic_name = ""
    #: more topics read the same way (a fold of several topics: ``handle`` is told which)
    also_topics: tuple[str, ...] = ()
    purpose = ""
    #: False: a fold of the whole history, every start (nothing committed; the history is folded
    #: without acting). True: events acted on once each, resumed after the committed offsets.
    commits = False
    #: topics (catalog names) whose history is not read: from the end offsets seen at start
    from_end: tuple[str, ...] = ()

    def __init__(self, settings: Any, node: str) -> None:
        self.settings = settings
        self.node = node
        self.caught_up = threading.Event()  # the history is folded and settled
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.failure: BaseException | None = None  # what stopped the follower, if anything did
        self._answered = False  # the broker answered since the last attempt began

    def handle(self, value: bytes | None, write: bool, topic: str | None = None) -> None:
        """Fold one record of ``topic`` (a catalog name, unprefixed; None: ``topic_name``)."""
        raise NotImplementedError

    def settle(self) -> None:
        raise NotImplementedError

    def idle(self) -> None:
        """Called before each fetch (every 0.2 s at most): what a follower retries (by default nothing)."""

    def failed(self, exc: BaseException) -> None:
        """The follower stops on ``exc``: undo what it applied (by default nothing)."""

    def run(self) -> None:
        FOLLOWER_UP.labels(self.purpose).set(1)
        FOLLOWER_CONNECTED.labels(self.purpose).set(0)
        wait = RETRY_S
        while not self._stop.is_set():
            self._answered = False
            try:
                self._follow()
                return
            except KafkaException as exc:  # the broker is away: wait, then start again
                FOLLOWER_CONNECTED.labels(self.purpose).set(0)
                FOLLOWER_RETRIES.labels(self.purpose).inc()
                wait = RETRY_S if self._answered else wait  # it answered before failing: start the back-off over
                log.warning("%s: cannot read the topic (%s); trying again in %g s", self.topic_name, exc, wait)
                self._stop.wait(wait)
                wait = min(2 * wait, RETRY_MAX_S)
            except BaseException as exc:
                self.failure = exc
                FOLLOWER_UP.labels(self.purpose).set(0)
                FOLLOWER_CONNECTED.labels(self.purpose).set(0)
                log.critical("%s: the follower stopped (%s); undoing what it applied, the agent exits",
                             self.topic_name, exc, exc_info=exc)
                try:
                    self.failed(exc)
                except BaseException:
                    log.exception("%s: undoing what the follower applied failed; the agent's exit tries again",
                                  self.topic_name)
                return

    @staticmethod
    def check(*followers: Follower | None) -> None:
        """Raise if a follower stopped on a failure (the agent's loop calls this every cycle):
        ``WatchdogLost`` when that was the cause, else ``FollowerStopped``."""
        for f in followers:
            if f is not None and f.failure is not None:
                what = f"the {f.topic_name} follower stopped: {f.failure}"
                if isinstance(f.failure, WatchdogLost):
                    raise WatchdogLost(what) from f.failure
                raise FollowerStopped(what) from f.failure

    def _follow(self) -> None:
        names = {self.settings.topic(n): n for n in (self.topic_name, *self.also_topics)}
        consumer = Consumer(self.settings.client_config(**{
            "group.id": f"{self.settings.app_id}-agent-{self.node}-{self.purpose}",  # committed only if ``commits``
            "enable.auto.commit": False, "fetch.wait.max.ms": 100}))
        try:
            # short waits: the loop retries every RETRY_S, and the agent's exit waits for this thread
            # (10 s each kept an agent without a broker 10 s longer at every exit)
            parts = []
            missing = False  # an extra topic is missing: its history is nowhere else than in from_end's
            for t, name in names.items():
                meta = consumer.list_topics(t, timeout=ASK_S).topics[t]
                error = getattr(meta, "error", None)
                if name == self.topic_name and (error is not None or not meta.partitions):
                    # waited out as a broker away is (the connected gauge at 0, retried): a follower of
                    # a topic that is not there holds nothing, and must not say it caught up
                    raise KafkaException(KafkaError(KafkaError.UNKNOWN_TOPIC_OR_PART,
                                                    f"no topic {t}: run `nodeshare topics create`"))
                if error is not None or not meta.partitions:
                    missing = True
                    log.error("%s: no topic %s (%s): followed without it until the agent restarts; run "
                              "`nodeshare topics create` (docs/upgrades.md)", self.topic_name, t, error)
                parts += [TopicPartition(t, p) for p in meta.partitions]
            self._answered = True
            FOLLOWER_CONNECTED.labels(self.purpose).set(1)
            ends = {(tp.topic, tp.partition): consumer.get_watermark_offsets(tp, timeout=ASK_S) for tp in parts}
            starts = {key: high if names[key[0]] in self.from_end and not missing else OFFSET_BEGINNING
                      for key, (_, high) in ends.items()}
            if self.commits:  # resume after what the group committed (a negative offset: nothing committed)
                starts.update({(tp.topic, tp.partition): tp.offset
                               for tp in consumer.committed(parts, timeout=ASK_S) if tp.offset >= 0})
            # history to read (a start past the end offset, as from_end's, reads none)
            behind = {key: high for key, (low, high) in ends.items() if high > max(low, starts[key])}
            consumer.assign([TopicPartition(t, p, starts[(t, p)]) for t, p in ends])
            while not self._stop.is_set():
                self.idle()
                batch = [m for m in consumer.consume(500, timeout=0.2) if m.error() is None]
                for m in batch:
                    self.handle(m.value(), write=self.commits or self.caught_up.is_set(), topic=names[m.topic()])
                    key = (str(m.topic()), int(m.partition() or 0))
                    if behind.get(key, 0) <= (m.offset() or 0) + 1:
                        behind.pop(key, None)
                if self.commits and batch:
                    consumer.commit(offsets=next_offsets(batch), asynchronous=False)
                if not self.caught_up.is_set() and not behind and not batch:
                    self.settle()
                    self.caught_up.set()
        finally:
            consumer.close()

    def start(self) -> None:
        self._thread = threading.Thread(target=self.run, name=f"follow-{self.purpose}", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
