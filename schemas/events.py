"""The contract: every event, decision and ledger row that crosses a topic.

Every record carries ``event_id``, ``schema_version``, ``source`` and ``event_time`` and a
``kind`` tag, so an archived record explains itself. Validation is strict: unknown fields,
non-finite numbers, wrong types and inconsistent lengths are errors that name the field.

Longer than 500 lines because it is the whole contract in one place: every record of the topic
catalog side by side, so a schema change is one diff and one review.
"""

from __future__ import annotations

from datetime import UTC, datetime
from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import (
    AwareDatetime,
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    ValidationInfo,
    field_validator,
    model_serializer,
    model_validator,
)

#: The schema version this build writes. It reads every version from 1 up to this one; a record
#: of a newer version is refused with a reason (dead-lettered), never guessed at.
#:
#: * 1: the first contract.
#: * 2: ``Charge`` and ``DegradationEstimate`` name their ``estimator`` and carry the
#:   refill-corrected estimate (``degradation_corrected``, ``corrected``). Version-1 rows lack
#:   both and read as ``estimator="poppa_alg4"``, the only estimator version 1 had, so an audit
#:   recomputes them as they were made. Input records did not change.
#: * 3: ``node.ipc`` carries ``ShutterBatch``: a run of consecutive blocks of one job on one node,
#:   columnar, so one Kafka message moves many blocks. A version-1/2 ``ShutterBlock`` still reads
#:   as a batch of one. ``DegradationEstimate`` is also published while a job runs (per batch) with
#:   the job's IPC moments (``features``) for the placement manager; ``DeadLetter`` names the bad
#:   rows of a batch whose other rows were counted (``rows``).
#: * 4: ``JobLeftNode`` carries the time the job ran alone (``alone_us``), and ``Charge`` the
#:   shared-time estimate and that time (``degradation_shared``, ``alone_s``).
#: * 5: ``Charge`` says what evidence it set aside (``evidence_problems``: refused markers, blocks
#:   that never arrived), and an estimate may be ``no_progress_alone``. A charge of a job on more
#:   than ``MAX_CHARGE_NODES`` nodes carries a ``node_summary`` (totals and a digest) instead of
#:   ``nodes``, and at most ``MAX_CHARGE_PROBLEMS`` problems and a count of the rest. Lifecycle events obey
#:   stricter rules (an end only in a terminal event, no start in a submitted one, distinct nodes,
#:   every job time under the clock rule): records version 4 accepted that break them are dead letters.
#: * 6: ``node.ipc`` carries ``NodeDown``: a node lost for good closes the (job, node) stream its
#:   agent never will, and a charge priced without that node's marker is ``node_lost``. A charge
#:   carries its degradation's interval and says whether it was priced at its upper end
#:   (streams.core.confidence).
#:   ``PowerDecision`` carries, for each node whose caps it changes, the node's sequence number
#:   and every cap the node must hold after it (``node_caps``): an agent keeps the newest by sequence,
#:   whatever order the partitions of ``decisions.power`` arrive in. A ``suspend`` decision gates a
#:   started job the budget cannot hold at its processors' min power.
#: * 7: ``Charge`` states its interval's margin for the estimator's bias (``interval_margin_abs``,
#:   ``interval_margin_rel``).
#: * 8: ``jobs.lifecycle`` carries ``ChargeAdjustment``: an operator's adjust, void or restore of a
#:   job's price, priced by the worker as a new revision; a ``Charge`` names the adjustment it
#:   applied (``adjustment``) and what it took off the computed price (``adjustment_credit``).
#:   ``decisions.placement.nodes`` carries each node's cache shares (``NodePlacementState``). A
#:   ``JobEvent`` may carry the job's partition and allocated TRES, and a ``Charge`` what its
#:   standard price multiplied (``billing_units``: Slurm's billing count or a partition's weights).
#: * 9: a ``JobEvent`` may carry the node count the job asked for (``nodes_requested`` and
#:   ``nodes_max``, Slurm's ``-N min[-max]``): the placement manager places it on a count in that
#:   range (before, a two-node job of two tasks was packed onto one node, against its request).
#: * 10: ``Charge`` states the short-sample margin it was priced under (``short_margin``,
#:   ``short_sample_us``) and what it added to the shared-time D (``short_margin_applied``): an
#:   estimate from short samples that no longer one checked has a wider interval, and where the job
#:   never took its long samples is biased low (streams.core.confidence).
SCHEMA_VERSION = 10

#: No event of a system built in 2026 happened before this: an earlier event_time is a broken clock.
EARLIEST_EVENT_TIME = datetime(2000, 1, 1, tzinfo=UTC)
#: How far an event_time may run ahead of the broker's timestamp of its message (clock skew):
#: beyond this the producer's clock is wrong. Checked where the broker timestamp is known
#: (``clock_problem``), so the worker and an audit of the archive decide alike.
MAX_AHEAD_OF_BROKER_S = 3600.0

#: Upper bound on K (samples per shutter region). POPPA fixes K = 1 (Seed 002, Section 5.1 footnote);
#: anything beyond this is a broken agent, not a measurement.
MAX_SAMPLES_PER_REGION = 64
#: Upper bound on the blocks of one ShutterBatch. The agent's byte bound keeps a batch far below a
#: broker's 1 MB message limit (a K = 1 block is about 80 bytes of JSON); this only refuses nonsense.
MAX_BATCH_BLOCKS = 4096
#: Counts at or above this are not exact in float64, so no IPC computed from them is trusted.
MAX_EXACT_COUNT = 2**53

