"""The node agent's loop: discover jobs, shutter them one cycle at a time, spool and forward events.

One cycle (Seed 002, Alg. 1-3): measure the lone job for K windows of S, pause every other job on
the node, measure the lone job for K windows, resume them all, measure K windows again, then
sleep until the next period P and rotate the lone job. SIGINT and SIGTERM are held back while
jobs are paused (they take effect right after the resume), the watchdog knows what is paused at
every moment, and a node with fewer than two jobs is never shuttered. Every job the resource
manager says ran on the node gets its stream closed, seen by a rescan or not (``lifecycle``).

Longer than 500 lines because the loop, the shutter cycle's signal holding and the two paths that
close a job's stream (rescan and lifecycle) share one lock and one spool transaction per step:
what makes a node never leave a job frozen and never send a job two markers is their order,
which split across modules would be a protocol between them instead of one reading.
"""

from __future__ import annotations

import errno
import itertools
import logging
import math
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from types import FrameType
from typing import Any

from nodeshare.producers.batching import Batcher, FlushPolicy
from nodeshare.runtime import metrics
from nodeshare.runtime.logs import fields
from nodeshare.schemas import (
    TOPIC_OF_RECORD,
    IpcSample,
    JobEvent,
    JobLeftNode,
    JobState,
    NodeInventory,
    PowerReading,
    Record,
    ShutterBatch,
    encode,
    key_of,
)
from nodeshare.schemas.events import ProcessorSpec
from nodeshare.streams.core.ipc import mean_ipc
from nodeshare.streams.core.shutter_policy import LevelStats, Shutter, ShutterPolicy

from . import powercap, rapl
from .jobs import JobSource, JobSpec, JobsUnavailable, LocalJob
from .lifecycle import META_PREFIX, Closed, ClosedJobs, LifecycleFollower
from .llc_decisions import LlcFollower
from .pausing import FREEZER_ROOT, Pauser, Target
from .power_decisions import CapFollower
from .powercap import Powercap
from .processes import Guard, Proc
from .progress import (
    ApplicationCounter,
    Counter,
    HardwareCounter,
    ProgressRefused,
    hardware_counters_unavailable,
    sample_between,
)
from .resctrl import RESCTRL, Resctrl
from .shutter import left_node, next_lone, shutter_window, triples
from .spool import Forwarder, Spool, SpoolFull
from .watchdog import Watchdog, WatchdogLost

log = logging.getLogger("nodeshare.agent")

#: After a freezer stayed FREEZING past its deadline, how long the node is not shuttered: every
#: cycle would pause the co-runners up to that deadline and measure nothing while a task of the
#: stuck job sleeps uninterruptibly (I/O). Long enough to cost nothing, short enough to resume soon.
FREEZE_BACKOFF_S = 30.0

#: Rescans in a row the job list may be unavailable (``JobsUnavailable``) before the agent gives up
#: and exits (its service manager restarts it): a minute at the default rescan interval.
MAX_UNAVAILABLE_RESCANS = 60

_HELD_SIGNALS = {signal.SIGINT, signal.SIGTERM}


@dataclass(frozen=True)
class AgentOptions:
    node: str
    spool: Path
    sample_us: int = 3200  # S (Seed 002, Section 5)
    k: int = 1  # K samples per region
    period_ms: int = 200  # P
    rescan_s: float = 1.0  # how often the job list is refreshed
    power_interval_s: float = 1.0
    spool_max_bytes: int = 256 * 2**20
    freezer_root: Path = FREEZER_ROOT
    hardware_counters: bool = True  # try perf_event_open before the application counter
    flush: FlushPolicy = field(default_factory=FlushPolicy)  # how blocks are batched per node.ipc message
    power_caps: bool = False  # apply decisions.power to this node's packages (powercap), restored at exit
    powercap_root: Path = rapl.POWERCAP
    resctrl: bool = False  # give jobs the LLC ways and bandwidth of decisions.placement (resctrl), undone at exit
    resctrl_root: Path = RESCTRL
    mem_bandwidth_gbps: float = 0.0  # the node's memory bandwidth, for MBA percentages (0: no MBA)
    #: with power_caps: publish the node's packages on cluster.inventory (powercap's max, this min)
    power_min_watts: float | None = None
    #: An adaptive schedule (issue 36; streams.core.shutter_policy): each cycle the lone job's policy
    #: chooses S and K, or skips the turn; the cycle keeps the length 3*K*sample_us + P. None: S, K
    #: and P above on every cycle (POPPA's Alg. 3).
    schedule: ShutterPolicy | None = None


