"""The per-job account: a pure reducer from a job's input events to its charge.

Longer than 500 lines because the reducer, its message envelope and its outputs are one state
machine that the worker, both audits and the experiments share; split, its invariants (below)
would be spread over files.

The stream worker folds events into a ``JobAccount`` as they arrive; the audit folds the
archived events through the same function. The charge is emitted exactly when the job has
ended *and* every node it ran on has closed its block stream (``JobLeftNode``), so its
content depends only on the set of events, never on how the two input topics interleave:

* blocks of a (job, node) stream and their closing marker share key, topic and producer,
  so the marker arrives after every block it counts;
* the end event carries the job's node list, start and end, so it is self-sufficient;
* blocks from nodes the end event does not list are ignored, whenever they arrive.

A node lost for good never sends its marker: a ``NodeDown`` record, keyed and ordered with the
node's blocks on node.ipc, closes its stream instead (so the blocks it closes over are a fixed set
too), and the node's late marker, if it comes back, makes a new revision from all it sent.

An operator's ``ChargeAdjustment`` (on jobs.lifecycle, so its place among the job's terminal events
is fixed) holds for the run of the job's latest terminal event (the first run, before any): that
run gets a revision at once, the same evidence priced with the adjustment, and its later revisions
(a correction, late data) keep it until another replaces it. A later run of a requeued job starts
unadjusted.

Redelivery (faust is at-least-once) is recognized by offset: an event at or below the
highest offset already applied for its topic partition is skipped, so each event counts once.
"""

from __future__ import annotations

import hashlib
import heapq
import math
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Annotated, Any, NamedTuple

import numpy as np
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PlainSerializer,
    PlainValidator,
    PrivateAttr,
    SerializerFunctionWrapHandler,
    TypeAdapter,
    model_serializer,
)

from nodeshare.schemas.catalog import DLQ, ESTIMATES_DEGRADATION, LEDGER_CHARGES, spec_for_topic
from nodeshare.schemas.dead_letters import NODESHARE_NAMESPACE, dead_letter
from nodeshare.schemas.events import (
    MAX_CHARGE_LEVELS,
    MAX_CHARGE_NODES,
    MAX_CHARGE_PROBLEMS,
    AdjustmentAction,
    AppliedAdjustment,
    Charge,
    ChargeAdjustment,
    DegradationEstimate,
    EstimateStatus,
    JobEvent,
    JobLeftNode,
    JobState,
    LevelEvidence,
    NodeBlocks,
    NodeDown,
    NodeSummary,
    OffsetRange,
    Record,
    RowProblem,
    SampleMoments,
    ShutterBatch,
    ShutterBlock,
    clock_problem,
    without_unset,
)
from nodeshare.schemas.serde import DecodeError, decode, decode_model, encode
from nodeshare.schemas.signing import AUTH_FIELD, identity_problem

from .blocks import block_rows, prior_max
from .confidence import (
    DEFAULT_CONFIDENCE,
    DEFAULT_MARGIN_ABS,
    DEFAULT_MARGIN_REL,
    DEFAULT_PRIOR_HIGH,
    DEFAULT_SHORT_MARGIN,
    DEFAULT_SHORT_SAMPLE_US,
    PRIOR,
    degradation_interval,
    short_sample_margin,
    short_sample_widening,
)
from .degradation import (
    DEFAULT_DELTA,
    DEFAULT_ESTIMATOR,
    MIXED_S,
    SECOND_MOMENTS,
    DegradationResult,
    DegradationSums,
    ExactSum,
    Moments,
    estimate,
)
from .pricing import (
    POPPA_EQ4,
    adjusted_price,
    alone_time,
    billed_time,
    billed_units,
    fair_charge,
    job_degradation,
)

SOURCE = "nodeshare.streams.accounting"  # the producer named in every record: a contract, kept as first released


#: ``Charge.code_version`` of charges priced under a policy no shell stamped (tests, experiments, the
#: audit's recomputation from a row's own policy)
UNSTAMPED_VERSION = "unstamped"


@dataclass(frozen=True)
class PricingPolicy:
    rate_per_core_hour: float = 1.0  # L
    delta: float = DEFAULT_DELTA
    rate_function: str = POPPA_EQ4
    estimator: str = DEFAULT_ESTIMATOR  # degradation.ESTIMATORS
    #: Every charge carries D's interval at ``confidence`` (streams.core.confidence); with
    #: ``price_at_bound`` it is priced at the interval's upper end, else at the point estimate.
    confidence: float = DEFAULT_CONFIDENCE
    price_at_bound: bool = False
    prior_high: float = DEFAULT_PRIOR_HIGH
    #: The interval's margin for the estimator's bias, margin_abs + margin_rel * D (schema 7;
    #: streams.core.confidence says how it was calibrated). An older row is audited with 0.
    margin_abs: float = DEFAULT_MARGIN_ABS
    margin_rel: float = DEFAULT_MARGIN_REL
    #: The short-sample margin (schema 10; streams.core.confidence): widens the interval of an
    #: estimate that rests on samples of S <= ``short_sample_us`` no longer S checked, and is added
    #: to the shared-time D priced where the job also never took its long samples. An older row is
    #: audited with 0.
    short_margin: float = DEFAULT_SHORT_MARGIN
    short_sample_us: int = DEFAULT_SHORT_SAMPLE_US
    #: Schema 10's interval rule (streams.core.confidence, "The trusted level's lower end"): a
    #: ``mixed_s`` interval reaches down to its longest S's own where kept shorter samples read higher
    #: beyond noise. A row from before schema 10 (no ``short_sample_us``) is audited without it.
    trusted_level_low: bool = True
    #: A job that shared without any estimate pays the prior's upper end (schema 6); before, the
    #: standard price (how the audit reprices an older row).
    prior_without_evidence: bool = True
    #: What the standard price multiplies (schema 8, pricing.billed_units): "cores" (POPPA's C), or
    #: "tres": Slurm's billing count where the lifecycle event carries it, else the (partition,
    #: TRESBillingWeights) pairs below applied to its TRES, else the cores
    standard_units: str = "cores"
    billing_weights: tuple[tuple[str, str], ...] = ()
    #: The build that prices (``Charge.code_version``): provenance, stamped by the shell that runs
    #: the fold (``Settings.policy``), so the pure core needs no package metadata; not part of the
    #: policy's identity. Empty: ``UNSTAMPED_VERSION``.
    code_version: str = field(default="", compare=False)


@dataclass(frozen=True)
class Origin:
    """Where an event was read from, and who wrote it: ``signer`` is the identity whose signature
    the shell verified ("" none; None: the site checks no identities, ``schemas.signing``)."""

    topic: str
    partition: int
    offset: int
    signer: str | None = None


@dataclass(frozen=True)
class Step:
    """What applying one event produced."""

    charges: tuple[Charge, ...] = ()
    estimate: DegradationEstimate | None = None
    rejected: str | None = None  # a reason: the event goes to the dead-letter topic
    redelivered: bool = False  # already applied: skipped silently
    blocks: BlockCounts | None = None  # what a batch's blocks came to (None: not a batch or block)
    rows: tuple[RowProblem, ...] = ()  # with ``rejected``: the batch's refused blocks (the others counted)
    field: str | None = None  # with ``rejected``: the field it names


class BlockCounts(NamedTuple):
    """A batch's blocks: counted and accepted by Alg. 4, counted and rejected by it, not counted
    (a bad value, a duplicate or out of order)."""

    accepted: int
    rejected: int
    refused: int