#: What a job id and a node name may hold (the fast audit checks the same in SQL).
JOB_ID_CHARS, NODE_NAME_CHARS = r"[A-Za-z0-9_.:\-\[\]]", r"[A-Za-z0-9_.\-]"
ID_MAX_LENGTH, NAME_MAX_LENGTH = 128, 256
JobId = Annotated[str, Field(min_length=1, max_length=ID_MAX_LENGTH, pattern=f"^{JOB_ID_CHARS}+$")]
NodeName = Annotated[str, Field(min_length=1, max_length=ID_MAX_LENGTH, pattern=f"^{NODE_NAME_CHARS}+$")]
Name = Annotated[str, Field(min_length=1, max_length=NAME_MAX_LENGTH)]
NonNegInt = Annotated[int, Field(ge=0)]
PosInt = Annotated[int, Field(gt=0)]
Fraction01 = Annotated[float, Field(ge=0.0, le=1.0)]
#: A trackable resource's name as Slurm writes it: a type, and for GRES, licenses and the like a name
TresName = Annotated[str, Field(min_length=1, max_length=NAME_MAX_LENGTH, pattern=r"^[a-z]+(/[A-Za-z0-9_.:-]+)?$")]
Watts = Annotated[float, Field(ge=0.0)]


class Record(BaseModel):
    """Fields common to every record on every topic."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)

    event_id: Annotated[str, Field(min_length=1, max_length=ID_MAX_LENGTH)]
    schema_version: int = SCHEMA_VERSION
    source: Name
    event_time: AwareDatetime

    def __setstate__(self, state: dict[Any, Any]) -> None:
        """A record pickled by an older build (a decision maker's snapshot holds some) lacks the
        fields added since: each reads as its default, as it would from JSON, instead of raising
        AttributeError at its first use."""
        values = state.get("__dict__")
        if isinstance(values, dict):
            state = {**state, "__dict__": {**{name: f.get_default(call_default_factory=True)
                                              for name, f in type(self).model_fields.items()
                                              if name not in values and not f.is_required()}, **values}}
        super().__setstate__(state)

    @field_validator("schema_version")
    @classmethod
    def _known_version(cls, v: int) -> int:
        if not 1 <= v <= SCHEMA_VERSION:
            raise ValueError(f"unknown schema version {v}; this build reads versions 1..{SCHEMA_VERSION}")
        return v


def without_unset(data: Any, empty: dict[str, Any]) -> Any:
    """Serialized ``data`` without the fields of ``empty`` that hold their empty value: fields a
    version added are not written where they say nothing, so an older build (whose models forbid
    fields they do not know) reads the record or state as it wrote it."""
    if isinstance(data, dict):
        for name, value in empty.items():
            if name in data and data[name] == value and type(data[name]) is type(value):
                del data[name]
    return data


def clock_problem(record: Record, broker_timestamp_s: float) -> str | None:
    """Why an input record's event_time (or a job time it states) cannot be right, or None: before
    EARLIEST_EVENT_TIME, or too far ahead of its message's broker timestamp (<= 0: the broker gave none, nothing to
    compare with). Consumers of input topics apply it; records nodeshare derives are not checked."""
    for name in _CLOCKED_FIELDS:
        when = getattr(record, name, None)
        if when is None:
            continue
        if when < EARLIEST_EVENT_TIME:
            return f"{name} {when.isoformat()} is before {EARLIEST_EVENT_TIME.date()}: a broken clock"
        if broker_timestamp_s <= 0:
            continue
        ahead = when.timestamp() - broker_timestamp_s
        if ahead > MAX_AHEAD_OF_BROKER_S:
            return (f"{name} {when.isoformat()} is {ahead:.0f} s ahead of the broker's timestamp "
                    f"(at most {MAX_AHEAD_OF_BROKER_S:.0f} s of clock skew): a wrong clock")
    return None


#: The times a record states, each checked by ``clock_problem``: a lifecycle event's job times are
#: billed (a start in 1970 or an end in 2099 would price decades), so they obey the same rule.
_CLOCKED_FIELDS = ("event_time", "submit_time", "start_time", "end_time")


# --------------------------------------------------------------------------- node.ipc


class CounterSource(StrEnum):
    """Where the progress counts of a sample came from (the estimator treats them alike)."""

    HARDWARE = "hardware"  # instructions and cycles from the PMU (perf_event_open)
    APPLICATION = "application"  # an application progress counter against elapsed cycles
    SIMULATED = "simulated"  # the cluster simulator


class IpcSample(BaseModel):
    """One counter reading over one sampling window of S microseconds, summed over the job's threads."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    instructions: NonNegInt
    cycles: PosInt
    threads: PosInt = 1

    @property
    def ipc(self) -> float:
        return self.instructions / self.cycles


class ShutterBlock(Record):
    """POPPA's block B_l for one job on one node: K samples before, during and after a shutter
    in which this job ran alone (Seed 002, Section 6.3)."""

    kind: Literal["shutter_block"] = "shutter_block"
    job_id: JobId
    node: NodeName
    cycle: NonNegInt  # the node agent's shutter cycle counter; strictly increasing per node
    k: Annotated[int, Field(ge=1, le=MAX_SAMPLES_PER_REGION)]
    sample_us: PosInt  # S, the length of each sample
    counter: CounterSource
    before: tuple[IpcSample, ...]
    during: tuple[IpcSample, ...]
    after: tuple[IpcSample, ...]

    @field_validator("before", "during", "after")
    @classmethod
    def _k_samples(cls, v: tuple[IpcSample, ...], info: ValidationInfo) -> tuple[IpcSample, ...]:
        k = info.data.get("k")
        if k is not None and len(v) != k:
            raise ValueError(f"expected k={k} samples, got {len(v)}")
        return v