@dataclass
class PublishedJob:
    """What the agent has published about one job on this node (persisted in the spool's meta)."""

    blocks: int = 0
    last_cycle: int = -1
    paused_us: int = 0
    alone_us: int = 0  # time seen as the node's only job: never shuttered, so undisturbed
    started: bool = False
    start: str | None = None


@dataclass
class Stats:
    cycles: int = 0
    skipped_spool_full: int = 0
    skipped_freeze: int = 0  # cycles abandoned or skipped because a job's freezer stayed FREEZING
    skipped_schedule: int = 0  # turns the adaptive schedule passed (not due, or over a co-runner's pause budget)
    blocks_dropped: int = 0  # shutters whose block was not sent: the lone job's progress count went back
    shutter_total_s: float = 0.0  # a sum, not a list: an agent runs for months

    @property
    def mean_shutter_ms(self) -> float:
        return 1000 * self.shutter_total_s / self.cycles if self.cycles else 0.0


def _now() -> datetime:
    return datetime.now(UTC)


@contextmanager
def _signals_held() -> Iterator[None]:
    """SIGINT and SIGTERM take effect only once the region closes (after the resume).

    Blocking them with pthread_sigmask here is not enough: the kernel gives a signal sent to the
    process to any thread that does not block it (the metrics server's, a decision follower's), and
    Python then runs the handler in the main thread at once, inside the region. So the region swaps
    the handlers themselves, which every delivery goes through, whichever thread the kernel chose: the
    stand-in notes the signal and the original handler gets it when the region closes (SIG_DFL: the
    default action, then). A stand-in an exception left in place during the restore passes signals
    straight on. Python runs handlers in the main thread only, where the shutter runs; in another
    thread no handler can interrupt the region, and there is nothing to swap."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pending: list[int] = []
    holding = True
    originals: dict[int, Any] = {}

    def stand_in(signum: int, frame: FrameType | None) -> None:
        if holding:
            pending.append(signum)
        else:  # the restore did not reach this signal: the original handler, now
            signal.signal(signum, originals[signum])
            signal.raise_signal(signum)

    try:
        for sig in _HELD_SIGNALS:
            handler = signal.getsignal(sig)
            if handler is not None and handler != signal.SIG_IGN:  # None: not set from Python, cannot be put back
                originals[sig] = signal.signal(sig, stand_in)
        yield
    finally:
        holding = False
        for held, handler in originals.items():
            signal.signal(held, handler)
        for signum in dict.fromkeys(pending):
            signal.raise_signal(signum)  # its handler runs here, after the resume (SystemExit goes up from here)


class Agent:
    def __init__(self, options: AgentOptions, source: JobSource, forwarder_factory: Callable[[Spool], Forwarder],
                 topic: Callable[[str], str], *, sleep: Callable[[float], None] = time.sleep,
                 cap_follower: Callable[[Powercap], CapFollower] | None = None,
                 llc_follower: Callable[[Resctrl], LlcFollower] | None = None,
                 lifecycle_follower: Callable[[Callable[[JobEvent], None]], LifecycleFollower] | None = None) -> None:
        self.options = options
        self.source = source
        self.topic = topic
        self.sleep = sleep
        self.spool = Spool(options.spool, options.spool_max_bytes)
        metrics.SPOOL_EVENTS.set_function(lambda: self.spool.rows)  # read at scrape time, off the shutter path
        metrics.SPOOL_BYTES.set_function(lambda: self.spool.bytes)
        metrics.SPOOL_MAX_BYTES.set(self.spool.max_bytes)
        self.forwarder = forwarder_factory(self.spool)
        self.watchdog = Watchdog(options.freezer_root)
        self.pauser = Pauser(Guard.here(self.watchdog.pid), options.freezer_root)
        self.state = {j: PublishedJob(**s) for j, s in self.spool.meta("jobs", {}).items()}
        # The markers sent, for the jobs the lifecycle follower closes (lifecycle.py). It runs in its
        # own thread: ``_books`` makes its look at the open jobs and the rescan's changes to them one
        # at a time, so a job is closed by one of the two paths only
        self.closed = ClosedJobs(options.node, self.spool.metas(META_PREFIX))
        self._books = threading.Lock()
        self.lifecycle = lifecycle_follower(self.job_event) if lifecycle_follower is not None else None
        self.cycle: int = self.spool.meta("next_cycle", 0)
        # Blocks measured but not sent yet: kept in the spool's meta with every write, so a crash
        # loses none and a restart continues the open batches (schema 3, producers.batching)
        self.batcher = Batcher(options.flush)
        self.batcher.restore(self.spool.meta("batches", {}))
        self.jobs: dict[str, LocalJob] = {}
        self.counters: dict[str, Counter] = {}
        self._refused: set[str] = set()  # jobs whose progress file was refused (progress.open_progress)
        self._dropped: set[str] = set()  # jobs a dropped block was logged for (said once per job)
        self._told_sigstop = False  # the fallback from freezing to SIGSTOP is logged once
        self._unavailable = 0  # rescans in a row that could not read the job list
        self.lone: str | None = None
        self._frozen_until = 0.0  # no shutter before this (monotonic s): a freezer was stuck
        self._tick_ns: int | None = None  # the loop's last turn, for the time a job was alone
        # the adaptive schedule's view of each job here: accepted-block moments per S, next turn (monotonic s)
        self.levels: dict[str, dict[int, LevelStats]] = {}
        self.due: dict[str, float] = {}
        self.stats = Stats()
        self.source_name = f"agent/{options.node}"
        self._hw_reason = hardware_counters_unavailable() if options.hardware_counters else "disabled"
        self._told_coarse: set[int | None] = set()  # the causes _coarse has told
        if self._hw_reason:
            log.info("hardware counters unavailable (%s): application progress counters only", self._hw_reason)
        self._power = rapl.package_domains()
        # Jobs of the books before a restart are taken up as they are now, never started again: a job
        # a reboot took reads as gone, and the first rescan closes its stream (issue 39)
        self.source.start(known={*self.state, *self.closed.jobs})
        self._power_last: dict[int, tuple[int, float]] = {}
        # Power caps from decisions.power: every limit changed is restored at exit, by the watchdog
        # if the agent is killed, or at the next start if both died (the state file beside the spool)
        self.powercap = Powercap(options.spool.with_name(options.spool.name + ".caps.json"), options.powercap_root,
                                 on_originals=self.watchdog.hold_caps)
        self.powercap.recover()
        self.caps = cap_follower(self.powercap) if options.power_caps and cap_follower is not None else None
        # Cache shares from decisions.placement: per-job resctrl groups, removed at exit (watchdog too)
        self.resctrl: Resctrl | None = None
        self.llc: LlcFollower | None = None
        if options.resctrl and llc_follower is not None:
            self.resctrl = Resctrl(options.resctrl_root, on_groups=self.watchdog.hold_groups)
            if stale := self.resctrl.remove_all():
                log.warning("removed %d resctrl groups a previous run of the agent left", stale)
            self.llc = llc_follower(self.resctrl)

    # ------------------------------------------------------------------ publishing

    def _events(self, records: list[Record]) -> list[tuple[str, bytes | None, bytes]]:
        return [(self.topic(TOPIC_OF_RECORD[type(r)].name), key_of(r), encode(r)) for r in records]

    def _put(self, records: list[Record], reserve: bool = False, left: JobLeftNode | None = None) -> None:
        """Spool records with the agent's books (and, with ``left``, the record of that marker)."""
        meta: dict[str, Any] = {"next_cycle": self.cycle, "jobs": {j: vars(s) for j, s in self.state.items()},
                                "batches": self.batcher.state()}
        forget: list[str] = []
        if left is not None:
            written, forget = self.closed.record(left.job_id, Closed(left.event_time, unseen=False), _now())
            meta.update(written)
        self.spool.put(self._events(records), meta, reserve=reserve, forget=forget)

    def _send(self, batches: list[ShutterBatch]) -> bool:
        """Spool batches the batcher closed. With the spool full they are open again, as its meta
        still has them (a later flush sends them); a full spool is a state, not a crash."""
        if not batches:
            return True
        try:
            self._put(list(batches))
        except SpoolFull:
            self.batcher.restore(self.spool.meta("batches", {}))
            return False
        return True

    def _lifecycle(self, spec: JobSpec, state: JobState, start: str | None, end: datetime | None) -> JobEvent:
        at = end or _now()
        return JobEvent(
            event_id=f"{self.options.node}/job/{spec.id}/{state.value}", source=self.source_name,
            event_time=at, job_id=spec.id, state=state, user=spec.user, account=spec.account,
            program=spec.program, cores=spec.cores, nodes=(self.options.node,),
            start_time=datetime.fromisoformat(start) if start else at, end_time=end,
        )

    # ------------------------------------------------------------------ jobs

    def _open_counter(self, job: LocalJob) -> Counter | None:
        if job.progress is not None and job.job_id not in self._refused:
            ids = job.owner()
            try:
                if ids is None:
                    raise ProgressRefused(0, f"progress file {job.progress}: the job's user is unknown (no process)")
                counter = ApplicationCounter(job.progress, sorted(p.pid for p in job.procs), uid=ids[0], gid=ids[1])
                self._coarse(job.job_id, counter.coarse_error)
                return counter
            except FileNotFoundError:
                pass  # not written yet: tried again at the next rescan
            except ProgressRefused as e:
                # refused once and for all for this job: it is still paused and charged for its run
                # time, measured by hardware counters if there are any, else without progress
                self._refused.add(job.job_id)
                log.warning("job %s: %s: refused, the job is measured without its progress file", job.job_id,
                            e.strerror, extra=fields(job_id=job.job_id))
            except OSError as e:  # the agent's own limits (out of descriptors): tried again at the next rescan
                log.warning("job %s: its progress file could not be opened (%s): tried again at the next rescan",
                            job.job_id, e, extra=fields(job_id=job.job_id))
                return None
        if not self._hw_reason:
            try:
                return HardwareCounter(sorted(p.pid for p in job.procs))
            except OSError as e:
                log.warning("job %s: hardware counters failed (%s)", job.job_id, e, extra=fields(job_id=job.job_id))
        return None

    def _coarse(self, job_id: str, error: OSError | None) -> None:
        """Say once per cause that a job's application counter is timed by the tick-granular process
        clock (``progress.TaskClock`` could not open); a job whose threads all exited meanwhile is no
        cause for the operator."""
        if error is None or error.errno == errno.ESRCH or error.errno in self._told_coarse:
            return
        self._told_coarse.add(error.errno)
        log.warning("job %s: the task clock is unavailable (%s): its application counter is timed by the process "
                    "CPU clock, which moves in scheduler ticks, so windows shorter than a few ticks measure noise "
                    "(the agent needs root with CAP_SYS_PTRACE, and CAP_PERFMON where perf_event_paranoid > 1); "
                    "said once for this cause", job_id, error, extra=fields(job_id=job_id))

    def rescan(self) -> None:
        try:
            polled = self.source.poll()
        except JobsUnavailable as e:
            self._unavailable += 1
            if self._unavailable > MAX_UNAVAILABLE_RESCANS:
                raise
            log.warning("the job list is unavailable this time (%s): the jobs stay as they were until the next "
                        "rescan", e)
            return
        self._unavailable = 0
        with self._books:
            # a job whose run was closed from its terminal event is not taken up (lifecycle.py)
            now = {j: job for j, job in polled.items() if j in self.state or not self.closed.shut(j)}
            for job_id in sorted(set(self.state) - set(now)):
                self._job_left(job_id)
            for job_id, job in sorted(now.items()):
                st = self.state.get(job_id)
                if st is None:
                    st = self.state[job_id] = PublishedJob(start=_now().isoformat())
                    log.info("job %s: %d processes%s", job_id, len(job.procs),
                             f", cgroup {job.cgroup}" if job.cgroup else "", extra=fields(job_id=job_id))
                    if job.cgroup is None and not self._told_sigstop:
                        self._told_sigstop = True
                        log.warning("job %s has no cgroup to freeze (v1 freezer or v2 cgroup.freeze under %s): "
                                    "pausing jobs without one by SIGSTOP to each process, which misses processes "
                                    "that left the job's process tree (Slurm: use proctrack/cgroup); said once",
                                    job_id, self.options.freezer_root, extra=fields(job_id=job_id))
                spec = self.source.spec(job_id)
                if spec is not None and not st.started:
                    st.started = True
                    self._put([self._lifecycle(spec, JobState.STARTED, st.start, None)], reserve=True)
                if job_id not in self.counters:
                    counter = self._open_counter(job)
                    if counter is not None:
                        self.counters[job_id] = counter
            self.jobs = now

    def job_event(self, event: JobEvent) -> None:
        """A lifecycle event naming this node (from the lifecycle follower's thread): close the stream
        of a run that ended here unseen, or let the rescan take up a later run of a job so closed."""
        with self._books:
            if self.closed.reopens(event):
                self.closed.jobs[event.job_id].unseen = False
                self.spool.put([], {META_PREFIX + event.job_id: self.closed.jobs[event.job_id].dump()})
                return
            if not self.closed.to_close(event, self.state, _now()):
                return
            assert event.end_time is not None  # to_close: the run ended
            marker = left_node(node=self.options.node, source=self.source_name, job_id=event.job_id, blocks_sent=0,
                               last_cycle=-1, paused_us=0, alone_us=0, at=event.end_time)
            before = self.closed.jobs.get(event.job_id)
            meta, forget = self.closed.record(event.job_id, Closed(event.end_time, unseen=True), _now())
            try:  # not ``_put``: the books it writes belong to the loop's thread
                self.spool.put(self._events([marker]), meta, reserve=True, forget=forget)
            except SpoolFull:  # not sent: the follower tries again
                self.closed.jobs.pop(event.job_id)
                if before is not None:
                    self.closed.jobs[event.job_id] = before
                raise
        log.info("job %s %s here unseen: its stream closed with no block", event.job_id, event.state.value,
                 extra=fields(job_id=event.job_id))

    def _job_left(self, job_id: str) -> None:
        st = self.state.pop(job_id)
        self._refused.discard(job_id)
        self._dropped.discard(job_id)
        self.levels.pop(job_id, None)
        self.due.pop(job_id, None)
        counter = self.counters.pop(job_id, None)
        if counter is not None:
            counter.close()
        last = self.batcher.close(job_id, self.options.node)  # the job's last blocks go before its marker
        records: list[Record] = [] if last is None else [last]
        marker = left_node(node=self.options.node, source=self.source_name, job_id=job_id, blocks_sent=st.blocks,
                           last_cycle=st.last_cycle, paused_us=st.paused_us, alone_us=st.alone_us, at=_now())
        records.append(marker)
        spec = self.source.spec(job_id)  # also after a restart, when this agent never saw the job run
        if spec is not None:
            state = JobState.FAILED if self.source.exit_code(job_id) else JobState.ENDED
            records.append(self._lifecycle(spec, state, st.start, _now()))
        log.info("job %s left: %d blocks, %.1f ms paused, %.1f s alone", job_id, st.blocks, st.paused_us / 1000,
                 st.alone_us / 1e6,
                 extra=fields(job_id=job_id))
        self._put(records, reserve=True, left=marker)

    def count_alone(self, now_ns: int) -> None:
        """Credit the time since the last call to the node's only job, if it had one then: a node
        with one job is never shuttered, so that time is undisturbed and its marker says how much.
        Called before each rescan, so the interval goes to the jobs that ran through it."""
        if self._tick_ns is not None and len(self.jobs) == 1:
            (only,) = self.jobs
            if only in self.state:
                self.state[only].alone_us += max(0, now_ns - self._tick_ns) // 1000
        self._tick_ns = now_ns

    # ------------------------------------------------------------------ one shutter

    def _windows(self, counter: Counter, k: int, sample_us: int) -> list[IpcSample]:
        readings = [counter.read()]
        for _ in range(k):
            self.sleep(sample_us / 1e6)
            readings.append(counter.read())
        return [sample_between(a, b) for a, b in itertools.pairwise(readings)]

    def _scheduled(self, lone: str, others: list[Target]) -> Shutter | None:
        """The adaptive schedule's shutter for the lone job, or None when it passes this turn: not
        due yet, or over the pause budget of a co-runner it would pause (their time run is from
        the start this agent saw, their pause from what it credited them)."""
        pol = self.options.schedule
        assert pol is not None
        if time.monotonic() < self.due.get(lone, -math.inf):
            return None
        now = _now()
        budget = math.inf
        for t in others:
            st = self.state.get(t.job_id)
            run_s = (now - datetime.fromisoformat(st.start)).total_seconds() if st and st.start else 0.0
            budget = min(budget, pol.pause_budget_s(run_s, st.paused_us / 1e6 if st else 0.0))
        return pol.choose(self.levels.get(lone, {}), budget)

    def shutter(self) -> bool:
        """One cycle if the node has at least two jobs and one can be measured; True if it ran."""
        measurable = sorted(j for j in self.jobs if j in self.counters)
        if len(self.jobs) < 2 or not measurable:
            return False
        if time.monotonic() < self._frozen_until:
            self.stats.skipped_freeze += 1
            metrics.SHUTTERS_SKIPPED.labels("freeze_timeout").inc()
            return False
        if self.spool.bytes >= self.spool.max_bytes:
            self.stats.skipped_spool_full += 1
            metrics.SHUTTERS_SKIPPED.labels("spool_full").inc()
            if self.stats.skipped_spool_full == 1:
                log.error("spool full (%d bytes unacknowledged): shutters stop until the broker drains it",
                          self.spool.bytes)
            return False
        # Only what runs now is paused, so only what the agent stopped is resumed (pausing.Pauser).
        # A job that does not run at all (suspended by Slurm, stopped by its user or a debugger) is
        # neither paused nor credited a pause, nor measured alone: its block would hold no work and
        # say nothing of its co-runners. With no other job running the node is as good as a node
        # with one job, and is not shuttered either.
        running = {j: self.pauser.running(self.pauser.checked(Target(j, job.procs, job.cgroup)))
                   for j, job in sorted(self.jobs.items())}
        measurable = [j for j in measurable if not running[j].empty]
        if not measurable:
            return False
        lone = next_lone(measurable, self.lone)
        others = [t for j, t in running.items() if j != lone and not t.empty]
        if not others:
            return False
        counter, k, sample_us = self.counters[lone], self.options.k, self.options.sample_us
        choice = None
        if self.options.schedule is not None:
            choice = self._scheduled(lone, others)
            if choice is None:
                self.lone = lone  # its turn passes: the next cycle measures the next job
                self.stats.skipped_schedule += 1
                metrics.SHUTTERS_SKIPPED.labels("schedule").inc()
                return False
            k, sample_us = choice.k, choice.sample_us
        counter.went_back()  # cleared: only this block's readings count
        before = self._windows(counter, k, sample_us)
        paused: list[Target] = []
        with _signals_held():
            # the intent before any act: the watchdog resumes a pause the agent dies in the middle of
            self.watchdog.arm([*self.pauser.held(), *others])
            try:
                start = _now()
                t0 = time.monotonic_ns()
                for target in others:
                    paused.append(target)
                    self.pauser.pause(target)  # records each process and cgroup before it stops it
                during = self._windows(counter, k, sample_us)
            except TimeoutError as e:
                during = None
                stuck = e
            finally:
                self._resume()
                t1 = time.monotonic_ns()
                end = _now()
        if during is None:
            # A freezer stuck in FREEZING (a task in uninterruptible I/O): everything is thawed, the
            # cycle abandoned, and the node not shuttered for FREEZE_BACKOFF_S, since every cycle
            # would pause its co-runners up to the freezer's deadline and measure nothing. The jobs
            # paused meanwhile are credited the pause.
            for target in paused:
                self.state[target.job_id].paused_us += (t1 - t0) // 1000
            self._frozen_until = time.monotonic() + FREEZE_BACKOFF_S
            self.stats.skipped_freeze += 1
            metrics.SHUTTERS_SKIPPED.labels("freeze_timeout").inc()
            log.warning("shutter abandoned: %s; no shutter on this node for %.0f s", stuck, FREEZE_BACKOFF_S)
            return False
        after = self._windows(counter, k, sample_us)
        paused_us = (t1 - t0) // 1000
        self.stats.shutter_total_s += (t1 - t0) / 1e9
        metrics.SHUTTER_SECONDS.observe((t1 - t0) / 1e9)
        window = shutter_window(node=self.options.node, source=self.source_name, cycle=self.cycle, lone=lone,
                                paused=[t.job_id for t in others], start=start, end=end)
        st = self.state[lone]
        kept = st.blocks, st.last_cycle
        # A read that cannot be trusted (ApplicationCounter.read: a count that went back, or none)
        # makes the block no measurement: it is not sent; the pause happened, and its window is. One
        # more read checks the last one (a torn count read too high is only seen by the read after it).
        counter.read()
        measured = not counter.went_back()
        full: list[Record] = []
        if measured:
            full = self.batcher.add(
                job_id=lone, node=self.options.node, source=self.source_name, cycle=self.cycle, k=k,
                sample_us=sample_us, counter=counter.source, before=triples(before),
                during=triples(during), after=triples(after), at=_now())
            st.blocks, st.last_cycle = st.blocks + 1, self.cycle
        for target in others:  # the pause happened whether or not its record is kept
            self.state[target.job_id].paused_us += paused_us
        if choice is not None:
            level = self.levels.setdefault(lone, {}).setdefault(sample_us, LevelStats())
            if measured:  # the schedule saw the block whether or not its record is kept
                level.add(mean_ipc(before), mean_ipc(during), mean_ipc(after))
            else:  # no measurement, but the co-runners were paused: a block taken, for the schedule's time
                level.rejected += 1
            self.due[lone] = time.monotonic() + choice.period_ms / 1000  # a dropped block waits its turn too
        self.cycle += 1
        self.lone = lone
        self.stats.cycles += 1
        try:
            self._put([*full, window])
        except SpoolFull as e:  # measured but not kept: the block and its cycle number were never published
            st.blocks, st.last_cycle = kept
            self.cycle -= 1
            self.batcher.restore(self.spool.meta("batches", {}))  # as last written: without this block
            log.error("%s", e)
            return True
        if not measured:  # its cycle was kept, without its block
            self._block_dropped(lone)
        return True

    def _block_dropped(self, job_id: str) -> None:
        self.stats.blocks_dropped += 1
        metrics.AGENT_BLOCKS_DROPPED.labels("counter_went_back").inc()
        if job_id not in self._dropped:
            self._dropped.add(job_id)
            log.warning("job %s: its progress count went back, or could not be read, during a shutter: the "
                        "block is not sent. The application must write its count in one 8-byte store, one "
                        "file per job (docs/deployment.md); a job that began its count again is taken up "
                        "after 1 s. Said once per job", job_id, extra=fields(job_id=job_id))

    def _resume(self) -> None:
        """Resume everything the pauser stopped, then tell the watchdog what stays stopped (nothing,
        unless a resume failed: the watchdog tries it again, as does the next shutter or close)."""

        def failed(what: Proc | Path, e: Exception) -> None:
            log.error("resuming %s failed: %s", what, e)

        self.pauser.resume_held(failed)
        self.watchdog.arm(self.pauser.held())

    # ------------------------------------------------------------------ power

    def power(self) -> list[PowerReading]:
        node, now = self.options.node, _now()
        if not self._power:
            return [PowerReading(event_id=f"{node}/power/unavailable/{int(now.timestamp())}", source=self.source_name,
                                 event_time=now, node=node, processor=0, available=False)]
        readings = []
        for d in self._power:
            energy, t = d.energy_uj(), time.monotonic()
            last = self._power_last.get(d.processor)
            self._power_last[d.processor] = (energy, t)
            if last is not None and t > last[1]:
                readings.append(PowerReading(
                    event_id=f"{node}/power/{d.processor}/{now.timestamp():.3f}", source=self.source_name,
                    event_time=now, node=node, processor=d.processor, available=True,
                    watts=rapl.watts(last[0], energy, d.max_range_uj(), t - last[1]), cap_watts=d.cap_watts(),
                    interval_s=t - last[1]))
        return readings

    def processors(self) -> NodeInventory | None:
        """With ``--power-caps``, the node's processor packages from powercap (max: the highest cap
        the kernel accepts; min: ``power_min_watts``, the site's floor) as a processors-only
        inventory record for the power manager; None when there is nothing to publish (said why)."""
        o = self.options
        if not o.power_caps:
            return None
        if o.power_min_watts is None:
            log.warning("--power-caps without --power-min-watts: this node's packages are not published, and the "
                        "power manager caps no job here unless another source lists them on cluster.inventory")
            return None
        found = powercap.processors(o.powercap_root, o.power_min_watts)
        if not found:
            log.warning("--power-caps: no package with a constraint_0_max_power_uw under %s: none published",
                        o.powercap_root)
            return None
        now = _now()
        return NodeInventory(
            event_id=f"{o.node}/processors/{now.timestamp():.3f}", source=self.source_name, event_time=now,
            node=o.node, cores=os.cpu_count() or len(found), sockets=len(found), llc_ways=1,
            mem_bandwidth_gbps=o.mem_bandwidth_gbps or 1.0, processors_only=True,
            processors=tuple(ProcessorSpec(processor=p, min_watts=lo, max_watts=hi) for p, lo, hi in found))

    # ------------------------------------------------------------------ the loop

    def run(self, *, duration_s: float | None = None, until_idle: bool = False,
            stop: Callable[[], bool] = lambda: False, drain_s: float = 10.0) -> Stats:
        """Run cycles until ``duration_s`` passes, ``stop()`` says so, or (``until_idle``) every job has
        ended and the spool is drained. Always leaves nothing paused and the watchdog stopped."""
        started = time.monotonic()
        next_rescan = next_power = 0.0
        period = self.options.period_ms / 1000
        cycle = 3 * self.options.k * self.options.sample_us / 1e6 + period
        try:
            for follower in (self.caps, self.llc, self.lifecycle):
                if follower is not None:
                    follower.start()
            if (packages := self.processors()) is not None:
                self._put([packages], reserve=True)  # the power manager's processors here
            readings = self.power()
            if not self._power:
                self._put(list(readings), reserve=True)  # said once: no numbers follow
            while not stop():
                CapFollower.check(self.caps, self.llc, self.lifecycle)  # one stopped on a failure ends the agent
                self.count_alone(time.monotonic_ns())
                tick = time.monotonic()
                if duration_s is not None and tick - started >= duration_s:
                    break
                if tick >= next_rescan:
                    self.rescan()
                    if self.llc is not None:
                        self.llc.sync(self.jobs)
                    next_rescan = tick + self.options.rescan_s
                    if until_idle and not self.jobs and not self.state and self.forwarder.drain(timeout=0.2):
                        break
                if self._power and tick >= next_power:
                    readings = self.power()
                    if readings:
                        with suppress(SpoolFull):  # not kept while the broker is away (shutters stop too)
                            self._put(list(readings))
                    next_power = tick + self.options.power_interval_s
                self._send(self.batcher.due(_now()))  # the age bound: placement's estimates stay this fresh
                before_shutter = time.monotonic()
                self.shutter()
                after_shutter = time.monotonic()
                self.forwarder.pump(0)
                # Alg. 3 sleeps P after the three windows: a cycle lasts 3S + P (Eq. 9). Under an
                # adaptive schedule the cycle keeps that length whatever S the lone job got
                if self.options.schedule is None:
                    self.sleep(max(0.0, period - (time.monotonic() - after_shutter)))
                else:
                    self.sleep(max(0.0, cycle - (time.monotonic() - before_shutter)))
        finally:
            self.close(drain_s)
        return self.stats

    def close(self, drain_s: float = 10.0) -> None:
        """Stop: nothing is paused here (each shutter resumes before it returns; what a failed
        resume left is tried once more here, then by the watchdog). Give the broker ``drain_s`` to
        take what is spooled; what it does not take stays spooled for the next start."""
        if self.pauser.held():
            with suppress(WatchdogLost):
                self._resume()
        if not self._send(self.batcher.flush_all()):  # sent now rather than at the next start
            log.error("the spool is full: %d open batches stay in its meta until the next start",
                      len(self.batcher.open))
        for counter in self.counters.values():
            counter.close()
        self.counters = {}
        for follower in (self.caps, self.llc, self.lifecycle):
            if follower is not None:
                follower.stop()
        restored = self.powercap.restore_all()  # what stays unrestored, the watchdog tries once more
        if restored:
            log.info("restored %d power limits", restored)
        if self.resctrl is not None and (removed := self.resctrl.remove_all()):
            log.info("removed %d resctrl groups", removed)
        self.watchdog.close()
        self.source.close()
        self.forwarder.close(drain_s)
        if self.spool.rows:
            log.warning("%d events stay spooled in %s; they are sent when the agent starts again",
                        self.spool.rows, self.spool.path)
        self.spool.close()


