"""The placement manager: profiles and placement decisions folded from one ordered log.

Placement needs the whole cluster in one place (every node's allocation, every pending job),
as PPartition does, so the stream worker's ``placement-router`` forwards lifecycle, inventory,
CAT episodes and degradation estimates (running ones carry each job's IPC moments) to the single-partition
``placement.cluster`` log, and ``placement-manager`` folds it here:

* ``ProfileBook`` (streams.core.profiles) turns the records into program profiles, published on
  ``profiles.program`` whenever one changes;
* a Spread-n-Share ``Scheduler`` (placement.sns) queues submitted jobs and places them; node
  allocations follow its decisions and the lifecycle (a job started elsewhere is booked where
  it really runs; an ended one frees its nodes);
* a Random Forest pair model (streams.core.pairing, Seed 003) is trained from the measured pairwise
  degradations in the profiles and retrained as they grow; it predicts a job's degradation next
  to the co-runners of its chosen nodes and refuses a placement predicted slower than alpha
  allows (the job is *serialized*: it waits for other nodes or for them to leave);
* before each Spread-n-Share pass, the waiting jobs that fit half a node are paired on the
  model's degradation graph (blossom or greedy, Seed 003); a pair predicted faster than one
  after the other and within both jobs' alpha starts together on one node (``pair`` decisions).

Each decision carries its inputs. Each node whose cache shares a record changed (a decision, a job
started elsewhere, one that ended) gets its whole set of shares on the compacted
``decisions.placement.nodes`` (``NodePlacementState``), which is what node agents with ``--resctrl``
read; ``restatement`` states every node's after a rebuild. Pure: the same log gives the same records.
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import numpy as np

from nodeshare.schemas.catalog import (
    CLUSTER_INVENTORY,
    ESTIMATES_DEGRADATION,
    JOBS_LIFECYCLE,
    NODE_LLC,
    spec_for_topic,
)
from nodeshare.schemas.events import (
    TERMINAL_STATES,
    DegradationEstimate,
    JobEvent,
    JobState,
    LlcShare,
    NodeInventory,
    NodePlacementState,
    PlacementAction,
    PlacementDecision,
    PlacementInputs,
    Record,
)
from nodeshare.schemas.serde import DecodeError, decode

from ..lifecycle import JobPhases, Phase
from ..pairing import PAIRINGS, DegradationModel, pair_queue
from ..profiles import FEATURES, ProfileBook
from .learned import InterferenceModel
from .sns import (
    DEFAULT_AGE_LIMIT_S,
    POLICIES,
    Decision,
    LlcDemand,
    NodeCapacity,
    PendingJob,
    Placement,
    Scheduler,
    classify,
    llc_demand,
)

SOURCE = "nodeshare.streams.placement"  # the producer named in every record: a contract, kept as first released
#: The topics the router forwards to the placement log. Not node.ipc: every block crosses the
#: worker once, in the charge fold, which sends each job's running estimate (with its IPC moments)
#: per batch of blocks on estimates.degradation.
ROUTED = (JOBS_LIFECYCLE, CLUSTER_INVENTORY, NODE_LLC, ESTIMATES_DEGRADATION)
#: The pair model needs this many jobs measured next to one other program before it predicts,
#: and is refitted when their number has grown by this share since the last fit.
MIN_PAIRS = 4
RETRAIN_GROWTH = 0.25
#: A program pair measured n times trains the model with min(n, ROWS_PER_PAIR) rows.
ROWS_PER_PAIR = 16
STATS = ("mean", "min", "max", "sd")
#: A program's profile is published on every final estimate, CAT episode and job start that changes
#: it, and when a running estimate takes its blocks past a multiple of PROFILE_EVERY (a job's final
#: estimate follows all its blocks).
PROFILE_EVERY = 256
#: The pairing pass looks at this many of the oldest waiting jobs that fit half a node.
PAIR_WINDOW = 64


@dataclass(frozen=True)
class BookProfile:
    """A program's profile as the scheduler reads it, straight from the book."""

    book: ProfileBook
    program: str

    def runtime_by_scale(self) -> Mapping[int, float]:
        return self.book.runtime_by_scale(self.program)

    def demand(self, cores_per_node: int, alpha: float) -> LlcDemand | None:
        ipc, bw = self.book.curves(self.program)
        return llc_demand(ipc, bw, alpha) if ipc else None