class SampleColumns(BaseModel):
    """K samples per block of one region, columnar and block-major: block i's samples are
    ``[i * k, (i + 1) * k)``. Values are checked per block (``streams.core.blocks.block_rows``), not
    here, so one bad block does not refuse its batch."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    instructions: tuple[int, ...]
    cycles: tuple[int, ...]
    threads: tuple[int, ...]


REGIONS = ("before", "during", "after")
SAMPLE_FIELDS = ("instructions", "cycles", "threads")


class ShutterBatch(Record):
    """A run of consecutive shutter blocks of one job on one node from one agent (schema 3): the
    blocks of ``ShutterBlock``, one array per field. ``seq`` is the agent's batch number for this
    (job, node) stream. The shape (lengths, types) is checked here and refuses the whole message;
    values are checked per block (``streams.core.blocks.block_rows``), so a bad block is dead-lettered with its
    index while the others count."""

    kind: Literal["shutter_batch"] = "shutter_batch"
    job_id: JobId
    node: NodeName
    seq: NonNegInt
    k: Annotated[int, Field(ge=1, le=MAX_SAMPLES_PER_REGION)]
    sample_us: PosInt
    counter: CounterSource
    cycle: Annotated[tuple[int, ...], Field(min_length=1, max_length=MAX_BATCH_BLOCKS)]
    before: SampleColumns
    during: SampleColumns
    after: SampleColumns

    @model_validator(mode="after")
    def _columns_fit(self) -> ShutterBatch:
        want = len(self.cycle) * self.k
        for region in REGIONS:
            cols: SampleColumns = getattr(self, region)
            for name in SAMPLE_FIELDS:
                got = len(getattr(cols, name))
                if got != want:
                    raise ValueError(f"{region}.{name}: expected {len(self.cycle)} blocks x k={self.k} = {want} "
                                     f"samples, got {got}")
        return self

    @property
    def blocks(self) -> int:
        return len(self.cycle)


class RowProblem(BaseModel):
    """Why one block of a batch was refused (its index in the batch, the field, the reason)."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    index: NonNegInt
    field: str
    reason: Name


class JobLeftNode(Record):
    """The node agent will send no more blocks for this job from this node.

    Sent after the job's last block by the same producer with the same key, so it arrives
    after every block it counts: it closes the (job, node) block stream."""

    kind: Literal["job_left_node"] = "job_left_node"
    job_id: JobId
    node: NodeName
    blocks_sent: NonNegInt
    last_cycle: Annotated[int, Field(ge=-1)]  # -1 when no block was sent
    paused_us: NonNegInt = 0  # total time the agent kept this job's processes on this node paused
    #: Time the job ran on this node with no other job there (version 4). The agent shutters only
    #: shared nodes, so the blocks measure the shared time alone; the charge weighs by this.
    alone_us: NonNegInt = 0


class NodeDown(Record):
    """A node is lost for good: its agent will close none of this job's block stream there (version 6).

    Sent by whoever knows, never by the node: the Slurm source for a job Slurm ended with NODE_FAIL
    (one per failed node), or an operator (``nodeshare nodes down``). Keyed by job on ``node.ipc``,
    so its place among the node's blocks is fixed: the stream is priced from the blocks before it,
    whatever order the worker or an audit reads the two input topics in. A marker from the node
    after it (the node came back) is late data: a new revision priced from every block."""

    kind: Literal["node_down"] = "node_down"
    job_id: JobId
    node: NodeName
    reason: Name  # why the node is taken as lost, as its sender knows it (Slurm's state, an operator's words)


# --------------------------------------------------------------------------- node.shutter


class ShutterWindow(Record):
    """One shutter on one node: which job ran alone and which were paused, and when."""

    kind: Literal["shutter_window"] = "shutter_window"
    node: NodeName
    cycle: NonNegInt
    lone_job: JobId
    paused_jobs: Annotated[tuple[JobId, ...], Field(min_length=1)]
    start: AwareDatetime
    end: AwareDatetime

    @field_validator("paused_jobs")
    @classmethod
    def _lone_not_paused(cls, v: tuple[str, ...], info: ValidationInfo) -> tuple[str, ...]:
        if info.data.get("lone_job") in v:
            raise ValueError("the lone job cannot also be paused")
        if len(set(v)) != len(v):
            raise ValueError("paused jobs must be distinct")
        return v

    @field_validator("end")
    @classmethod
    def _end_after_start(cls, v: datetime, info: ValidationInfo) -> datetime:
        start = info.data.get("start")
        if start is not None and v < start:
            raise ValueError("end precedes start")
        return v


# --------------------------------------------------------------------------- node.llc


class LlcSample(Record):
    """One CAT profiling episode (Seed 001 Section 5.1): a job's processes on a node held
    ``llc_ways`` ways of the node's LLC for ``interval_s`` and ran at this IPC and memory
    bandwidth. Episodes at several way counts make a program's IPC-LLC and BW-LLC curves."""

    kind: Literal["llc_sample"] = "llc_sample"
    job_id: JobId
    node: NodeName
    llc_ways: PosInt  # ways allocated to the job on the node
    node_llc_ways: PosInt  # all the node's ways (the curve's "full" point)
    cores: PosInt  # the job's processes on the node
    ipc: Annotated[float, Field(ge=0.0)]  # mean per process over the episode
    bandwidth_gbps: Annotated[float, Field(ge=0.0)]  # the job's memory bandwidth on the node
    interval_s: Annotated[float, Field(gt=0.0)]

    @model_validator(mode="after")
    def _within_node(self) -> LlcSample:
        if self.llc_ways > self.node_llc_ways:
            raise ValueError(f"llc_ways: {self.llc_ways} allocated but the node has {self.node_llc_ways}")
        return self


# --------------------------------------------------------------------------- node.power


class PowerReading(Record):
    """Power of one processor over an interval. Where the node has no power interface the reading
    is marked unavailable and carries no numbers: absent data is never reported as zero."""

    kind: Literal["power_reading"] = "power_reading"
    node: NodeName
    processor: NonNegInt
    available: bool
    watts: Watts | None = None
    cap_watts: Watts | None = None
    instructions: NonNegInt | None = None
    interval_s: Annotated[float, Field(gt=0.0)] | None = None
    program: Name | None = None  # what ran on the processor, when the agent knows (power-IPS curves are per program)

    @model_validator(mode="after")
    def _numbers_iff_available(self) -> PowerReading:
        if self.available and self.watts is None:
            raise ValueError("watts: required when the reading is available")
        if not self.available and (self.watts is not None or self.cap_watts is not None):
            raise ValueError("watts: an unavailable reading carries no numbers")
        return self