class _State(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=False)


def _exact(value: Any) -> ExactSum:
    return value if isinstance(value, ExactSum) else ExactSum(value)


#: An exact sum in state: live in memory (no copy per batch), persisted as the list of floats
#: whose exact sum it is (``ExactSum.parts``), the form earlier versions wrote.
ExactState = Annotated[ExactSum, PlainValidator(_exact), PlainSerializer(ExactSum.parts, return_type=list[float])]


class MomentState(_State):
    """``degradation.Moments`` as persisted state."""

    n: int = 0
    s1: ExactState = Field(default_factory=ExactSum)
    s2: ExactState = Field(default_factory=ExactSum)
    lo: float | None = None
    hi: float | None = None

    def moments(self) -> Moments:
        """The moments, sharing this state's sums (``store`` writes back the rest)."""
        return Moments(self.n, self.s1, self.s2,
                       math.inf if self.lo is None else self.lo, -math.inf if self.hi is None else self.hi)

    def store(self, m: Moments) -> None:
        if m.s1 is not self.s1 or m.s2 is not self.s2:
            self.s1, self.s2 = m.s1, m.s2
        self.n = m.n
        self.lo, self.hi = (m.lo, m.hi) if m.n else (None, None)


class _BlockSums(_State):
    """Exact sums of Alg. 4 (see degradation.ExactSum) over some blocks, with their second moments."""

    solo_filtered: ExactState = Field(default_factory=ExactSum)
    co_filtered: ExactState = Field(default_factory=ExactSum)
    solo_all: ExactState = Field(default_factory=ExactSum)
    co_all: ExactState = Field(default_factory=ExactSum)
    accepted: int = 0
    rejected: int = 0
    before_filtered: ExactState = Field(default_factory=ExactSum)
    after_filtered: ExactState = Field(default_factory=ExactSum)
    #: ``degradation.SECOND_MOMENTS``, in that order: the estimates' standard errors.
    second: tuple[ExactState, ...] = Field(default_factory=lambda: tuple(ExactSum() for _ in SECOND_MOMENTS))

    def sums(self) -> DegradationSums:
        """The sums, sharing this state's ``ExactSum``s: adding to them adds to the state (``store``
        writes back the counts). Merge them into a fresh ``DegradationSums`` to combine states."""
        return DegradationSums(self.solo_filtered, self.co_filtered, self.solo_all, self.co_all, self.accepted,
                               self.rejected, self.before_filtered, self.after_filtered, self.second)

    def store(self, s: DegradationSums) -> None:
        for name in _SUM_FIELDS:
            if getattr(s, name) is not getattr(self, name):
                setattr(self, name, getattr(s, name))
        self.accepted, self.rejected = s.accepted, s.rejected


class LevelSums(_BlockSums):
    """A stream's sums over its blocks at one sample length S other than its first (``NodeStream.levels``)."""


class NodeStream(_BlockSums):
    """One (job, node) block stream, from its first block to its JobLeftNode marker."""

    blocks: int = 0
    first_cycle: int = -1
    last_cycle: int = -1
    ignored: int = 0  # duplicate or out-of-order blocks (they precede the close, so the set is fixed)
    first_offset: int = -1  # node.ipc offsets of the stream's first event and of its close
    close_offset: int = -1
    closed: bool = False
    refused: int = 0  # blocks that arrived with a bad value (dead-lettered, not counted)
    close_event_id: str = ""  # the closing marker, to tell a re-sent copy from a new run's marker
    close_event_time: datetime | None = None
    blocks_sent: int = 0
    paused_us: int = 0
    alone_us: int = 0
    # The sums (``_BlockSums``) are kept per node because only the nodes named by the terminal event count.
    #: The sample length S (us) of the blocks its sums (``_BlockSums``) hold: the stream's first counted block's
    #: (0 in a stream folded before the sums were kept per S). Blocks at any other S go to ``levels``,
    #: so a stream at one S (the fixed schedule) keeps one set of sums and pays nothing for the others.
    sample_us: int = 0
    levels: dict[int, LevelSums] = {}
    # The counted blocks' sample IPCs, alone (during) and shared (before and after): the job's
    # features for the profiles, sent with each running estimate.
    ipc_alone: MomentState = Field(default_factory=MomentState)
    ipc_shared: MomentState = Field(default_factory=MomentState)
    # Closed by a ``NodeDown`` record, not by the node's marker: why, and where that record is. The
    # stream stays as it was then (what the revisions that priced it used); blocks and a marker the
    # node sends after it go to ``late``, a copy that continues it, priced by a new revision.
    lost: str = ""
    late: NodeStream | None = None

    def level_sums(self) -> dict[int, DegradationSums]:
        """The stream's sums per sample length S (only the first S for a stream at one S)."""
        out = {self.sample_us: self.sums()}
        for s_us, level in self.levels.items():
            out[s_us] = level.sums()
        return out

    def level(self, sample_us: int) -> LevelSums | NodeStream:
        """Where blocks at ``sample_us`` are summed: the stream itself at its first S (set by its first
        counted block), else its level of that S."""
        if sample_us == self.sample_us:
            return self
        if not self.blocks and not self.levels:
            self.sample_us = sample_us
            return self
        level = self.levels.get(sample_us)
        if level is None:
            level = self.levels[sample_us] = LevelSums()
        return level


_SUM_FIELDS = ("solo_filtered", "co_filtered", "solo_all", "co_all", "before_filtered", "after_filtered", "second")


class _OpenNodes:
    """Derived, never persisted: per uncharged revision, the nodes whose stream it is priced from has
    not closed yet, each with the run index k that ``streams_for`` gives it. Computed once per
    revision, shrunk as markers arrive, so readiness costs O(1) per marker, not O(nodes). Equal to
    any other (an account's identity is its persisted state; a cache rebuilt after loading is the same)."""

    __slots__ = ("by_revision",)

    def __init__(self) -> None:
        self.by_revision: dict[int, dict[str, int]] = {}

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _OpenNodes)

    __hash__ = None  # type: ignore[assignment]


class TerminalEvent(_State):
    event: JobEvent
    topic: str
    partition: int
    offset: int
    reason: str  # why this terminal event supersedes the previous one; empty for the first
    #: nodes whose stream was lost (``NodeDown``) and which this revision prices from their late data
    #: (blocks and marker sent after the record); the others' lost streams as they closed
    late: list[str] = []
    #: the operator's adjustment in force when this terminal event (or its copy) was taken in
    adjustment: AppliedAdjustment | None = None

    @model_serializer(mode="wrap")
    def _no_null_adjustment(self, handler: SerializerFunctionWrapHandler) -> Any:
        return without_unset(handler(self), _UNSET)


