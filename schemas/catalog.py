"""The topic catalog: every topic's name, key, value model, partitioning and cleanup policy."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Annotated, Any, get_args, get_origin

from pydantic import Discriminator, Field, Tag, TypeAdapter

from .events import (
    Charge,
    ChargeAdjustment,
    DeadLetter,
    DegradationEstimate,
    JobEvent,
    JobLeftNode,
    LlcSample,
    NodeDown,
    NodeInventory,
    NodePlacementState,
    NodePowerState,
    PlacementDecision,
    PowerDecision,
    PowerReading,
    ProgramProfile,
    Record,
    ShutterBatch,
    ShutterBlock,
    ShutterWindow,
)


class Role(StrEnum):
    INPUT = "input"  # written by producers; archived; replayable
    OUTPUT = "output"  # derived by stream processors
    DEAD_LETTER = "dead_letter"


@dataclass(frozen=True)
class TopicSpec:
    name: str
    key_field: str  # the record field whose value is the message key
    value: Any  # a Record subclass, or an annotated discriminated union of them
    role: Role
    cleanup_policy: str
    description: str
    partitions: int | None = None  # None: the configured default

    @property
    def record_types(self) -> tuple[type[Record], ...]:
        args = getattr(self.value, "__args__", None)
        if args is None:  # a plain model
            return (self.value,)
        union = args[0]  # Annotated[Union[...], Field(...)]; a member may be Annotated[Model, Tag(...)]
        return tuple(get_args(m)[0] if get_origin(m) is Annotated else m for m in union.__args__)


NodeIpcValue = Annotated[ShutterBatch | ShutterBlock | JobLeftNode | NodeDown, Field(discriminator="kind")]

NODE_IPC = TopicSpec(
    "node.ipc", "job_id", NodeIpcValue, Role.INPUT, "delete",
    "batches of shutter blocks (K samples before/during/after, columnar) and end-of-stream markers, per job per "
    "node; node-down records for a node lost before its agent closed the stream",
)
NODE_SHUTTER = TopicSpec(
    "node.shutter", "node", ShutterWindow, Role.INPUT, "delete",
    "shutter windows: the lone job, the paused jobs, start and end",
)
NODE_LLC = TopicSpec(
    "node.llc", "job_id", LlcSample, Role.INPUT, "delete",
    "CAT profiling episodes: a job's IPC and memory bandwidth at an LLC way allocation",
)
NODE_POWER = TopicSpec(
    "node.power", "node", PowerReading, Role.INPUT, "delete",
    "per-processor power readings (watts, cap, instructions)",
)
def _lifecycle_kind(value: Any) -> str:
    """A jobs.lifecycle record's kind; one without (``kind`` has a default, and the published schema
    never required it) is a ``JobEvent``, as every record of the topic was before schema 8."""
    if isinstance(value, dict):
        return str(value.get("kind", "job_event"))
    return str(getattr(value, "kind", "job_event"))


JobsLifecycleValue = Annotated[
    Annotated[JobEvent, Tag("job_event")] | Annotated[ChargeAdjustment, Tag("charge_adjustment")],
    Discriminator(_lifecycle_kind)]

JOBS_LIFECYCLE = TopicSpec(
    "jobs.lifecycle", "job_id", JobsLifecycleValue, Role.INPUT, "delete",
    "submitted / started / ended / failed / cancelled; an operator's adjustment of a job's charge",
)
CLUSTER_INVENTORY = TopicSpec(
    "cluster.inventory", "node", NodeInventory, Role.INPUT, "compact",
    "node capacity and processor characterization",
)
ESTIMATES_DEGRADATION = TopicSpec(
    "estimates.degradation", "job_id", DegradationEstimate, Role.OUTPUT, "compact",
    "running and final degradation estimate per job",
)
PROFILES_PROGRAM = TopicSpec(
    "profiles.program", "program", ProgramProfile, Role.OUTPUT, "compact",
    "rolling program profiles",
)
DECISIONS_POWER = TopicSpec(
    "decisions.power", "job_id", PowerDecision, Role.OUTPUT, "delete",
    "power budgets and per-processor caps",
)
DECISIONS_POWER_NODES = TopicSpec(
    "decisions.power.nodes", "node", NodePowerState, Role.OUTPUT, "compact",
    "each node's caps as the power manager last stated them: what an agent holds after retention",
)
DECISIONS_PLACEMENT = TopicSpec(
    "decisions.placement", "job_id", PlacementDecision, Role.OUTPUT, "delete",
    "scale factor, nodes, pairing or delay",
)
DECISIONS_PLACEMENT_NODES = TopicSpec(
    "decisions.placement.nodes", "node", NodePlacementState, Role.OUTPUT, "compact",
    "each node's cache shares as the placement manager last stated them: what an agent with --resctrl reads",
)
LEDGER_CHARGES = TopicSpec(
    "ledger.charges", "job_id", Charge, Role.OUTPUT, "delete",
    "charge rows, one per job revision",
)
DLQ = TopicSpec(
    "dlq", "origin_topic", DeadLetter, Role.DEAD_LETTER, "delete",
    "rejected bytes with the reason and origin",
)

TOPICS: tuple[TopicSpec, ...] = (
    NODE_IPC, NODE_SHUTTER, NODE_LLC, NODE_POWER, JOBS_LIFECYCLE, CLUSTER_INVENTORY,
    ESTIMATES_DEGRADATION, PROFILES_PROGRAM, DECISIONS_POWER, DECISIONS_POWER_NODES, DECISIONS_PLACEMENT,
    DECISIONS_PLACEMENT_NODES, LEDGER_CHARGES, DLQ,
)
INPUT_TOPICS: tuple[TopicSpec, ...] = tuple(t for t in TOPICS if t.role is Role.INPUT)
BY_NAME: dict[str, TopicSpec] = {t.name: t for t in TOPICS}
TOPIC_OF_RECORD: dict[type[Record], TopicSpec] = {rt: t for t in TOPICS for rt in t.record_types}

#: The stream worker's internal topics: not records of the contract, but every input one decision
#: maker needs in one order, one partition each (PPartition and Spread-n-Share decide for the
#: whole machine). Named here, beside the catalog, so that topic creation, the worker and the
#: progress reader all take them from one place. Name -> partitions.
POWER_LOG = "power.machine"
PLACEMENT_LOG = "placement.cluster"
#: Each manager's latest state and the log offset it is after (streams.core.snapshot), compacted:
#: a rebuild folds only the log after it, so the logs' retention loses nothing.
SNAPSHOTS: dict[str, str] = {POWER_LOG: "power.machine.snapshots", PLACEMENT_LOG: "placement.cluster.snapshots"}
#: The charge fold's job accounts per input partition, with the offsets they are after
#: (streams.core.fold_snapshot), compacted: a rebuild folds only the input records after them.
FOLD_SNAPSHOTS = "accounting.snapshots"
#: The charged job accounts the fold let go of (streams.worker.fold_settled), keyed by input partition,
#: job and state, compacted: read back when a late record of the job arrives.
FOLD_SETTLED = "accounting.settled"
INTERNAL_TOPICS: dict[str, int] = {POWER_LOG: 1, PLACEMENT_LOG: 1, **dict.fromkeys(SNAPSHOTS.values(), 1),
                                   FOLD_SNAPSHOTS: 1, FOLD_SETTLED: 1}
#: cleanup.policy of the internal topics (delete unless named)
INTERNAL_CLEANUP: dict[str, str] = dict.fromkeys([*SNAPSHOTS.values(), FOLD_SNAPSHOTS, FOLD_SETTLED], "compact")

_ADAPTERS: dict[str, TypeAdapter[Any]] = {t.name: TypeAdapter(t.value) for t in TOPICS}


def adapter(spec: TopicSpec) -> TypeAdapter[Any]:
    return _ADAPTERS[spec.name]


def spec_for_topic(topic: str, prefix: str = "") -> TopicSpec:
    """The catalog entry of a (possibly prefixed) topic name."""
    name = topic[len(prefix):] if prefix and topic.startswith(prefix) else topic
    try:
        return BY_NAME[name]
    except KeyError:
        raise KeyError(f"topic {topic!r} is not in the catalog (prefix {prefix!r})") from None


def key_of(record: Record) -> bytes:
    """The message key of a record: the value of its topic's key field (an agent's processors-only
    inventory: ``<node>/processors``, so compaction keeps it beside the resource manager's record)."""
    key = str(getattr(record, TOPIC_OF_RECORD[type(record)].key_field))
    return f"{key}/processors".encode() if getattr(record, "processors_only", False) else key.encode()