# --------------------------------------------------------------------------- jobs.lifecycle


class JobState(StrEnum):
    SUBMITTED = "submitted"
    STARTED = "started"
    ENDED = "ended"
    FAILED = "failed"
    CANCELLED = "cancelled"


#: States after which a job has stopped running.
TERMINAL_STATES = frozenset({JobState.ENDED, JobState.FAILED, JobState.CANCELLED})


class JobEvent(Record):
    """A job's lifecycle transition as the resource manager reports it."""

    kind: Literal["job_event"] = "job_event"
    job_id: JobId
    state: JobState
    user: Name
    account: Name
    program: Name
    cores: PosInt  # cores allocated to the job, over all its nodes
    nodes: tuple[NodeName, ...] = ()
    alpha: Annotated[float, Field(gt=0.0, le=1.0)] = 0.9  # Seed 001: slowdown threshold, default 0.9
    #: The partition the job ran in, and the trackable resources allocated to it as Slurm names them
    #: ("cpu", "mem" in MB, "node", "gres/gpu", and "billing", Slurm's billable count from the
    #: partition's TRESBillingWeights): what a TRES-aware standard price bills (version 8).
    partition: Name | None = None
    tres: dict[TresName, Annotated[float, Field(ge=0.0)]] = {}
    #: The node count the job asked for (Slurm's ``-N min[-max]``; version 9): a placement uses at
    #: least ``nodes_requested`` and at most ``nodes_max`` nodes. None: the job did not say (any
    #: count that holds its cores; Slurm's ``-N 2`` is both 2).
    nodes_requested: PosInt | None = None
    nodes_max: PosInt | None = None
    submit_time: AwareDatetime | None = None
    start_time: AwareDatetime | None = None
    end_time: AwareDatetime | None = None

    @model_validator(mode="after")
    def _times_fit_state(self) -> JobEvent:
        ran = self.state in (JobState.STARTED, JobState.ENDED, JobState.FAILED) or (
            self.state is JobState.CANCELLED and self.start_time is not None
        )
        if ran and self.start_time is None:
            raise ValueError(f"start_time: required when state is {self.state.value}")
        if ran and not self.nodes:
            raise ValueError(f"nodes: required when state is {self.state.value}")
        if self.state is JobState.SUBMITTED and self.start_time is not None:
            raise ValueError("start_time: a submitted job has not started")
        if self.state not in TERMINAL_STATES and self.end_time is not None:
            raise ValueError(f"end_time: a {self.state.value} job has not ended (only a terminal event has an end)")
        if self.state in TERMINAL_STATES and self.start_time is not None and self.end_time is None:
            raise ValueError(f"end_time: required when state is {self.state.value}")
        if self.start_time is not None and self.end_time is not None and self.end_time < self.start_time:
            raise ValueError("end_time: precedes start_time")
        if len(set(self.nodes)) != len(self.nodes):
            raise ValueError("nodes: a node is listed twice")
        if self.nodes_requested is not None and self.nodes_requested > self.cores:
            raise ValueError(f"nodes_requested: {self.nodes_requested} nodes for {self.cores} cores "
                             "(each node holds at least one of the job's cores)")
        if self.nodes_max is not None and self.nodes_max < (self.nodes_requested or 1):
            raise ValueError(f"nodes_max: {self.nodes_max} is below nodes_requested ({self.nodes_requested})")
        return self

    @model_serializer(mode="wrap")
    def _without_unset_allocation(self, handler: SerializerFunctionWrapHandler) -> Any:
        """Written without ``partition``, ``tres`` (version 8), ``nodes_requested`` and ``nodes_max``
        (version 9) when they say nothing: an event of a source that knows none of them reads as
        before, and so do the worker's saved states that hold it (a worker rolled back across
        version 8 reads them)."""
        return without_unset(handler(self), {"partition": None, "tres": {}, "nodes_requested": None,
                                             "nodes_max": None})

    @property
    def ran(self) -> bool:
        """True when the job occupied nodes and has stopped (and so must be charged now)."""
        return self.state in TERMINAL_STATES and self.start_time is not None and self.end_time is not None


class AdjustmentAction(StrEnum):
    ADJUST = "adjust"  # charge ``price`` (at most the standard price) instead of the computed price
    VOID = "void"  # charge nothing
    RESTORE = "restore"  # withdraw the adjustment in force: the computed price again


#: What an adjustment's reason may hold: a sentence, not a document.
REASON_MAX_LENGTH = 1000


class ChargeAdjustment(Record):
    """An operator's correction of what a job is charged (version 8), on ``jobs.lifecycle`` keyed by
    the job, so its place among the job's lifecycle events is fixed: it holds for every revision the
    worker prices after it (a later correction or late data keeps it) until another replaces it. A
    job already charged gets a new revision at once, priced from the same evidence; the blocks,
    the estimate and the dividend stay as measured, only the price moves (``streams.core.pricing
    .adjusted_price``). Sent by ``nodeshare charges adjust|void|restore``, signed by a service key."""

    kind: Literal["charge_adjustment"] = "charge_adjustment"
    job_id: JobId
    action: AdjustmentAction
    price: Annotated[float, Field(ge=0.0)] | None = None  # service units; ``adjust`` only
    reason: Annotated[str, Field(min_length=1, max_length=REASON_MAX_LENGTH)]
    #: who asked for it: with signatures on, the record must be signed by ``service/operator-<operator>``
    operator: Annotated[str, Field(min_length=1, max_length=NAME_MAX_LENGTH, pattern=r"^[A-Za-z0-9._@:+-]+$")]

    @field_validator("price")
    @classmethod
    def _no_negative_zero(cls, v: float | None) -> float | None:
        return None if v is None else v + 0.0  # -0.0 + 0.0 is 0.0

    @model_validator(mode="after")
    def _price_fits_action(self) -> ChargeAdjustment:
        if self.action is AdjustmentAction.ADJUST and self.price is None:
            raise ValueError("price: required to adjust a charge (void charges nothing, restore the computed price)")
        if self.action is not AdjustmentAction.ADJUST and self.price is not None:
            raise ValueError(f"price: a {self.action.value} carries no price")
        if not self.reason.strip():
            raise ValueError("reason: says nothing")
        return self