class JobAccount(_State):
    """Revision r of a job's charge is priced from the r-th distinct terminal event and the block
    streams of the nodes it names, each up to its JobLeftNode. Both are fixed sets whatever the
    order the two topics are read in, so every revision is too."""

    job_id: str
    nodes: dict[str, NodeStream] = {}  # each node's latest stream
    earlier: dict[str, list[NodeStream]] = {}  # a node's closed streams of the job's earlier runs, oldest first
    ends: list[TerminalEvent] = []
    revision: int = -1  # the last charge revision emitted; -1 before the first
    # per terminal event up to ``revision``, the "topic:partition:offset" of the event that completed its
    # charge ("" for one superseded before its nodes closed, never charged)
    triggers: list[str] = []
    applied: dict[str, int] = {}  # "topic:partition" -> highest offset applied
    ipc_partition: tuple[str, int] | None = None  # where this job's node.ipc events are read from
    latest_event_time: datetime | None = None  # event time of the newest event applied
    #: the operator's adjustment of the latest terminal event's run (before any: the first run's)
    adjustment: AppliedAdjustment | None = None
    #: each run's allocation as its started event stated it (start time -> (partition, TRES); schema
    #: 8): a terminal event that carries none (the Slurm source asked after the controller forgot the
    #: job) is priced with it
    allocations: dict[str, tuple[str | None, dict[str, float]]] = {}
    _open: _OpenNodes = PrivateAttr(default_factory=_OpenNodes)

    @property
    def end(self) -> JobEvent | None:
        return self.ends[-1].event if self.ends else None

    @model_serializer(mode="wrap")
    def _no_null_adjustment(self, handler: SerializerFunctionWrapHandler) -> Any:
        return without_unset(handler(self), _UNSET)

    # ------------------------------------------------------------------ the reducer

    def apply(self, record: Record, origin: Origin, policy: PricingPolicy, running_estimates: bool = True) -> Step:
        """Fold one event into the account (mutates it) and say what it produced. Without
        ``running_estimates`` a batch produces no estimate: the caller publishes
        ``running_estimate()`` when it chooses (the worker: the latest per job, twice a second)."""
        position = f"{origin.topic}:{origin.partition}"
        if origin.offset <= self.applied.get(position, -1):
            # Already applied. If this event completed charges, they are emitted again: the state that
            # says so may have been persisted while the charges themselves were lost in a crash. The
            # ledger's (job id, revision) key absorbs the copies.
            here = f"{position}:{origin.offset}"
            again = tuple(self._charge(r, policy) for r, t in enumerate(self.triggers) if t == here)
            return Step(charges=again, redelivered=True)
        self.applied[position] = origin.offset
        if self.latest_event_time is None or record.event_time > self.latest_event_time:
            self.latest_event_time = record.event_time
        if isinstance(record, ShutterBatch | ShutterBlock | JobLeftNode | NodeDown):
            self.ipc_partition = (origin.topic, origin.partition)
        if isinstance(record, ShutterBatch | ShutterBlock):
            return self._apply_blocks(record, origin, policy, running_estimates)
        if isinstance(record, JobLeftNode):
            return self._apply_left(record, origin, policy)
        if isinstance(record, JobEvent):
            return self._apply_lifecycle(record, origin, policy)
        if isinstance(record, NodeDown):
            return self._apply_down(record, origin, policy)
        if isinstance(record, ChargeAdjustment):
            return self._apply_adjustment(record, origin, policy)
        return Step(rejected=f"{type(record).__name__} is not a job accounting event")

    def _stream(self, node: str) -> NodeStream:
        ns = self.nodes.get(node)
        if ns is None:  # not setdefault: building a NodeStream for every batch costs as much as its fold
            ns = self.nodes[node] = NodeStream()
        return ns

    def _next_run(self, node: str) -> NodeStream:
        """Keep a node's closed stream as an earlier run's and open the next."""
        self.earlier.setdefault(node, []).append(self.nodes[node])
        ns = self.nodes[node] = NodeStream()
        return ns

    def _runs_of(self, node: str) -> list[NodeStream]:
        """A node's streams, one per run of the job there, oldest first."""
        return [*self.earlier.get(node, ()), *([self.nodes[node]] if node in self.nodes else [])]

    def _runs(self, revision: int) -> tuple[list[JobEvent], int]:
        """The runs named by the terminal events up to ``revision`` (each as its latest terminal event
        so far) and the index of ``revision``'s run. A terminal event whose [start, end] overlaps a
        run's (or starts with it) corrects that run, whatever field it changes, the times included;
        one that does not is a later run of a job requeued under its id (it starts after the other
        ended)."""
        runs: list[JobEvent] = []
        mine = 0
        for r, t in enumerate(self.ends[:revision + 1]):
            e = t.event
            at = next((i for i in range(len(runs) - 1, -1, -1) if _same_run(runs[i], e)), None)
            if at is None:
                runs.append(e)
                at = len(runs) - 1
            else:
                runs[at] = e
            if r == revision:
                mine = at
        return runs, mine

    def _needs(self, revision: int) -> list[tuple[str, int]]:
        """Each node terminal event ``revision`` names (sorted), with the index k of the node's stream
        its run is priced from: the number of earlier runs that list the node (see ``streams_for``)."""
        runs, mine = self._runs(revision)
        before = [set(run.nodes) for run in runs[:mine]]
        return [(node, sum(node in run for run in before)) for node in sorted(self.ends[revision].event.nodes)]

    def _kth_closed(self, node: str, k: int) -> bool:
        runs = self._runs_of(node)
        return k < len(runs) and runs[k].closed

    def streams_for(self, revision: int) -> list[tuple[str, NodeStream]] | None:
        """The block streams terminal event ``revision`` is priced from, sorted by node, or None while one
        has not closed. A job requeued under its id runs again, after its earlier run ended: each run
        (``_runs``, in the order the terminal events name them) has a node's k-th stream, k the number
        of earlier runs that list the node; corrections of a run share its streams. Decided from the
        terminal events up to ``revision`` only, so a revision's streams never change once it is priced."""
        out = []
        late = self.ends[revision].late
        for node, k in self._needs(revision):
            if not self._kth_closed(node, k):
                return None
            s = self._runs_of(node)[k]
            out.append((node, s.late if node in late and s.late is not None else s))
        return out

    def _ready(self, revision: int) -> bool:
        """Whether ``streams_for(revision)`` is not None, from the cached set of its open nodes: a
        stream, once closed, stays closed, and a node's runs are only ever appended, so the set only
        shrinks (``_node_closed``)."""
        open_nodes = self._open.by_revision.get(revision)
        if open_nodes is None:
            open_nodes = {node: k for node, k in self._needs(revision) if not self._kth_closed(node, k)}
            self._open.by_revision[revision] = open_nodes
        return not open_nodes

    def _node_closed(self, node: str) -> None:
        """A stream of ``node`` closed: drop it from each uncharged revision waiting for it there."""
        for open_nodes in self._open.by_revision.values():
            k = open_nodes.get(node)
            if k is not None and self._kth_closed(node, k):
                del open_nodes[node]

    def _apply_blocks(self, record: ShutterBatch | ShutterBlock, origin: Origin, policy: PricingPolicy,
                      running_estimates: bool = True) -> Step:
        """A batch (or one version-1/2 block): its valid blocks that extend the stream are counted,
        all at once; bad, duplicate and out-of-order blocks are refused, each with its index and reason."""
        ns = self._stream(record.node)
        rows = block_rows(record)
        if ns.lost and (ns.late is None or not ns.late.closed):
            ns = self._late(ns)  # the lost node's data, arriving after the record that closed its stream
        elif ns.closed:
            # Blocks past the closed stream's last cycle: the job runs on the node again (requeued under
            # its id), a new stream. Anything else is a copy of what the closed stream counted.
            if not (rows.valid & (rows.cycle > _latest(ns).last_cycle)).any():
                return Step(rejected="shutter block after the job left the node")
            ns = self._next_run(record.node)
        prior = prior_max(rows.cycle, rows.valid, ns.last_cycle)
        counted = rows.valid & (rows.cycle > prior)
        n = int(counted.sum())
        stale = [RowProblem(index=i, field="cycle", reason=f"cycle {rows.cycle[i]} out of order (last was {prior[i]})")
                 for i in np.flatnonzero(rows.valid & ~counted).tolist()]
        ns.ignored += len(stale)
        ns.refused += len(rows.problems)
        accepted = 0
        if n:
            level = ns.level(record.sample_us)  # a batch has one S
            sums = level.sums()
            alone, shared = ns.ipc_alone.moments(), ns.ipc_shared.moments()
            accepted = sums.add_rows(rows, counted, policy.delta, features=(alone, shared))
            level.store(sums)
            ns.ipc_alone.store(alone)
            ns.ipc_shared.store(shared)
            cycles = rows.cycle[counted]
            ns.blocks += n
            ns.last_cycle = int(cycles[-1])
            if ns.first_cycle < 0:
                ns.first_cycle = int(cycles[0])
            if ns.first_offset < 0:
                ns.first_offset = origin.offset
        problems = tuple(sorted((*rows.problems, *stale), key=lambda p: p.index))
        counts = BlockCounts(accepted, n - accepted, len(problems))
        estimate = (self._estimate(policy, final=False)
                    if n and running_estimates and isinstance(record, ShutterBatch) else None)
        if not problems:
            return Step(blocks=counts, estimate=estimate)
        if isinstance(record, ShutterBlock):  # one block: refused as versions 1 and 2 refused it
            p = problems[0]
            if stale:
                return Step(rejected=p.reason, blocks=counts)
            return Step(rejected=f"{p.field}: {p.reason}", field=p.field, blocks=counts)
        first = problems[0]
        return Step(rejected=f"{len(problems)} of {rows.n} blocks refused (the others counted); block {first.index}: "
                             f"{first.field}: {first.reason}", rows=problems, blocks=counts, estimate=estimate)

    def _apply_left(self, left: JobLeftNode, origin: Origin, policy: PricingPolicy) -> Step:
        ns = self._stream(left.node)
        if ns.lost and (ns.late is None or not ns.late.closed):
            return self._late_left(ns, left, origin, policy)
        if ns.closed:
            if (left.event_id, left.event_time) == (_latest(ns).close_event_id, _latest(ns).close_event_time):
                return Step(rejected="job already left this node (a copy of its marker)")
            ns = self._next_run(left.node)  # a later run of the job on this node, with no block
        ns.blocks_sent = left.blocks_sent
        ns.paused_us = left.paused_us
        ns.alone_us = left.alone_us
        return self._close(ns, left.node, left.event_id, left.event_time, origin, policy)

    def _apply_down(self, down: NodeDown, origin: Origin, policy: PricingPolicy) -> Step:
        """A node lost for good (``NodeDown``): its open stream of this job closes as it stands, priced
        from the blocks before this record, with no marker's claims (no pause credit, which only
        lowers a price; time alone 0, as for any node that reports none). A stream already closed is
        left alone: its node closed it before it went, or an earlier record did."""
        ns = self._stream(down.node)
        if ns.closed:
            return Step()
        where = f"{origin.topic}:{origin.partition}:{origin.offset}"
        ns.lost = f"{down.reason} ({down.source}, node.down record at {where})"
        return self._close(ns, down.node, down.event_id, down.event_time, origin, policy)

    def _close(self, ns: NodeStream, node: str, event_id: str, event_time: datetime, origin: Origin,
               policy: PricingPolicy) -> Step:
        """Close a node's stream at the record ``event_id`` (its marker, or a node-down record) and
        emit the charges that completes. No running estimate: closing adds no block, and an estimate
        over every node per marker made a capability job's markers quadratic. The final one, with the
        charge, covers the whole job."""
        ns.closed = True
        ns.close_event_id, ns.close_event_time = event_id, event_time
        ns.close_offset = origin.offset
        if ns.first_offset < 0:
            ns.first_offset = origin.offset
        self._node_closed(node)
        charges = self._ready_charges(policy, origin)
        return Step(charges=charges, estimate=self._estimate(policy, final=True) if charges else None)

    def _late(self, ns: NodeStream) -> NodeStream:
        """The continuation of a lost stream: a copy of it as it closed, open again (a copy through
        the persisted form, so it shares no sum with the stream the earlier revisions priced)."""
        if ns.late is None:
            ns.late = NodeStream.model_validate_json(ns.model_dump_json(exclude={"late"}))
            ns.late.closed, ns.late.lost = False, ""
            ns.late.close_event_id, ns.late.close_event_time, ns.late.close_offset = "", None, -1
        return ns.late

    def _late_left(self, ns: NodeStream, left: JobLeftNode, origin: Origin, policy: PricingPolicy) -> Step:
        """The lost node's own marker, after the record that closed its stream: late data. Its stream
        (every block it sent) closes, and a new revision of the job's latest terminal event is priced
        from it; before any terminal event, the first one gets that revision next to its own."""
        late = self._late(ns)
        late.closed = True
        late.close_event_id, late.close_event_time = left.event_id, left.event_time
        late.blocks_sent, late.paused_us, late.alone_us = left.blocks_sent, left.paused_us, left.alone_us
        late.close_offset = origin.offset
        if not self.ends:
            return Step()
        self._append_late(left.node, self.ends[-1], f"{origin.topic}:{origin.partition}:{origin.offset}")
        charges = self._ready_charges(policy, origin)
        return Step(charges=charges, estimate=self._estimate(policy, final=True) if charges else None)

    def _late_nodes(self, revision: int) -> set[str]:
        """Nodes of terminal event ``revision`` whose k-th stream was lost and whose late data has closed."""
        out = set()
        for node, k in self._needs(revision):
            runs = self._runs_of(node)
            late = runs[k].late if k < len(runs) and runs[k].lost else None
            if late is not None and late.closed:
                out.add(node)
        return out

    def _pending_late(self, revision: int) -> list[str]:
        """Lost nodes of ``revision`` whose late data closed and that no revision of its run priced yet,
        in the order their markers were read (node.ipc offsets: the same in every fold)."""
        k_of = dict(self._needs(revision))
        todo = self._late_nodes(revision) - set(self.ends[revision].late)
        return sorted(todo, key=lambda n: self._runs_of(n)[k_of[n]].late.close_offset)  # type: ignore[union-attr]

    def _append_late(self, node: str, last: TerminalEvent, where: str) -> None:
        """A revision of ``last``'s run priced from ``node``'s late data (and every late stream an
        earlier revision of it took), if that run's stream of the node is the one that closed."""
        r = len(self.ends) - 1
        if node not in self._late_nodes(r) or node in last.late:
            return
        self.ends.append(TerminalEvent(
            event=last.event, topic=last.topic, partition=last.partition, offset=last.offset,
            reason=f"late data: node {node}, declared lost, closed its stream with its marker at {where}",
            late=sorted({*last.late, node}), adjustment=last.adjustment))

    def _apply_lifecycle(self, event: JobEvent, origin: Origin, policy: PricingPolicy) -> Step:
        run_key = event.start_time.isoformat() if event.start_time is not None else ""
        if event.state is JobState.STARTED and event.tres:
            self.allocations[run_key] = (event.partition, dict(event.tres))
        if not event.ran:  # submitted, started, or cancelled before it started: nothing to charge
            return Step()
        if not event.tres and run_key in self.allocations:  # priced with the allocation its start stated
            allocated_in, tres = self.allocations[run_key]
            event = event.model_copy(update={"tres": tres, "partition": event.partition or allocated_in})
        reason = ""
        if self.ends:
            changed = _billing_changes(self.ends[-1].event, event)
            if not changed:
                return Step(rejected=f"job already {self.ends[-1].event.state.value}; duplicate terminal event")
            # The resource manager corrected the job's record: a new revision supersedes the last.
            reason = f"lifecycle correction ({', '.join(changed)}) at {origin.topic}:{origin.partition}:{origin.offset}"
        # A lost node's late data already priced by a revision of this run stays in; late data not
        # yet priced (it closed before this run's first terminal event) is priced next, after it.
        same = next((t for t in reversed(self.ends) if _same_run(t.event, event)), None)
        prior = set(same.late) if same is not None else set()
        # the adjustment of this run, if it has one (one sent before any terminal event: the first run's);
        # a later run of a requeued job is not the one the operator adjusted
        self.adjustment = same.adjustment if same is not None else (self.adjustment if not self.ends else None)
        if reason and self.adjustment is not None:
            reason += (f"; the {self.adjustment.action} by {self.adjustment.operator} at {self.adjustment.at} "
                       "still applies")
        self.ends.append(TerminalEvent(event=event, topic=origin.topic, partition=origin.partition,
                                       offset=origin.offset, reason=reason, adjustment=self.adjustment))
        r = len(self.ends) - 1
        self.ends[r].late = sorted(prior & self._late_nodes(r))
        for node in self._pending_late(r):
            late = self._runs_of(node)[dict(self._needs(r))[node]].late
            assert late is not None and self.ipc_partition is not None  # _late_nodes: its late data closed
            topic, partition = self.ipc_partition
            self._append_late(node, self.ends[-1], f"{topic}:{partition}:{late.close_offset}")
        charges = self._ready_charges(policy, origin)
        return Step(charges=charges, estimate=self._estimate(policy, final=True) if charges else None)

    def _apply_adjustment(self, adj: ChargeAdjustment, origin: Origin, policy: PricingPolicy) -> Step:
        """An operator's adjustment of the run of the job's latest terminal event: a new revision of
        that event (same run, same streams) priced with it, at once if the run's nodes have closed;
        before any terminal event it waits for the first. One that changes nothing (the same action
        and price as the one in force, or a restore with none) is refused, and so is a copy of one
        already taken (the same event id: a replay would undo a later restore)."""
        where = f"{origin.topic}:{origin.partition}:{origin.offset}"
        taken = {t.adjustment.event_id for t in self.ends if t.adjustment is not None}
        if adj.event_id in taken or (self.adjustment is not None and self.adjustment.event_id == adj.event_id):
            return Step(rejected=f"{adj.action.value} {adj.event_id} was taken before (a copy, sent again)")
        new = None if adj.action is AdjustmentAction.RESTORE else AppliedAdjustment(
            action=adj.action.value, requested_price=adj.price, reason=adj.reason, operator=adj.operator,
            event_id=adj.event_id, at=where)
        held = self.adjustment
        if new is None and held is None:
            return Step(rejected=f"{adj.action.value} changes nothing: no adjustment is in force")
        if new is not None and held is not None and (new.action, new.requested_price) == (held.action,
                                                                                        held.requested_price):
            to = f" to {held.requested_price} SU" if held.requested_price is not None else ""
            return Step(rejected=f"{adj.action.value} changes nothing: the job's charge is already {held.action}ed{to}")
        self.adjustment = new
        if not self.ends:
            return Step()  # held for the job's first terminal event
        last = self.ends[-1]
        asked = "adjustment withdrawn" if new is None else (
            "voided" if new.action == "void" else f"adjusted to {new.requested_price} SU")
        self.ends.append(TerminalEvent(
            event=last.event, topic=last.topic, partition=last.partition, offset=last.offset,
            reason=f"{asked} by {adj.operator} at {where}: {adj.reason}", late=list(last.late), adjustment=new))
        charges = self._ready_charges(policy, origin)
        return Step(charges=charges, estimate=self._estimate(policy, final=True) if charges else None)

    # ------------------------------------------------------------------ derived values

    def degradation(self, nodes: tuple[str, ...] | None = None, estimator: str = DEFAULT_ESTIMATOR,
                    ) -> DegradationResult:
        """The estimate over the latest stream of each of ``nodes`` (default: every node)."""
        named = [n for n in sorted(nodes if nodes is not None else self.nodes) if n in self.nodes]
        return estimate_streams([self.nodes[n] for n in named], estimator)

    def running_estimate(self, policy: PricingPolicy) -> DegradationEstimate:
        """The job's degradation estimate as its account stands (what a batch would publish)."""
        return self._estimate(policy, final=False)

    def _estimate(self, policy: PricingPolicy, final: bool) -> DegradationEstimate:
        end = self.end
        res = self.degradation(end.nodes if end else None, policy.estimator)
        assert self.latest_event_time is not None  # set by apply() before any estimate
        when = end.end_time if final and end and end.end_time else self.latest_event_time
        return DegradationEstimate(
            event_id=str(uuid.uuid5(NODESHARE_NAMESPACE, f"estimate:{self.job_id}:{self._evidence_key()}")),
            source=SOURCE,
            event_time=when,
            job_id=self.job_id, status=res.status, degradation=res.degradation,
            filtered=res.filtered, unfiltered=res.unfiltered, corrected=res.corrected, estimator=res.estimator,
            blocks_used=res.blocks_used,
            blocks_rejected=res.blocks_rejected, delta=policy.delta, final=final,
            features=self.features(),
        )

    def features(self) -> dict[str, SampleMoments]:
        """The job's sample IPC moments over every node's counted blocks (for the profiles)."""
        out = {}
        for name in ("ipc_alone", "ipc_shared"):
            states = [getattr(self.nodes[node], name) for node in sorted(self.nodes)]
            if len(states) == 1:  # most jobs: one node, whose moments need no merging
                total = states[0].moments()
            else:
                total = Moments()
                for state in states:
                    total.merge(state.moments())
            summary = total.summary()
            if summary is not None:
                out[name] = summary
        return out

    def _evidence_key(self) -> str:
        streams = ",".join(f"{n}:{len(self.earlier.get(n, ()))}:{s.blocks}:{int(s.closed)}"
                           for n, s in sorted(self.nodes.items()))
        return f"{streams}/{len(self.ends)}"

    def _ready_charges(self, policy: PricingPolicy, origin: Origin) -> tuple[Charge, ...]:
        """Every revision whose terminal event has arrived and whose nodes have all closed, in order.
        A revision still waiting for a node is skipped once a later correction of the same run is
        ready (a correction that drops a wrongly listed node must not wait behind it for ever): it is
        superseded, and never charged."""
        out = []
        while self.revision + 1 < len(self.ends):
            r = self.revision + 1
            if not self._ready(r):
                run = self._runs(r)[1]
                if not any(self._runs(later)[1] == run and self._ready(later)
                           for later in range(r + 1, len(self.ends))):
                    break
                self.revision = r
                self._open.by_revision.pop(r, None)
                self.triggers.append("")
                continue
            self.revision = r
            self._open.by_revision.pop(r, None)
            self.triggers.append(f"{origin.topic}:{origin.partition}:{origin.offset}")
            out.append(self._charge(r, policy))
        return tuple(out)

    def _charge(self, revision: int, policy: PricingPolicy) -> Charge:
        streams = self.streams_for(revision)
        assert streams is not None  # only revisions whose streams have all closed are charged
        estimate = estimate_streams([s for _, s in streams], policy.estimator)
        return build_charge(self.job_id, revision, self.ends[revision], streams, estimate, policy, self.ipc_partition)

    def superseded_charges(self, policy: PricingPolicy) -> tuple[Charge, ...]:
        """The revisions skipped as superseded (``_ready_charges``) whose nodes have closed since: a
        worker that read the closing markers earlier charged them, so an audit must be able to check
        such a row, though it need not find one."""
        return tuple(self._charge(r, policy) for r, t in enumerate(self.triggers)
                     if not t and self.streams_for(r) is not None)

    def awaiting(self) -> JobEvent | None:
        """The terminal event of the first revision not charged yet (waiting for a node's stream
        to close), or None when every terminal event so far is charged or superseded."""
        r = self.revision + 1
        return self.ends[r].event if r < len(self.ends) else None

    def waiting_for(self) -> list[tuple[str, int | None]]:
        """Why the first uncharged revision is not charged: each node it names whose block stream
        has not closed, with the blocks counted on it (None: nothing of the job ever came from it)."""
        r = self.revision + 1
        if r >= len(self.ends):
            return []
        out: list[tuple[str, int | None]] = []
        for node, k in self._needs(r):
            runs = self._runs_of(node)
            if k >= len(runs):
                out.append((node, None))
            elif not runs[k].closed:
                out.append((node, runs[k].blocks))
        return out

    # ------------------------------------------------------------------ persistence

    def dumps(self) -> bytes:
        return self.model_dump_json().encode()

    @classmethod
    def loads(cls, raw: bytes | None, job_id: str) -> JobAccount:
        return cls(job_id=job_id) if raw is None else cls.model_validate_json(raw)