def feature_vector(book: ProfileBook, program: str) -> np.ndarray:
    """A program's counter features in a fixed order (0 where not measured yet)."""
    notes = book.programs.get(program)
    out = np.zeros(len(FEATURES) * len(STATS))
    if notes is None:
        return out
    for i, name in enumerate(FEATURES):
        m = notes.features.get(name)
        if m is not None and m.n > 0:
            s = m.feature()
            out[i * len(STATS):(i + 1) * len(STATS)] = (s.mean, s.min, s.max, s.sd)
    return out


@dataclass
class PairModel:
    """Seed 003's Random Forest over the profiles' measured program pairs, refitted whenever the
    jobs measured have grown by RETRAIN_GROWTH. Predictions are kept per ordered program pair
    until the next fit (a forest's predict costs ~10 ms whatever the rows, and the same pairs
    are asked about at every scheduling pass); a program first seen after a fit is predicted
    from its features when first asked about."""

    trees: int = 50
    model: DegradationModel | None = None
    measured: int = 0  # jobs measured next to one other program when the model was fitted
    predicted: dict[tuple[str, str], float] = field(default_factory=dict)

    def refresh(self, book: ProfileBook) -> bool:
        samples = list(book.pair_samples())
        total = sum(n for *_, n in samples)
        if len(samples) < 2 or total < MIN_PAIRS or total < self.measured * (1.0 + RETRAIN_GROWTH):
            return False
        # one row per measured job (up to ROWS_PER_PAIR): a forest's bootstrap drawn from a handful of
        # program pairs would leave each tree without some of them and blur every prediction
        reps = np.minimum([n for *_, n in samples], ROWS_PER_PAIR)
        fi = np.repeat([feature_vector(book, a) for a, *_ in samples], reps, axis=0)
        fj = np.repeat([feature_vector(book, b) for _, b, *_ in samples], reps, axis=0)
        deg = np.repeat([d for _, _, d, _ in samples], reps)
        self.model = DegradationModel(self.trees, seed=0).fit(fi, fj, deg)
        self.measured = total
        self.predicted.clear()
        return True

    def _fill(self, book: ProfileBook, pairs: Iterable[tuple[str, str]]) -> None:
        assert self.model is not None
        missing = sorted(set(pairs) - self.predicted.keys())
        if missing:
            fi = np.array([feature_vector(book, a) for a, _ in missing])
            fj = np.array([feature_vector(book, b) for _, b in missing])
            self.predicted.update(zip(missing, self.model.predict(fi, fj).tolist(), strict=True))

    def predict(self, book: ProfileBook, program: str, others: list[str]) -> list[float]:
        """Predicted Deg (%) of ``program`` next to each of ``others``; empty before the first fit."""
        if self.model is None or not others:
            return []
        self._fill(book, [(program, o) for o in others])
        return [self.predicted[(program, o)] for o in others]

    def matrix(self, book: ProfileBook, programs: list[str]) -> np.ndarray:
        """Predicted Deg for every ordered pair of ``programs``: ``out[i, j]`` is i next to j."""
        self._fill(book, [(a, b) for a in programs for b in programs])
        return np.array([[self.predicted[(a, b)] for b in programs] for a in programs])