# --------------------------------------------------------------------------- cluster.inventory


class ProcessorSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)

    processor: NonNegInt
    min_watts: Watts
    max_watts: Watts

    @field_validator("max_watts")
    @classmethod
    def _max_ge_min(cls, v: float, info: ValidationInfo) -> float:
        lo = info.data.get("min_watts")
        if lo is not None and v < lo:
            raise ValueError("max_watts below min_watts")
        return v


class NodeInventory(Record):
    kind: Literal["node_inventory"] = "node_inventory"
    node: NodeName
    cores: PosInt
    sockets: PosInt = 1
    llc_ways: PosInt
    mem_bandwidth_gbps: Annotated[float, Field(gt=0.0)]
    processors: tuple[ProcessorSpec, ...] = ()
    #: False while the resource manager runs no new job there (Slurm: DOWN, DRAIN, FAIL, NOT_RESPONDING,
    #: MAINT, RESERVED, ...): placement chooses it for no job until a record says it is usable again (version 5)
    usable: bool = True
    #: the node's processor packages only, as its node agent found them in powercap (version 6): the
    #: power manager takes the processors (and cores), the placement manager ignores the record (the
    #: resource manager's record says the node's state and shape). Keyed ``<node>/processors``.
    processors_only: bool = False


# --------------------------------------------------------------------------- estimates.degradation


class EstimateStatus(StrEnum):
    OK = "ok"  # the applied estimate has evidence (Alg. 4 and refill-corrected: a block passed the filter)
    NO_ACCEPTED_BLOCKS = "no_accepted_blocks"  # blocks arrived but Alg. 4 rejected them all
    NO_BLOCKS = "no_blocks"  # the job never shared a node with a shuttered co-runner
    #: the blocks the estimate uses show no instruction retired while the job ran alone (it slept, or
    #: waited on I/O or MPI): its solo speed is 0 and no slowdown is measurable (version 5)
    NO_PROGRESS_ALONE = "no_progress_alone"
    #: a node of the job was lost (``NodeDown``) before it closed its stream: the charge is priced
    #: from the blocks it sent before, without its marker's claims; ``evidence_problems`` says which
    #: and why (version 6)
    NODE_LOST = "node_lost"


class SampleMoments(BaseModel):
    """Count, correctly rounded exact sums of x and x², min and max of a set of samples."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)

    n: NonNegInt
    sum: float
    sum_sq: Annotated[float, Field(ge=0.0)]
    min: float
    max: float


class DegradationEstimate(Record):
    kind: Literal["degradation_estimate"] = "degradation_estimate"
    job_id: JobId
    status: EstimateStatus
    degradation: Fraction01  # the value pricing applies
    filtered: float | None  # Alg. 4 over accepted blocks; None when none accepted
    unfiltered: float | None  # Eq. 7-8 over all blocks; None when there are none
    blocks_used: NonNegInt
    blocks_rejected: NonNegInt
    delta: Annotated[float, Field(gt=0.0)]
    final: bool
    corrected: float | None = None  # refill-corrected over Alg. 4's accepted blocks (streams.core.degradation)
    estimator: Name = "poppa_alg4"  # which estimate ``degradation`` applies
    #: The job's sample IPCs so far, for the profiles: ``ipc_alone`` (during its shutters) and
    #: ``ipc_shared`` (before and after them), over every block counted (schema 3).
    features: dict[str, SampleMoments] = {}


# --------------------------------------------------------------------------- profiles.program


class ProgramClass(StrEnum):
    """Seed 001, Section 4.2: how a program's run time changes when spread over more nodes."""

    SCALING = "scaling"
    COMPACT = "compact"
    NEUTRAL = "neutral"
    UNKNOWN = "unknown"


class FeatureSummary(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)

    mean: float
    min: float
    max: float
    sd: Annotated[float, Field(ge=0.0)]


class ProgramProfile(Record):
    kind: Literal["program_profile"] = "program_profile"
    program: Name
    program_class: ProgramClass = ProgramClass.UNKNOWN
    runtime_s_by_scale: dict[str, Annotated[float, Field(gt=0.0)]] = {}
    ipc_by_llc_ways: tuple[Annotated[float, Field(ge=0.0)], ...] = ()
    bandwidth_gbps_by_llc_ways: tuple[Annotated[float, Field(ge=0.0)], ...] = ()
    features: dict[str, FeatureSummary] = {}
    degradation_next_to: dict[str, float] = {}
    samples: NonNegInt = 0


# --------------------------------------------------------------------------- decisions.power


class ProcessorCap(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)

    node: NodeName
    processor: NonNegInt
    cap_watts: Watts


class JobPowerPlan(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)

    job_id: JobId
    budget_watts: Watts
    caps: tuple[ProcessorCap, ...]
    predicted_gips: Annotated[float, Field(ge=0.0)] = 0.0  # job IPS (billions) the characterization predicts


class PowerAction(StrEnum):
    START = "start"
    DEFER = "defer"
    RELEASE = "release"
    #: an inventory changed the limits of processors running jobs hold: ``running_updates`` carries
    #: the re-fitted caps, ``plan`` is None (version 5)
    RETUNE = "retune"
    #: a power-gated start (version 6): the job runs on processors whose min power the budget cannot
    #: cover even with every running job at its min power; the Slurm adapter suspends it until a
    #: ``start`` for it (then resumes it)
    SUSPEND = "suspend"