#: Schema 8's state fields, not written when they say nothing (no operator adjusted the job, no source
#: gave TRES): the states of such jobs read as they did, so a worker rolled back across schema 8 reads
#: its snapshots and settled accounts (docs/upgrades.md)
_UNSET: dict[str, Any] = {"adjustment": None, "allocations": {}}


def _latest(ns: NodeStream) -> NodeStream:
    """A stream as its node last left it: a lost stream's late data, when the node sent some."""
    return ns.late if ns.late is not None else ns


def _same_run(run: JobEvent, e: JobEvent) -> bool:
    """Whether terminal event ``e`` describes the same run as ``run`` (see ``JobAccount._runs``)."""
    assert run.start_time is not None and run.end_time is not None  # guaranteed by JobEvent.ran
    assert e.start_time is not None and e.end_time is not None
    return e.start_time == run.start_time or (e.start_time < run.end_time and run.start_time < e.end_time)


def estimate_streams(streams: list[NodeStream], estimator: str = DEFAULT_ESTIMATOR) -> DegradationResult:
    """The degradation estimate over the blocks of some node streams (sorted by node); ``mixed_s``
    also from their sums per sample length S, combined across nodes by S."""
    if len(streams) == 1 and not streams[0].levels:  # most jobs: one node at one S, nothing to merge
        s = streams[0]
        return estimate(s.sums(), estimator, {s.sample_us: s.sums()} if estimator == MIXED_S else None)
    total = DegradationSums()
    by_s: dict[int, DegradationSums] = {}
    for s in streams:
        for s_us, sums in s.level_sums().items():
            total.merge(sums)
            if estimator == MIXED_S:
                by_s.setdefault(s_us, DegradationSums()).merge(sums)
    return estimate(total, estimator, by_s if estimator == MIXED_S else None)


