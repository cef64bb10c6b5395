"""Shutter blocks batched at the source (schema 3), as telemetry agents batch: the OpenTelemetry
Collector's Kafka exporter sends whole OTLP batches, Prometheus remote-write up to 2,000 samples
per request. One Kafka message then carries a run of consecutive blocks of one job on one node.

A batch is flushed when it holds ``max_blocks`` blocks or about ``max_bytes`` bytes of JSON, when
its first block is ``max_age_s`` old (estimate freshness for placement), when the job leaves the
node (before its ``JobLeftNode``, so a charge is never delayed) and when the agent stops. Pure:
time is what the caller says it is, so the node agent (wall clock) and the simulators (simulated
time) batch alike, and the open batches can be saved and restored (the agent keeps them in its
spool's meta, in the same transaction as its other counters).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from nodeshare.schemas.events import (
    REGIONS,
    SAMPLE_FIELDS,
    CounterSource,
    SampleColumns,
    ShutterBatch,
    ShutterBlock,
)

#: Defaults chosen by measurement (README, "Batches"): 64 blocks per message move ~100,000
#: blocks/s through one stream worker on 2 cores; at P = 200 ms a job on a two-job node gets a
#: block every ~0.42 s, so a batch fills in ~27 s, inside the age bound.
DEFAULT_MAX_BLOCKS = 64
DEFAULT_MAX_AGE_S = 30.0
#: Far below a broker's default 1 MB message limit: a K = 1 block is about 80 bytes of JSON.
DEFAULT_MAX_BYTES = 256 * 1024

Sample = tuple[int, int, int]  # instructions, cycles, threads


@dataclass(frozen=True)
class FlushPolicy:
    max_blocks: int = DEFAULT_MAX_BLOCKS
    max_age_s: float = DEFAULT_MAX_AGE_S
    max_bytes: int = DEFAULT_MAX_BYTES

    def __post_init__(self) -> None:
        if self.max_blocks < 1 or self.max_age_s < 0 or self.max_bytes < 1024:
            raise ValueError("a flush policy needs max_blocks >= 1, max_age_s >= 0 and max_bytes >= 1024")


@dataclass
class OpenBatch:
    """The blocks of one (job, node) stream not sent yet."""

    job_id: str
    node: str
    source: str
    seq: int
    k: int
    sample_us: int
    counter: str
    opened: datetime  # when its first block was measured
    last: datetime  # when its newest block was measured: the batch's event time
    cycle: list[int] = field(default_factory=list)
    columns: dict[str, dict[str, list[int]]] = field(
        default_factory=lambda: {r: {f: [] for f in SAMPLE_FIELDS} for r in REGIONS})
    size: int = 0  # about the bytes of JSON the columns take

    def record(self, event_id: str) -> ShutterBatch:
        regions = {r: SampleColumns(**{f: tuple(v) for f, v in cols.items()}) for r, cols in self.columns.items()}
        return ShutterBatch(event_id=event_id, source=self.source, event_time=self.last, job_id=self.job_id,
                            node=self.node, seq=self.seq, k=self.k, sample_us=self.sample_us,
                            counter=CounterSource(self.counter), cycle=tuple(self.cycle), **regions)

    def state(self) -> dict[str, Any]:
        """As JSON-able data (the agent's spool meta)."""
        return {**{k: v for k, v in vars(self).items() if k not in ("opened", "last")},
                "opened": self.opened.isoformat(), "last": self.last.isoformat()}

    @classmethod
    def from_state(cls, d: dict[str, Any]) -> OpenBatch:
        return cls(**{**d, "opened": datetime.fromisoformat(d["opened"]), "last": datetime.fromisoformat(d["last"])})


EventId = Callable[[OpenBatch], str]


def default_event_id(b: OpenBatch) -> str:
    """Unique per stream and first cycle: a re-sent batch (spool replay) keeps its id."""
    return f"{b.node}/bat/{b.job_id}/{b.cycle[0]}-{b.cycle[-1]}"


class Batcher:
    """Open batches per (job, node), flushed by count, bytes, age, job leave and stop."""

    def __init__(self, policy: FlushPolicy | None = None, event_id: EventId = default_event_id) -> None:
        self.policy = policy or FlushPolicy()
        self.event_id = event_id
        self.open: dict[tuple[str, str], OpenBatch] = {}
        self.next_seq: dict[tuple[str, str], int] = {}
        self._by_age: deque[tuple[datetime, tuple[str, str], int]] = deque()  # (opened, key, seq), oldest first

    def add(self, *, job_id: str, node: str, source: str, cycle: int, k: int, sample_us: int,
            counter: CounterSource | str, before: Sequence[Sample], during: Sequence[Sample],
            after: Sequence[Sample], at: datetime) -> list[ShutterBatch]:
        """Add one block; returns the batches this flushed (a batch of other K, S or counter first)."""
        key = (job_id, node)
        out = []
        b = self.open.get(key)
        if b is not None and (b.k, b.sample_us, b.counter) != (k, sample_us, str(counter)):
            out.append(self._close(key))
            b = None
        if b is None:
            seq = self.next_seq.get(key, 0)
            b = self.open[key] = OpenBatch(job_id, node, source, seq, k, sample_us, str(counter), at, at)
            self.next_seq[key] = seq + 1
            self._by_age.append((at, key, seq))
        b.cycle.append(cycle)
        size = len(str(cycle)) + 1
        for region, samples in zip(REGIONS, (before, during, after), strict=True):
            cols = b.columns[region]
            for s in samples:
                for name, v in zip(SAMPLE_FIELDS, s, strict=True):
                    cols[name].append(v)
                    size += len(str(v)) + 1
        b.size += size
        b.last = max(b.last, at)
        if len(b.cycle) >= self.policy.max_blocks or b.size >= self.policy.max_bytes:
            out.append(self._close(key))
        return out

    def add_block(self, block: ShutterBlock) -> list[ShutterBatch]:
        def triples(region: str) -> list[Sample]:
            return [(s.instructions, s.cycles, s.threads) for s in getattr(block, region)]

        return self.add(job_id=block.job_id, node=block.node, source=block.source, cycle=block.cycle, k=block.k,
                        sample_us=block.sample_us, counter=block.counter, before=triples("before"),
                        during=triples("during"), after=triples("after"), at=block.event_time)

    def due(self, now: datetime) -> list[ShutterBatch]:
        """The batches whose first block is ``max_age_s`` old at ``now``, oldest first."""
        limit = now - timedelta(seconds=self.policy.max_age_s)
        out = []
        while self._by_age and self._by_age[0][0] <= limit:
            _, key, seq = self._by_age.popleft()
            b = self.open.get(key)
            if b is not None and b.seq == seq:
                out.append(self._close(key))
        return out

    def close(self, job_id: str, node: str) -> ShutterBatch | None:
        """The job leaves the node: its stream's open batch, if any, to send before its marker; its
        batch numbers are not needed any more."""
        self.next_seq.pop((job_id, node), None)
        return self._close((job_id, node)) if (job_id, node) in self.open else None

    def flush_all(self) -> list[ShutterBatch]:
        return [self._close(key) for key in sorted(self.open)]

    def _close(self, key: tuple[str, str]) -> ShutterBatch:
        b = self.open.pop(key)
        return b.record(self.event_id(b))

    # ------------------------------------------------------------------ persistence (the agent's spool meta)

    def state(self) -> dict[str, Any]:
        return {"open": [b.state() for _, b in sorted(self.open.items())],
                "next_seq": [[j, n, s] for (j, n), s in sorted(self.next_seq.items())]}

    def restore(self, state: dict[str, Any]) -> None:
        self.open = {}
        self._by_age.clear()
        for d in state.get("open", []):
            b = OpenBatch.from_state(d)
            self.open[(b.job_id, b.node)] = b
        for b in sorted(self.open.values(), key=lambda b: b.opened):
            self._by_age.append((b.opened, (b.job_id, b.node), b.seq))
        self.next_seq = {(j, n): s for j, n, s in state.get("next_seq", [])}