class HeldCap(BaseModel):
    """One processor's cap and the job that holds it."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)

    processor: NonNegInt
    job_id: JobId
    cap_watts: Watts


class NodeCapState(BaseModel):
    """Every cap one node must hold after a decision (version 6), and the node's sequence number:
    the manager counts, per node, the decisions that changed its caps, so a state supersedes every
    state of the node with a lower number. A processor not listed keeps its own limit."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)

    node: NodeName
    sequence: PosInt
    caps: tuple[HeldCap, ...] = ()


class PowerInputs(BaseModel):
    """What a power decision was computed from, so that it can be checked and reproduced."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)

    trigger_event_id: str  # the lifecycle event that caused the decision
    program: str
    requested_processors: NonNegInt
    candidate_processors: NonNegInt  # free processors it could run on
    characterized_processors: NonNegInt  # of those considered, how many had a power-IPS curve for the program
    fair_share_watts: Watts  # n/Nmax * Pm/c, or Eq. 5 when power was repartitioned
    unused_watts_before: Watts
    n_lo: NonNegInt
    n_hi: NonNegInt
    stolen_watts: dict[str, Watts] = {}  # job id -> power taken from it for this job
    policy: str = ""


class PowerDecision(Record):
    """A power plan for one job start or end (Seed 004): the job's budget, processors and caps, and
    the re-tuned caps of running jobs whose partitions changed. A scheduler applies caps with RAPL."""

    kind: Literal["power_decision"] = "power_decision"
    job_id: JobId
    action: PowerAction
    plan: JobPowerPlan | None
    running_updates: tuple[JobPowerPlan, ...] = ()
    machine_budget_watts: Watts
    machine_allocated_watts: Watts
    reason: str = ""
    inputs: PowerInputs | None = None
    #: the nodes whose caps this decision changed, each with all its caps after it (version 6)
    node_caps: tuple[NodeCapState, ...] = ()
    #: a ``start`` of a job a ``suspend`` gated: the Slurm adapter resumes it (version 6)
    resumes: bool = False


class NodePowerState(Record):
    """A node's caps as the power manager last stated them (``decisions.power.nodes``, compacted
    by node): the ``node_caps`` entry of the newest decision that changed them, so an agent that
    starts after retention deleted that decision from ``decisions.power`` still holds them."""

    kind: Literal["node_power_state"] = "node_power_state"
    node: NodeName
    state: NodeCapState
    decided_by: Annotated[str, Field(min_length=1, max_length=ID_MAX_LENGTH)]  # the decision's event id

    @model_validator(mode="after")
    def _one_node(self) -> NodePowerState:
        if self.state.node != self.node:
            raise ValueError(f"the state of node {self.state.node!r} published as node {self.node!r}")
        return self


# --------------------------------------------------------------------------- decisions.placement


class PlacementAction(StrEnum):
    PLACE = "place"
    PAIR = "pair"
    SERIALIZE = "serialize"
    DELAY = "delay"


class PlacementInputs(BaseModel):
    """What a placement decision was computed from, so that it can be checked against what the
    degradation stream later measures."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)

    trigger_event_id: str  # the lifecycle event that caused the scheduling pass
    program: str
    processes: PosInt
    alpha: Annotated[float, Field(gt=0.0, le=1.0)]
    program_class: ProgramClass = ProgramClass.UNKNOWN
    profile_samples: NonNegInt = 0  # events folded into the program's profile when it was read
    runtime_s_by_scale: dict[str, float] = {}
    node_scores: dict[str, float] = {}  # Co + Bo + 2 Wo of each chosen node before the job
    co_runners: dict[str, str] = {}  # job id -> program of the jobs already on the chosen nodes
    predicted_degradation_pct: dict[str, float] = {}  # co-runner job -> Deg next to it (the pair model)
    model_pairs: NonNegInt = 0  # jobs measured in pairs that the pair model was trained on (0: no model)


class PlacementDecision(Record):
    kind: Literal["placement_decision"] = "placement_decision"
    job_id: JobId
    action: PlacementAction
    policy: Name
    scale_factor: PosInt | None = None
    nodes: tuple[NodeName, ...] = ()
    cores_per_node: PosInt | None = None
    llc_ways: PosInt | None = None
    bandwidth_gbps: Annotated[float, Field(ge=0.0)] | None = None
    paired_with: JobId | None = None
    predicted_slowdown: Annotated[float, Field(ge=0.0)] | None = None
    reason: str = ""
    inputs: PlacementInputs | None = None


class LlcShare(BaseModel):
    """The last-level cache ways (and memory bandwidth) one job holds on a node."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)

    job_id: JobId
    ways: PosInt
    bandwidth_gbps: Annotated[float, Field(gt=0.0)] | None = None  # None: no bandwidth booked (no MBA)


class NodePlacementState(Record):
    """Every cache share one node must hold, as the placement manager last stated it (version 8),
    on ``decisions.placement.nodes`` (compacted, keyed by node): sent when a decision, a job's start
    elsewhere or its end changes the node's shares, and for every node after each rebuild. An agent
    with ``--resctrl`` reads it alone: a start reads one record per node, not every decision
    retention keeps, and a job that ended gives its ways back at once."""

    kind: Literal["node_placement_state"] = "node_placement_state"
    node: NodeName
    shares: tuple[LlcShare, ...] = ()
    decided_by: Annotated[str, Field(min_length=1, max_length=ID_MAX_LENGTH)]  # the triggering record's event id

    @field_validator("shares")
    @classmethod
    def _one_share_a_job(cls, v: tuple[LlcShare, ...]) -> tuple[LlcShare, ...]:
        if len({s.job_id for s in v}) != len(v):
            raise ValueError("a job holds one share of a node")
        return v


# --------------------------------------------------------------------------- ledger.charges


class OffsetRange(BaseModel):
    """A contiguous range of one topic partition's offsets that a charge was computed from."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    topic: Name
    partition: NonNegInt
    first_offset: NonNegInt
    last_offset: NonNegInt