#: What a node's pause claim may exceed its bound by (the agent's clock and rescan period against the
#: resource manager's): paused <= MAX_PAUSE_SHARE * run time + MARKER_SLACK_S.
MARKER_SLACK_S = 10.0
#: The most of a job's run its shutters can have paused it on a node. A co-runner is paused for one
#: sample window K S of each cycle of P + 3 K S (Eq. 9): 1.5% at the default S = 3.2 ms, P = 200 ms,
#: and at S = 51.2 ms, P = 3.2 s; a claim above this share is no pause a shutter makes.
MAX_PAUSE_SHARE = 0.05


def marker_problems(node: str, s: NodeStream, run_time_s: float) -> tuple[list[str], list[str]]:
    """Physical bounds on what a node's closing marker claims, checked against the blocks that
    arrived and the job's run time: (why the marker is refused, what evidence is missing).

    Refused: more blocks counted than the marker says were sent, or more time paused than the
    shutters can pause a job (``MAX_PAUSE_SHARE`` of its run, plus ``MARKER_SLACK_S`` for the agent's
    clock against the resource manager's). A refused marker's pause credit is not applied: every
    rule fails toward the higher price, since the credit is the only claim of a marker that lowers
    it. Its time alone, which can only raise the price (it shrinks the discount, and is clamped to
    the run), is kept, and its blocks, each checked on its own, still count. Missing: fewer blocks
    arrived than were sent (a lost or refused batch); the charge is priced from those that arrived,
    and says so."""
    refused, missing = [], []
    if s.lost:  # no marker: nothing it claims to check, and its node's unsent blocks are not counted
        return [], [f"node {node}: lost before it closed its stream: {s.lost}; priced from the {s.blocks} blocks "
                    f"it sent before, with no pause credit or time alone from it"]
    if s.blocks > s.blocks_sent:
        refused.append(f"node {node}: {s.blocks} blocks counted but its marker says {s.blocks_sent} were sent")
    if s.paused_us / 1e6 > run_time_s * MAX_PAUSE_SHARE + MARKER_SLACK_S:
        refused.append(f"node {node}: its marker claims {s.paused_us / 1e6:.3f} s paused, more than shutters pause "
                       f"a job in a run of {run_time_s:.3f} s ({MAX_PAUSE_SHARE:.0%} of it)")
    arrived = s.blocks + s.refused
    if arrived < s.blocks_sent:
        missing.append(f"node {node}: {s.blocks_sent - arrived} of the {s.blocks_sent} blocks its marker says were "
                       f"sent never arrived")
    return refused, missing