def raise_open_files_limit() -> int:
    """The soft limit of open descriptors raised to the hard one (a task clock holds one per thread
    of every job: systemd's and container runtimes' soft default, 1024, is a few jobs of many
    threads). Returns the soft limit now."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError) as e:
            log.warning("could not raise the open-files limit from %d to %d (%s)", soft, hard, e)
    return soft


def check_signing_identity(settings: Any, node: str, *, static_jobs: bool) -> None:
    """Refuse to start (SigningError, a ValueError) with a key that cannot be read or is another
    identity's (every record this agent sent would be refused as forged), with the site secret on
    a Slurm node (whoever is root there could sign as any node or service), or with a node key for
    a static job file (its jobs' lifecycle events are a service's to sign: a single-host trial
    gives its agent the site secret instead)."""
    from nodeshare.runtime.identity import read_key

    if settings.site_secret_file is not None and not static_jobs:
        raise ValueError("an agent on a Slurm node holds its own key (signing_key_file, made by `nodeshare keys "
                         f"derive node/{node}`), never the site secret: root there could sign as anyone")
    if settings.signing_key_file is not None:
        identity, _ = read_key(settings.signing_key_file)
        if identity != f"node/{node}":
            raise ValueError(f"the signing key {settings.signing_key_file} is {identity}'s, and this agent is "
                             f"node {node!r}: give it node/{node}'s key (nodeshare keys derive node/{node})")
        if static_jobs:
            raise ValueError("a static job file's agent publishes its jobs' lifecycle, which a node key may not "
                             "sign (only a service may): on a single-host trial give it the site secret "
                             "(site_secret_file) instead of signing_key_file, or take the jobs from Slurm (--slurm)")
    elif settings.site_secret_file is not None:
        settings.signer(service=f"service/nodeshare-agent-{node}")  # readable, a secret


def build(settings: Any, options: AgentOptions, *, job_file: Path | None, slurm: bool,
          progress_dir: Path) -> Agent:
    """An agent on the configured broker, for a static job file or for Slurm."""
    from nodeshare.producers.kafka_producer import EventProducer

    raise_open_files_limit()

    from .jobs import SlurmJobs, StaticJobs, load_job_file

    if (job_file is None) == (not slurm):
        raise ValueError("choose the jobs: --jobs FILE (a static job file) or --slurm")
    check_signing_identity(settings, options.node, static_jobs=job_file is not None)
    source: JobSource = (StaticJobs(load_job_file(job_file), progress_dir) if job_file is not None
                         else SlurmJobs(progress_dir, options.freezer_root))

    def forwarder(spool: Spool) -> Forwarder:
        # librdkafka retries without a deadline; the spool bounds what waits (see Forwarder)
        return Forwarder(spool, lambda: EventProducer(settings, client_id=f"nodeshare-agent-{options.node}",
                                                      **{"message.timeout.ms": 0}))

    def caps(powercap: Powercap) -> CapFollower:
        return CapFollower(settings, options.node, powercap)

    def llc(resctrl: Resctrl) -> LlcFollower:
        return LlcFollower(settings, options.node, resctrl, options.mem_bandwidth_gbps)

    def lifecycle(on_event: Callable[[JobEvent], None]) -> LifecycleFollower:
        return LifecycleFollower(settings, options.node, on_event)

    return Agent(options, source, forwarder, settings.topic, cap_follower=caps, llc_follower=llc,
                 lifecycle_follower=lifecycle)