class NodeBlocks(BaseModel):
    """The blocks of one (job, node) stream that a charge used."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    node: NodeName
    blocks: NonNegInt
    first_cycle: Annotated[int, Field(ge=-1)]
    last_cycle: Annotated[int, Field(ge=-1)]
    blocks_sent: NonNegInt  # what the node agent said it sent (JobLeftNode)
    paused_s: Annotated[float, Field(ge=0.0)] = 0.0  # what the node agent said it paused the job for
    alone_s: Annotated[float, Field(ge=0.0)] = 0.0  # what the node agent said the job ran there with no co-runner


#: A charge lists its nodes (``NodeBlocks``, about 111 bytes each) up to this many; a job on more
#: (a capability job) gets a ``NodeSummary`` instead, so a charge stays far below a broker's
#: 1,000,000-byte message limit whatever the job's size (version 5).
MAX_CHARGE_NODES = 1000
#: With a ``NodeSummary``, ``evidence_problems`` keeps this many lines and one that counts the rest.
MAX_CHARGE_PROBLEMS = 100


class NodeSummary(BaseModel):
    """A charge's nodes in brief, for a job on more than ``MAX_CHARGE_NODES`` nodes (version 5):
    totals, and the sha256 of the JSON its ``nodes`` list would have held (compact, sorted by node),
    so recomputing the charge from the archive checks every node's numbers."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    count: PosInt  # nodes
    blocks: NonNegInt  # blocks counted, over all nodes
    blocks_sent: NonNegInt  # what the markers said were sent, over all nodes
    paused_s: Annotated[float, Field(ge=0.0)]  # the longest a node's marker says it paused the job
    alone_s: Annotated[float, Field(ge=0.0)]  # the time alone the markers claim, summed (exactly)
    sha256: Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]


#: A ``mixed_s`` charge lists at most this many sample lengths (``Charge.levels``): the ones its
#: estimate used first, then those with the most blocks (version 6). The estimate uses every level.
MAX_CHARGE_LEVELS = 16


class LevelEvidence(BaseModel):
    """The blocks of a job at one sample length S, as a ``mixed_s`` charge used them (version 6)."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    sample_us: NonNegInt  # S (0: blocks folded before the fold kept S)
    blocks_used: NonNegInt  # accepted by Alg. 4
    blocks_rejected: NonNegInt
    degradation: float | None  # the refill-corrected D of this S's blocks (None: no accepted block)
    standard_error: Annotated[float, Field(ge=0.0)] | None  # None below two accepted blocks
    used: bool  # whether the charge's estimate pooled this S (a shorter S lower beyond noise is left out)


class AppliedAdjustment(BaseModel):
    """The operator's adjustment a charge applied (version 8): what was asked, by whom, why, and
    where the request is in the log (``topic:partition:offset``)."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)

    action: Literal["adjust", "void"]
    requested_price: Annotated[float, Field(ge=0.0)] | None  # ``adjust``: the price asked for
    reason: Annotated[str, Field(min_length=1, max_length=REASON_MAX_LENGTH)]
    operator: Name
    event_id: Annotated[str, Field(min_length=1, max_length=ID_MAX_LENGTH)]
    at: Name