def node_blocks(streams: list[tuple[str, NodeStream]]) -> tuple[NodeBlocks, ...]:
    """What a charge says of each node's stream (sorted by node): all of it for a job on up to
    ``MAX_CHARGE_NODES`` nodes; beyond, the charge carries their ``NodeSummary``, and this, from the
    archive's fold (``JobAccount.streams_for``), is the detail its digest covers."""
    return tuple(NodeBlocks(node=n, blocks=s.blocks, first_cycle=s.first_cycle, last_cycle=s.last_cycle,
                            blocks_sent=s.blocks_sent, paused_s=s.paused_us / 1e6, alone_s=s.alone_us / 1e6)
                 for n, s in streams)


_NODE_LIST = TypeAdapter(tuple[NodeBlocks, ...])


def node_detail(nodes: tuple[NodeBlocks, ...]) -> tuple[tuple[NodeBlocks, ...], NodeSummary | None]:
    """``Charge.nodes`` and ``Charge.node_summary`` for these nodes: the list itself up to
    ``MAX_CHARGE_NODES`` (so a charge stays far below a broker's 1 MB message limit), beyond it none
    and a summary whose ``sha256`` is of the JSON the list would have encoded to, so an audit that
    recomputes the charge still checks every node's numbers."""
    if len(nodes) <= MAX_CHARGE_NODES:
        return nodes, None
    return (), NodeSummary(
        count=len(nodes), blocks=sum(n.blocks for n in nodes), blocks_sent=sum(n.blocks_sent for n in nodes),
        paused_s=max(n.paused_s for n in nodes), alone_s=math.fsum(n.alone_s for n in nodes),
        sha256=hashlib.sha256(_NODE_LIST.dump_json(nodes)).hexdigest())