@dataclass
class PlacementManager:
    policy: str = "SNS"
    age_limit_s: float = DEFAULT_AGE_LIMIT_S
    pairing: str = "blossom"  # or "greedy", or "off"
    prefix: str = ""
    book: ProfileBook = field(default_factory=ProfileBook)
    pairs: PairModel = field(default_factory=PairModel)
    #: the learned policy's measured slowdowns per program pair (placement.learned), folded from the
    #: lifecycle and final estimates this log carries, and from nothing else
    interference: InterferenceModel = field(default_factory=InterferenceModel)
    scheduler: Scheduler | None = None
    early: list[JobEvent] = field(default_factory=list)  # submissions before any node was known
    phases: JobPhases = field(default_factory=JobPhases)  # duplicate and late lifecycle events change nothing
    skipped: int = 0
    #: each node's cache shares as last stated on decisions.placement.nodes
    stated: dict[str, tuple[LlcShare, ...]] = field(default_factory=dict)
    clock: datetime | None = None  # the newest event time folded (a restatement's time)

    def __setstate__(self, state: dict[str, Any]) -> None:
        """A snapshot taken before schema 8 has no node states stated and no clock: none yet."""
        self.__dict__.update({"stated": {}, "clock": None, **state})

    def config(self) -> tuple[object, ...]:
        """What the manager was configured with (a snapshot under another is not used)."""
        return (self.policy, self.age_limit_s, self.pairing, self.prefix)

    def apply(self, topic: str, value: bytes | None) -> list[Record]:
        try:
            record = decode(spec_for_topic(topic, self.prefix), value)
        except (KeyError, DecodeError):
            self.skipped += 1  # the router dead-letters what it can; anything else is ignored here
            return []
        touched: set[str] = set()
        if self.clock is None or record.event_time > self.clock:
            self.clock = record.event_time
        running = isinstance(record, DegradationEstimate) and not record.final
        before = {p: n.blocks // PROFILE_EVERY for p, n in self.book.programs.items()} if running else {}
        changed = self.book.apply(record)
        if isinstance(record, JobEvent) or (isinstance(record, DegradationEstimate) and record.final):
            self.interference.apply(record)
        if running:  # one per batch of blocks: publish when a program's blocks pass a multiple of PROFILE_EVERY
            changed = {p for p in changed if self.book.programs[p].blocks // PROFILE_EVERY != before.get(p, 0)}
        out: list[Record] = [self.book.profile(p) for p in sorted(changed)]
        if isinstance(record, DegradationEstimate) and record.final and changed:
            self.pairs.refresh(self.book)  # measured pairs change only here
        if isinstance(record, NodeInventory) and record.processors_only:
            return out  # a node agent's packages: power's business; Slurm's record says the node
        if isinstance(record, NodeInventory):
            cap = NodeCapacity(record.cores, record.llc_ways, record.mem_bandwidth_gbps, record.usable)
            if self.scheduler is None:
                self.scheduler = Scheduler({record.node: cap}, POLICIES[self.policy], self.age_limit_s, self._veto,
                                           model=self.interference)
                for ev in self.early:
                    if self.phases.get(ev.job_id) is Phase.SUBMITTED:  # not started or ended meanwhile
                        self._submit(ev)
                self.early.clear()
            else:
                self.scheduler.add_node(record.node, cap)
            out += self._schedule(record)
        elif isinstance(record, JobEvent):
            if self.scheduler is not None and record.state is not JobState.SUBMITTED:
                touched |= self.scheduler.nodes_of(record.job_id)  # a start elsewhere or an end frees them
            out += self._lifecycle(record)
        touched |= {n for r in out if isinstance(r, PlacementDecision) for n in r.nodes}
        return out + self._node_states(touched, record)

    def shares(self, node: str) -> tuple[LlcShare, ...]:
        """The cache shares booked on ``node`` now, by job."""
        assert self.scheduler is not None
        return tuple(LlcShare(job_id=job, ways=ways, bandwidth_gbps=bw or None)
                     for job, (_, ways, bw) in sorted(self.scheduler.loads[node].jobs.items()) if ways > 0)

    def _node_states(self, nodes: Iterable[str], trigger: Record) -> list[Record]:
        """A ``NodePlacementState`` for each of ``nodes`` whose shares differ from those last stated."""
        out: list[Record] = []
        if self.scheduler is None:
            return out
        stated = self.stated
        for node in sorted(n for n in nodes if n in self.scheduler.loads):
            shares = self.shares(node)
            if stated.get(node, ()) != shares:
                stated[node] = shares
                out.append(self._node_state(node, shares, trigger.event_id, trigger.event_time))
        return out

    def _node_state(self, node: str, shares: tuple[LlcShare, ...], by: str, at: datetime) -> NodePlacementState:
        return NodePlacementState(event_id=str(uuid.uuid5(uuid.NAMESPACE_URL, f"placement-node/{node}/{by}")),
                                  source=SOURCE, event_time=at, node=node, shares=shares, decided_by=by)

    def restatement(self) -> list[NodePlacementState]:
        """Every known node's shares as this manager holds them, none included: published after each
        rebuild, so a node whose state was decided before the topic existed (an upgrade), whose record
        was lost, or that a manager rebuilt under another policy booked differently, has its own."""
        if self.scheduler is None:
            return []
        stated = self.stated
        at = self.clock or datetime(2000, 1, 1, tzinfo=UTC)
        out = []
        for node in sorted(self.scheduler.loads):
            shares = stated[node] = self.shares(node)
            held = ",".join(f"{s.job_id}:{s.ways}:{s.bandwidth_gbps}" for s in shares)
            out.append(self._node_state(node, shares, f"restated/{at.isoformat()}/{held}", at))
        return out

    def _submit(self, ev: JobEvent) -> None:
        assert self.scheduler is not None
        submitted = (ev.submit_time or ev.event_time).timestamp()
        self.scheduler.submit(PendingJob(ev.job_id, ev.cores, ev.alpha, submitted, BookProfile(self.book, ev.program),
                                         ev.program, ev.nodes_requested or 1, ev.nodes_max))

    def _program(self, job_id: str) -> str:
        notes = self.book.jobs.get(job_id)
        return notes.program if notes is not None and notes.program else "?"

    def _lifecycle(self, ev: JobEvent) -> list[Record]:
        if not self.phases.advance(ev):
            return []  # a duplicate, a submission of a job already started or ended, a second end
        if ev.state is JobState.SUBMITTED:
            if self.scheduler is None:
                self.early.append(ev)
                return []
            self._submit(ev)
            return self._schedule(ev)
        if self.scheduler is None:
            return []
        if ev.state is JobState.STARTED:
            self.scheduler.withdraw(ev.job_id)  # started by the resource manager, placed or not
            if self.scheduler.nodes_of(ev.job_id) != set(ev.nodes):  # not where we put it: book where it runs
                self.scheduler.release(ev.job_id)
                known = [n for n in ev.nodes if n in self.scheduler.loads]
                if known:
                    c = math.ceil(ev.cores / len(ev.nodes))
                    self.scheduler.allocate(ev.job_id, Placement(1, tuple(known), c, None, None, None))
            if self.scheduler.nodes_of(ev.job_id):
                self.scheduler.program_of[ev.job_id] = ev.program  # what the learned policy weighs it as
            return []
        if ev.state in TERMINAL_STATES:
            self.scheduler.withdraw(ev.job_id)
            self.scheduler.release(ev.job_id)
            return self._schedule(ev)
        return []

    def _co_runners(self, placement: Placement) -> dict[str, str]:
        return {j: self._program(j) for j in placement.co_jobs}

    def _veto(self, job: PendingJob, placement: Placement) -> str | None:
        co = self._co_runners(placement)
        program = self._program(job.job_id)
        if not co or self.pairs.model is None:
            return None
        worst = max(self.pairs.predict(self.book, program, list(co.values())))
        slowdown = (placement.predicted_slowdown or 1.0) * (1.0 + worst / 100.0)
        if slowdown > 1.0 / job.alpha:
            return (f"predicted {slowdown:.2f}x slower than its CE run next to {sorted(set(co.values()))} "
                    f"(alpha {job.alpha} allows {1.0 / job.alpha:.2f}x): serialized")
        return None

    def __post_init__(self) -> None:
        if self.pairing != "off" and self.pairing not in PAIRINGS:
            raise ValueError(f"pairing must be 'off' or one of {sorted(PAIRINGS)}, got {self.pairing!r}")

    def _schedule(self, trigger: Record) -> list[Record]:
        if self.scheduler is None:
            return []
        now = trigger.event_time.timestamp()
        decisions = self._pair(now) + self.scheduler.schedule(now)
        return [self._decision(d, trigger) for d in decisions]

    def _pair(self, now: float) -> list[Decision]:
        """Seed 003 on the waiting queue: the oldest PAIR_WINDOW jobs that fit half a node (and did not
        ask for more than one), paired on the predicted degradation graph; each pair the model deems
        worth it (``pair_queue``) starts on one node when one holds both and the veto accepts both.
        Aged jobs block younger ones here as in Spread-n-Share: one that does not fit half a node
        stops the window, pairs with an aged job start first, and while an aged job of the window
        waits unpaired no pair of younger jobs starts (Spread-n-Share then places it or stops at it)."""
        s = self.scheduler
        if self.pairing == "off" or self.pairs.model is None or s is None or not s.policy.share_nodes:
            return []
        window: list[PendingJob] = []
        for job in s.queue.values():
            if 2 * job.procs <= s.smallest.cores and job.min_nodes == 1:  # a pair shares one node
                window.append(job)
                if len(window) == PAIR_WINDOW:
                    break
            elif now - job.submitted >= s.age_limit_s:
                break
        if len(window) < 2:
            return []
        room = max((load.capacity.cores - load.used()[0] for load in s.loads.values() if load.capacity.usable),
                   default=0)
        if room < sum(sorted(j.procs for j in window)[:2]):
            return []  # no node holds even the two smallest: nothing worth predicting
        programs = [self._program(j.job_id) for j in window]
        deg, times = self._pair_inputs(programs)
        aged = {x.job_id for x in window if now - x.submitted >= s.age_limit_s}
        pairs = pair_queue(times, np.array([x.alpha for x in window]), deg, self.pairing)
        pairs.sort(key=lambda ij: not ({window[ij[0]].job_id, window[ij[1]].job_id} & aged))  # stable
        out: list[Decision] = []
        for i, j in pairs:
            a, b = window[i], window[j]
            if aged and not {a.job_id, b.job_id} & aged:
                break  # an aged job still waits: younger pairs must not take what it waits for
            placed = s.place_pair(a, b)
            if placed is None or self._veto(a, placed[0]) or self._veto(b, placed[1]):
                continue
            aged -= {a.job_id, b.job_id}
            for job, p, other in ((a, placed[0], b), (b, placed[1], a)):
                s.allocate(job.job_id, p)
                s.withdraw(job.job_id)
                out.append(Decision(job, p, f"{s.policy.name}: paired with {other.job_id} ({self.pairing})",
                                    partner=other.job_id))
        return out

    def _pair_inputs(self, programs: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """Predicted Deg for every ordered pair of these jobs (one prediction per pair of distinct
        programs) and their solo run times (profiled at scale 1; the median of the known ones
        for a program not profiled yet, all equal when none is)."""
        uniq = sorted(set(programs))
        matrix = self.pairs.matrix(self.book, uniq)
        ix = np.array([uniq.index(p) for p in programs])
        solo = {p: self.book.runtime_by_scale(p).get(1) for p in uniq}
        known = [t for t in solo.values() if t]
        default = float(np.median(known)) if known else 1.0
        return matrix[np.ix_(ix, ix)], np.array([solo[p] or default for p in programs])

    def _decision(self, d: Decision, trigger: Record) -> PlacementDecision:
        job, p = d.job, d.placement
        program = self._program(job.job_id)
        runtimes = self.book.runtime_by_scale(program)
        notes = self.book.programs.get(program)
        co = self._co_runners(p) if p else {}
        predicted = dict(zip(co, self.pairs.predict(self.book, program, list(co.values())), strict=False))
        slowdown = p.predicted_slowdown if p else None
        if slowdown is not None and predicted:
            slowdown *= 1.0 + max(predicted.values()) / 100.0
        if p is None:
            action = PlacementAction.SERIALIZE if d.refused else PlacementAction.DELAY
        else:
            action = PlacementAction.PAIR if d.partner else PlacementAction.PLACE
        inputs = PlacementInputs(
            trigger_event_id=trigger.event_id, program=program, processes=job.procs, alpha=job.alpha,
            program_class=classify(runtimes), profile_samples=notes.samples if notes else 0,
            runtime_s_by_scale={str(k): v for k, v in runtimes.items()},
            node_scores=dict(zip(p.nodes, p.node_scores, strict=True)) if p else {},
            co_runners=co, predicted_degradation_pct=predicted, model_pairs=self.pairs.measured)
        return PlacementDecision(
            event_id=f"placement:{job.job_id}:{trigger.event_id}", source=SOURCE, event_time=trigger.event_time,
            job_id=job.job_id, action=action, policy=self.policy,
            scale_factor=p.scale if p else None, nodes=p.nodes if p else (),
            cores_per_node=p.cores_per_node if p else None, llc_ways=p.ways if p else None,
            bandwidth_gbps=p.bandwidth_gbps if p else None, paired_with=d.partner, predicted_slowdown=slowdown,
            reason=d.reason,
            inputs=inputs)