class Charge(Record):
    """One ledger row: a job's price and everything needed to recompute it."""

    kind: Literal["charge"] = "charge"
    job_id: JobId
    revision: NonNegInt
    revision_reason: str = ""  # why this revision supersedes the previous one; empty for revision 0
    final_state: JobState
    user: Name
    account: Name
    program: Name
    cores: PosInt
    #: The partition and what the standard price multiplied instead of the cores (version 8; None:
    #: the cores, as before), and by which rule: "slurm" (Slurm's own billing count, from the
    #: lifecycle event) or the TRESBillingWeights the site set for the partition.
    partition: Name | None = None
    billing_units: Annotated[float, Field(ge=0.0)] | None = None
    billing_weights: str | None = None
    start_time: AwareDatetime
    end_time: AwareDatetime
    run_time_s: Annotated[float, Field(ge=0.0)]  # T_co, wall time from start to end
    pause_credit_s: Annotated[float, Field(ge=0.0)] = 0.0  # time shutters kept the job paused: not billed
    billed_time_s: Annotated[float, Field(ge=0.0)]  # T_co - pause credit
    solo_time_s: Annotated[float, Field(ge=0.0)]  # T_solo = (1 - D) * billed time; Eq. 4 divides by T_co
    degradation: Fraction01  # D applied: degradation_shared * (1 - alone_s / billed_time_s)
    estimate_status: EstimateStatus
    degradation_filtered: float | None
    degradation_unfiltered: float | None
    degradation_corrected: float | None = None  # refill-corrected (streams.core.degradation)
    estimator: Name = "poppa_alg4"  # which estimate applies: poppa_alg4 | refill_corrected | unfiltered | mixed_s
    #: The applied estimator's D over the time the job shared a node (what its blocks measure), 0
    #: without evidence; and the billed time the job had no co-runner on any of its nodes (a lower
    #: bound from the agents' per-node totals), undisturbed. Both version 4: before it, D applied
    #: was the shared-time estimate for the whole run.
    degradation_shared: Fraction01 = 0.0
    alone_s: Annotated[float, Field(ge=0.0)] = 0.0
    blocks_used: NonNegInt
    blocks_rejected: NonNegInt
    blocks_ignored: NonNegInt  # duplicates, out-of-order and foreign-node blocks not counted
    nodes: tuple[NodeBlocks, ...]  # empty when ``node_summary`` is set
    #: Instead of ``nodes`` for a job on more than MAX_CHARGE_NODES nodes (version 5).
    node_summary: NodeSummary | None = None
    rate_function: Name
    rate_per_core_hour: Annotated[float, Field(gt=0.0)]  # L
    delta: Annotated[float, Field(gt=0.0)]
    standard_price: Annotated[float, Field(ge=0.0)]  # SOP = L * C * T_co (Eq. 1)
    solo_price: Annotated[float, Field(ge=0.0)]  # P_solo = L * C * T_solo
    price: Annotated[float, Field(ge=0.0)]  # what the job is charged
    dividend: Annotated[float, Field(ge=0.0)]  # standard_price - the computed price: the co-location discount
    event_range: tuple[OffsetRange, ...]
    #: Why some of the evidence was set aside or is incomplete (version 5): a node's marker refused
    #: for breaking a physical bound (its pause credit and time alone not applied), or blocks its
    #: marker says were sent that never arrived. Empty: every marker held and every block arrived.
    evidence_problems: tuple[str, ...] = ()
    #: How sure the charge is (version 6; streams.core.confidence). The point estimate of D applied
    #: and its interval at ``confidence`` (both over the whole billed time, as ``degradation``), the
    #: method (t_ratio | prior | none) and the blocks behind it; ``priced_at`` says which of the
    #: point estimate and the interval's upper end ``degradation`` is; ``prior_degradation_high``
    #: is the prior interval's upper end the policy states. A charge of an earlier version was
    #: priced at the point estimate and carries no interval. Since version 10 the lower end of a
    #: ``mixed_s`` estimate whose kept short samples read higher than its longest S beyond noise
    #: reaches down to that level's own interval (``confidence.trusted_level_low``).
    degradation_point: Fraction01 | None = None
    degradation_low: Fraction01 | None = None
    degradation_high: Fraction01 | None = None
    interval_method: Name | None = None
    interval_blocks: NonNegInt = 0
    confidence: Annotated[float, Field(gt=0.0, lt=1.0)] | None = None
    priced_at: Literal["estimate", "upper_bound"] = "estimate"
    prior_degradation_high: Fraction01 | None = None
    #: The interval's margin for the estimator's bias (version 7): the interval is widened by
    #: ``interval_margin_abs + interval_margin_rel * D`` beyond its t term. None: an earlier
    #: version's charge, whose interval had no margin.
    interval_margin_abs: Fraction01 | None = None
    interval_margin_rel: Fraction01 | None = None
    #: The short-sample margin (version 10; streams.core.confidence): the policy's margin and the
    #: longest S it covers (None: an earlier version's charge, priced without), and what it added to
    #: the shared-time D priced at the estimate (the margin where the estimate rests on samples of
    #: S <= ``short_sample_us`` that no longer S checked and the job took fewer than 4 longer ones,
    #: else 0). The interval of every such unchecked estimate is wider by the margin, whether or not
    #: its price carries it (so a charge priced at the bound pays less by it); the audit recomputes
    #: both from the levels. ``degradation_point`` stays the estimate.
    short_margin: Fraction01 | None = None
    short_sample_us: PosInt | None = None
    short_margin_applied: Fraction01 = 0.0
    #: ``mixed_s`` only (version 6): the evidence per sample length S, by S, at most
    #: ``MAX_CHARGE_LEVELS``; empty for the other estimators.
    levels: tuple[LevelEvidence, ...] = ()
    #: An operator's adjustment in force when this revision was priced (version 8; None: none), and
    #: what it took off the computed price (negative: it raised the price, never above the
    #: standard price). ``standard_price = price + dividend + adjustment_credit``: the dividend
    #: stays the co-location discount the measurement earned.
    adjustment: AppliedAdjustment | None = None
    adjustment_credit: float = 0.0
    code_version: Name

    @property
    def units(self) -> float:
        """What the standard price multiplied: the billable TRES (version 8), else the cores."""
        return self.billing_units if self.billing_units is not None else float(self.cores)


# --------------------------------------------------------------------------- dlq


class DeadLetter(Record):
    """Bytes the pipeline refused, why, and where they came from. Nothing is silently dropped."""

    kind: Literal["dead_letter"] = "dead_letter"
    origin_topic: Name
    origin_partition: int | None
    origin_offset: int | None
    reason: Name
    field: str | None = None
    key_b64: str | None = None
    value_b64: str  # the raw bytes, base64, exactly as received
    #: For a batch whose other rows were counted: each refused row, its index and reason (schema 3).
    rows: tuple[RowProblem, ...] = ()


#: Fields added after version 1, per model, with the version that added them: a record of an
#: older version lacks them (reads their default), and an audit does not compare them.
ADDED_IN: dict[type[Record], dict[str, int]] = {
    Charge: {"degradation_corrected": 2, "estimator": 2, "degradation_shared": 4, "alone_s": 4,
             "evidence_problems": 5, "node_summary": 5, "degradation_point": 6, "degradation_low": 6,
             "degradation_high": 6, "interval_method": 6, "interval_blocks": 6, "confidence": 6,
             "priced_at": 6, "prior_degradation_high": 6, "levels": 6,
             "interval_margin_abs": 7, "interval_margin_rel": 7, "adjustment": 8, "adjustment_credit": 8,
             "partition": 8, "billing_units": 8, "billing_weights": 8, "short_margin": 10, "short_sample_us": 10,
             "short_margin_applied": 10},
    JobEvent: {"partition": 8, "tres": 8, "nodes_requested": 9, "nodes_max": 9},
    JobLeftNode: {"alone_us": 4},
    DegradationEstimate: {"corrected": 2, "estimator": 2, "features": 3},
    DeadLetter: {"rows": 3},
    NodeInventory: {"usable": 5, "processors_only": 6},
    PowerDecision: {"node_caps": 6, "resumes": 6},
}


def carried(record: Record, field: str) -> bool:
    """Whether the record's own schema version has this field."""
    return ADDED_IN.get(type(record), {}).get(field, 1) <= record.schema_version