def build_charge(job_id: str, revision: int, terminal: TerminalEvent, streams: list[tuple[str, NodeStream]],
                 degradation: DegradationResult, policy: PricingPolicy,
                 ipc_partition: tuple[str, int] | None) -> Charge:
    """Revision ``revision`` of a job's charge from its terminal event, the block streams of the
    nodes it names (sorted by node) and their degradation estimate. Shared by the reducer and
    the vectorized audit, so both write the same row for the same evidence."""
    end = terminal.event
    assert end.start_time is not None and end.end_time is not None  # guaranteed by JobEvent.ran
    run_time_s = (end.end_time - end.start_time).total_seconds()
    problems: list[str] = []
    credited: list[NodeStream] = []  # the streams whose marker's pause credit holds
    for node, s in streams:
        refused, missing = marker_problems(node, s, run_time_s)
        problems += refused + missing
        if not refused:
            credited.append(s)
    # A job is held up while any of its nodes pauses it; the longest per-node total is a lower
    # bound of that union, so the credit never exceeds the time really lost.
    credit_s = max((s.paused_us for s in credited), default=0) / 1e6
    # The blocks measure D while the job shared a node; its time alone (never shuttered) was undisturbed.
    billed_s = billed_time(run_time_s, credit_s)
    alone_s = alone_time([s.alone_us / 1e6 for _, s in streams], len(end.nodes), billed_s)
    # An estimate from unchecked short samples is unsure: its interval is wider, and where its long
    # samples were never taken (biased low by the refill) its price carries a margin. Not where
    # evidence is missing or was set aside (a lost node, blocks that never arrived, a refused
    # marker): every rule fails toward the higher price, and a long block that went missing must
    # not buy the margin. A block refused for a bad value is dead-lettered and, like every bad
    # record, changes no charge (tests/unit/test_bad_input.py).
    whole = not (problems or any(s.lost for _, s in streams))
    widen = short_sample_widening(degradation, policy.short_margin, policy.short_sample_us) if whole else 0.0
    short = short_sample_margin(degradation, policy.short_margin, policy.short_sample_us) if whole else 0.0
    interval = degradation_interval(degradation, policy.confidence, policy.prior_high, policy.margin_abs,
                                    policy.margin_rel, widen, policy.trusted_level_low)
    point, low, high, priced = (job_degradation(d, alone_s, billed_s)
                                for d in (degradation.degradation, interval.low, interval.high,
                                          min(1.0, degradation.degradation + short)))
    # At the point estimate (plus the short-sample margin) by default; a job that shared without any
    # estimate is always priced at the prior's upper end over the time it shared, never the standard
    # price in silence.
    no_evidence = (policy.prior_without_evidence and interval.method == PRIOR
                   and degradation.status is not EstimateStatus.OK)
    applied = high if policy.price_at_bound or no_evidence else priced
    units, billed_by = billed_units(end.cores, end.tres, dict(policy.billing_weights).get(end.partition or ""),
                                    policy.standard_units == "tres")
    amounts = fair_charge(policy.rate_per_core_hour, units, run_time_s, applied, policy.rate_function, credit_s)
    adj = terminal.adjustment
    price = (amounts.price if adj is None
             else adjusted_price(adj.action, adj.requested_price, amounts.standard_price, amounts.price))
    ranges = [OffsetRange(topic=terminal.topic, partition=terminal.partition,
                          first_offset=terminal.offset, last_offset=terminal.offset)]
    if ipc_partition is not None and streams:
        topic, partition = ipc_partition
        ranges.append(OffsetRange(topic=topic, partition=partition,
                                  first_offset=min(s.first_offset for _, s in streams),
                                  last_offset=max(s.close_offset for _, s in streams)))
    nodes, summary = node_detail(node_blocks(streams))
    if summary is not None and len(problems) > MAX_CHARGE_PROBLEMS:
        more = len(problems) - MAX_CHARGE_PROBLEMS
        problems = [*problems[:MAX_CHARGE_PROBLEMS], f"... and {more} more (each follows from a node's numbers, "
                                                     "which node_summary.sha256 covers)"]
    return Charge(
        event_id=str(uuid.uuid5(NODESHARE_NAMESPACE, f"charge:{job_id}:{revision}")),
        source=SOURCE,
        event_time=end.end_time,
        job_id=job_id, revision=revision, revision_reason=terminal.reason, final_state=end.state,
        user=end.user, account=end.account, program=end.program, cores=end.cores,
        partition=end.partition, billing_units=None if billed_by is None else units, billing_weights=billed_by,
        start_time=end.start_time, end_time=end.end_time,
        run_time_s=run_time_s, pause_credit_s=credit_s, billed_time_s=amounts.billed_time_s,
        solo_time_s=amounts.solo_time_s,
        degradation=applied,
        estimate_status=EstimateStatus.NODE_LOST if any(s.lost for _, s in streams) else degradation.status,
        degradation_filtered=degradation.filtered, degradation_unfiltered=degradation.unfiltered,
        degradation_corrected=degradation.corrected, estimator=degradation.estimator,
        degradation_shared=degradation.degradation, alone_s=alone_s,
        blocks_used=degradation.blocks_used, blocks_rejected=degradation.blocks_rejected,
        blocks_ignored=sum(s.ignored for _, s in streams),
        nodes=nodes, node_summary=summary,
        rate_function=policy.rate_function, rate_per_core_hour=policy.rate_per_core_hour,
        delta=policy.delta,
        standard_price=amounts.standard_price, solo_price=amounts.solo_price,
        price=price, dividend=amounts.dividend, adjustment=adj, adjustment_credit=amounts.price - price,
        event_range=tuple(sorted(ranges, key=lambda r: r.topic)),
        evidence_problems=tuple(problems),
        degradation_point=point, degradation_low=low, degradation_high=high,
        interval_method=interval.method, interval_blocks=interval.blocks, confidence=policy.confidence,
        priced_at="upper_bound" if policy.price_at_bound else "estimate", prior_degradation_high=policy.prior_high,
        interval_margin_abs=policy.margin_abs, interval_margin_rel=policy.margin_rel,
        short_margin=policy.short_margin, short_sample_us=policy.short_sample_us, short_margin_applied=short,
        levels=level_evidence(degradation),
        code_version=policy.code_version or UNSTAMPED_VERSION,
    )


def level_evidence(degradation: DegradationResult) -> tuple[LevelEvidence, ...]:
    """``Charge.levels``: a ``mixed_s`` estimate's levels, by S, at most ``MAX_CHARGE_LEVELS`` (the
    used ones first, then those with the most blocks)."""
    levels = list(degradation.levels)
    if len(levels) > MAX_CHARGE_LEVELS:
        levels.sort(key=lambda v: (not v.used, -(v.blocks_used + v.blocks_rejected), v.sample_us))
        levels = sorted(levels[:MAX_CHARGE_LEVELS], key=lambda v: v.sample_us)
    return tuple(LevelEvidence(sample_us=v.sample_us, blocks_used=v.blocks_used, blocks_rejected=v.blocks_rejected,
                               degradation=v.degradation, standard_error=v.standard_error, used=v.used)
                 for v in levels)


#: Dead-letter kind of a record its signer may not have written (or that no one signed), when the
#: site checks identities.
FORGED = "forged"


@dataclass(frozen=True)
class Outgoing:
    """A message to publish: catalog topic (without prefix), key, value; for a dead letter, its kind
    (decode, key_mismatch, clock or rejected) for metrics."""

    topic: str
    key: bytes
    value: bytes
    kind: str = ""


class Processed(NamedTuple):
    state: bytes | None  # the job's new state; None when unchanged
    out: list[Outgoing]  # what to publish
    blocks: BlockCounts | None  # what a batch's blocks came to, for metrics; None otherwise


#: The fields of a terminal event whose change is a correction (a new revision). Not the partition and
#: TRES (schema 8): Slurm never corrects an allocation after the fact, and a hook file the Slurm source
#: sends again after the controller forgot the job carries none: a copy, not a correction to cores.
_BILLED_FIELDS = ("state", "user", "account", "program", "cores", "nodes", "start_time", "end_time")


def _billing_changes(old: JobEvent, new: JobEvent) -> list[str]:
    return [f for f in _BILLED_FIELDS if getattr(old, f) != getattr(new, f)]


def apply_message(
    account: JobAccount | None, origin: Origin, key: bytes | None, value: bytes | None, timestamp_s: float,
    policy: PricingPolicy, prefix: str = "", running_estimates: bool = True,
    load: Callable[[bytes | None], JobAccount | None] | None = None,
) -> tuple[JobAccount | None, list[Outgoing], BlockCounts | None]:
    """One input message in: the job's account after it (``account`` itself, changed in place, or a
    new one; None when the message changed no account) and the messages to publish. Without
    ``account``, ``load`` gives the job's account kept elsewhere (the worker's settled accounts;
    None: it has none), asked only once the message passed every check that needs no account (a
    malformed, forged or misaddressed record never costs a read), and raising AccountUnavailable
    when it has one that cannot be read back: the caller then dead-letters the message.

    The stream worker keeps accounts in memory and calls this; ``process_message`` is the same
    step on serialized state. The audit folds the archive through it too, so both apply the same
    rules to the same bytes.
    """
    def reject(reason: str, field: str | None = None, kind: str = "rejected",
               rows: tuple[RowProblem, ...] = ()) -> list[Outgoing]:
        dl = dead_letter(origin.topic, origin.partition, origin.offset, key, value, timestamp_s, reason,
                         field=field, source=SOURCE, rows=rows)
        return [Outgoing(DLQ.name, origin.topic.encode(), encode(dl), kind)]

    spec = spec_for_topic(origin.topic, prefix)
    try:
        record: Record = decode(spec, value)
    except DecodeError as exc:
        return None, reject(exc.reason, exc.field, "decode"), None
    if origin.signer is not None:
        forged = identity_problem(record, origin.signer)
        if forged:
            return None, reject(forged, AUTH_FIELD, FORGED), None
    job_id: str = record.job_id  # type: ignore[attr-defined]  # both input topics carry job_id
    if key != job_id.encode():
        return None, reject(f"message key {key!r} does not match job_id {job_id!r}", "key", "key_mismatch"), None
    wrong_clock = clock_problem(record, timestamp_s)
    if wrong_clock:
        return None, reject(wrong_clock, wrong_clock.split()[0], "clock"), None
    if account is None and load is not None:
        account = load(key)
    if account is None:
        account = JobAccount(job_id=job_id)
    # Charges name catalog topics: a topic prefix is a deployment detail, and replay into another
    # prefix must rebuild identical charges.
    step = account.apply(record, Origin(spec.name, origin.partition, origin.offset), policy, running_estimates)
    if step.redelivered:  # account unchanged; only charges this event had completed are re-sent
        return None, [Outgoing(LEDGER_CHARGES.name, job_id.encode(), encode(c)) for c in step.charges], None
    out: list[Outgoing] = []
    if step.rejected:
        out += reject(step.rejected, step.field, rows=step.rows)
    if step.estimate is not None:
        out.append(Outgoing(ESTIMATES_DEGRADATION.name, job_id.encode(), encode(step.estimate)))
    out += [Outgoing(LEDGER_CHARGES.name, job_id.encode(), encode(c)) for c in step.charges]
    return account, out, step.blocks


def process_message(
    state: bytes | None, origin: Origin, key: bytes | None, value: bytes | None, timestamp_s: float,
    policy: PricingPolicy, prefix: str = "",
) -> Processed:
    """``apply_message`` on a serialized account: the new state as bytes (None when unchanged)."""
    account = JobAccount.model_validate_json(state) if state is not None else None
    new, out, blocks = apply_message(account, origin, key, value, timestamp_s, policy, prefix)
    return Processed(new.dumps() if new is not None else None, out, blocks)


Message = tuple[Origin, bytes | None, bytes | None, float]  # (origin, key, value, timestamp in s)


def as_read_live(messages: Iterable[Message]) -> list[Message]:
    """Messages of several topic partitions in the order the live worker most likely read them: each
    partition's in the order given (its offsets), the partitions merged by broker timestamp. A job's
    charges do not depend on how its topics interleave, except the numbering of two revisions made
    after a charge by records of both topics (a lost node's late marker on node.ipc, a correction or
    an operator's adjustment on jobs.lifecycle): folded in this order, a rebuild and an audit number
    them as the worker did whenever the two were sent apart in time (a node that came back, and an
    operator's void days later), where topic order always put the lifecycle record first."""
    streams: dict[tuple[str, int], list[Message]] = {}
    for m in messages:
        streams.setdefault((m[0].topic, m[0].partition), []).append(m)
    if len(streams) < 2:
        return [m for ms in streams.values() for m in ms]
    return list(heapq.merge(*streams.values(), key=lambda m: m[3]))


class AccountUnavailable(LookupError):
    """A job's account is kept elsewhere (the worker's settled accounts) and cannot be read back
    usable: its record must not be folded into a new, empty account (the caller dead-letters it)."""


def fold_states(messages: Iterable[Message], policy: PricingPolicy, prefix: str = "",
                accounts: dict[bytes | None, JobAccount] | None = None,
                load: Callable[[bytes | None], JobAccount | None] | None = None,
                ) -> tuple[dict[bytes | None, JobAccount], list[Outgoing]]:
    """Fold raw input messages (in the order given) exactly as the stream worker does, onto
    ``accounts`` (a snapshot's; changed in place) or nothing: every job's final account, and the
    charge messages the fold produced (a re-sent charge appears again). ``load`` gives the account of
    a key ``accounts`` lacks, if it has one elsewhere (the worker's settled accounts), and puts it in
    ``accounts``; else None."""
    accounts = {} if accounts is None else accounts
    charges: list[Outgoing] = []
    for origin, key, value, ts in messages:
        try:  # no running estimates: only charges are kept, and one per batch over all nodes is O(nodes)
            new, out, _ = apply_message(accounts.get(key), origin, key, value, ts, policy, prefix,
                                        running_estimates=False, load=load)
        except AccountUnavailable:
            continue  # the live fold dead-lettered it for the same reason (the loader logged it)
        if new is not None:
            accounts[key] = new
        charges += [o for o in out if o.topic == LEDGER_CHARGES.name]
    return accounts, charges


def fold_messages(messages: Iterable[Message], policy: PricingPolicy, prefix: str = "") -> list[Charge]:
    """Every charge the fold produces, once per (job id, revision) as the ledger keeps them.

    Redeliveries are recognized by offset exactly as in the worker, so replaying a message
    twice changes nothing.
    """
    charges: dict[tuple[str, int], Charge] = {}
    for o in fold_states(messages, policy, prefix)[1]:
        c = decode_model(Charge, o.value)
        charges.setdefault((c.job_id, c.revision), c)
    return list(charges.values())
