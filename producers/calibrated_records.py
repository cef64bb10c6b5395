"""What a calibrated run emits, as records (for the broker, the experiments' in-process fold) or
as typed Parquet (a whole cluster hour without holding it in memory)."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from nodeshare.schemas import (
    CounterSource,
    JobEvent,
    JobLeftNode,
    JobState,
    LlcSample,
    NodeInventory,
    Record,
    ShutterWindow,
)

from .batching import Batcher, FlushPolicy
from .calibrated import CAT_EPISODE_S, CAT_WAYS, SIM_NAMESPACE, CalibratedConfig, Engine, JobTable, Result, Sink, job_id
from .simulator import Simulation
from .workloads import interp_ways


class RecordSink(Sink):
    """Builds the pydantic records the node agents and the resource manager would send."""

    def __init__(self, cfg: CalibratedConfig, flush: FlushPolicy | None = None) -> None:
        self.cfg = cfg
        self.engine: Engine | None = None
        self.out: list[tuple[float, int, Record]] = []
        self.cyc = cfg.cycles_per_sample
        # blocks travel in batches, flushed as the node agent flushes them (producers.batching)
        self.batcher = Batcher(flush, lambda b: self.eid("bat", b.job_id, b.node, b.seq))

    def bind(self, engine: Engine) -> None:
        self.engine = engine

    def _jobs(self) -> JobTable:
        assert self.engine is not None, "the sink is bound by the engine"
        return self.engine.jobs

    def _nodes(self) -> list[str]:
        assert self.engine is not None, "the sink is bound by the engine"
        return self.engine.node_names

    def at(self, t_s: float) -> datetime:
        return self.cfg.start + timedelta(microseconds=round(t_s * 1e6))

    def eid(self, *parts: object) -> str:
        return str(uuid.uuid5(SIM_NAMESPACE, "/".join(map(str, (self.cfg.seed, *parts)))))

    def _emit(self, t: float, r: Record) -> None:
        self.out.append((t, len(self.out), r))

    def inventory(self, t: float, nodes: list[str], cores: int) -> None:
        for n in nodes:
            self._emit(t, NodeInventory(event_id=self.eid("inv", n), source="sim/inventory", event_time=self.at(t),
                                        node=n, cores=cores, llc_ways=int(2 * self.cfg.socket.ways),
                                        mem_bandwidth_gbps=2 * self.cfg.socket.bw_gbps))

    def lifecycle(self, t: float, job: int, state: JobState) -> None:
        J = self._jobs()
        spec = J.specs[job]
        names = self._nodes()
        ran = state is not JobState.SUBMITTED
        nodes = tuple(names[n] for n in J.nodes[job]) if ran else ()
        self._emit(t, JobEvent(
            event_id=self.eid("job", job, state.value), source="sim/slurm", event_time=self.at(t), job_id=job_id(job),
            state=state, user=spec.user, account=spec.account, program=spec.program,
            cores=self.cfg.slot_cores * max(1, len(J.nodes[job]) if ran else spec.nodes), nodes=nodes,
            submit_time=self.at(J.submit[job]), start_time=self.at(J.start[job]) if ran else None,
            end_time=self.at(J.end[job]) if state is JobState.ENDED else None))
        if state is JobState.STARTED:
            self.cat_profile(t, job, nodes)

    def cat_profile(self, t: float, job: int, nodes: tuple[str, ...]) -> None:
        """CAT episodes of a job that starts: on each of its nodes, its processes held a few way
        counts in turn; IPC and bandwidth are the program's curves at the ways each process got."""
        assert self.engine is not None, "the sink is bound by the engine"
        program = self.engine.programs[self._jobs().specs[job].program]
        sock = self.cfg.socket
        total = int(2 * sock.ways)
        for node in nodes:
            for i, ways in enumerate(w for w in CAT_WAYS if w <= total):
                per_process = np.array([ways / 2.0 / sock.procs])
                ipc = float(interp_ways(np.asarray(program.ipc)[None, :], per_process)[0])
                bw = 2 * sock.procs * float(interp_ways(np.asarray(program.bw_gbps)[None, :], per_process)[0])
                self._emit(t, LlcSample(
                    event_id=self.eid("cat", job, node, ways), source=f"sim/{node}", event_time=self.at(t + i * 1e-6),
                    job_id=job_id(job), node=node, llc_ways=ways, node_llc_ways=total, cores=self.cfg.slot_cores,
                    ipc=ipc, bandwidth_gbps=min(bw, sock.bw_gbps * 2), interval_s=CAT_EPISODE_S))

    def blocks(self, t: float, cycle: int, nodes: np.ndarray, jobs: np.ndarray, samples: np.ndarray,
               sample_us: int | None = None) -> None:
        """Each block joins its (job, node) batch; full batches, and batches whose age is up, go out
        (a batch also goes out when the next block's S differs: producers.batching)."""
        names = self._nodes()
        s_us = self.cfg.sample_us if sample_us is None else sample_us
        cyc = self.cyc if sample_us is None else self.cfg.cycles_per(s_us)
        instr = np.rint(samples * cyc).astype(np.int64).tolist()
        at = self.at(t)
        k, threads = self.cfg.k, self.cfg.slot_cores
        for i, (n, j) in enumerate(zip(nodes.tolist(), jobs.tolist(), strict=True)):
            node = names[n]
            regions = [[(v, cyc, threads) for v in instr[i][r]] for r in range(3)]
            for b in self.batcher.add(job_id=job_id(j), node=node, source=f"sim/{node}", cycle=cycle, k=k,
                                      sample_us=s_us, counter=CounterSource.SIMULATED,
                                      before=regions[0], during=regions[1], after=regions[2], at=at):
                # at its newest block's time, as every other flush: a batch cut because S changed
                # stood at the raw t, after the next batch closed at the same instant rounded to the
                # microsecond, so the fold met the two out of order and ignored the first's blocks
                self._emit((b.event_time - self.cfg.start).total_seconds(), b)
        for b in self.batcher.due(at):  # stands at its newest block's time
            self._emit((b.event_time - self.cfg.start).total_seconds(), b)

    def windows(self, t_start: float, t_end: float, cycle: int, nodes: np.ndarray, lone: np.ndarray,
                paused: np.ndarray) -> None:
        names = self._nodes()
        for n, lj, pj in zip(nodes.tolist(), lone.tolist(), paused.tolist(), strict=True):
            node = names[n]
            self._emit(t_end, ShutterWindow(
                event_id=self.eid("win", node, cycle), source=f"sim/{node}", event_time=self.at(t_end), node=node,
                cycle=cycle, lone_job=job_id(lj), paused_jobs=(job_id(pj),), start=self.at(t_start),
                end=self.at(t_end)))

    def left(self, t: float, job: int, node: int, blocks: int, last_cycle: int, paused_us: int,
             alone_us: int) -> None:
        name = self._nodes()[node]
        last = self.batcher.close(job_id(job), name)  # the open batch goes first: the charge is not delayed
        if last is not None:
            self._emit((last.event_time - self.cfg.start).total_seconds(), last)
        self._emit(t, JobLeftNode(event_id=self.eid("left", job, name), source=f"sim/{name}", event_time=self.at(t),
                                  job_id=job_id(job), node=name, blocks_sent=blocks, last_cycle=last_cycle,
                                  paused_us=paused_us, alone_us=alone_us))

    def records(self) -> list[Record]:
        return [r for _, _, r in sorted(self.out, key=lambda e: (e[0], e[1]))]

    def drain(self) -> list[Record]:
        """The records built since the last drain, in event-time order, and forget them: a long
        run is published step by step instead of being held in memory."""
        out = self.records()
        self.out.clear()
        return out


@dataclass
class CalibratedSimulation(Simulation):
    """A calibrated run in memory: the simple simulator's records and truth, and the engine's result."""

    result: Result


def with_records(cfg: CalibratedConfig, run: Callable[[Sink], Result]) -> CalibratedSimulation:
    """Run a scenario with a record sink and return events (in event-time order) and truth."""
    sink = RecordSink(cfg)
    result = run(sink)
    return CalibratedSimulation(sink.records(), result.truth, result)


class ParquetSink(Sink):
    """Large clusters: the event stream as typed Parquet tables, one per event kind
    (``blocks``, ``windows``, ``lifecycle``, ``left``), written in row groups as the run goes.
    Instruction counts are per sample, as a node agent reads them (cycles per sample are fixed:
    ``cycles_per_sample`` in the file metadata)."""

    def __init__(self, cfg: CalibratedConfig, out_dir: Path, flush_rows: int = 1_000_000) -> None:
        self.cfg = cfg
        self.dir = Path(out_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.flush_rows = flush_rows
        self.cyc = cfg.cycles_per_sample
        self.engine: Engine | None = None
        self._buf: dict[str, list[dict[str, np.ndarray]]] = {"blocks": [], "windows": [], "lifecycle": [], "left": []}
        self._rows: dict[str, int] = dict.fromkeys(self._buf, 0)
        self._writers: dict[str, pq.ParquetWriter] = {}
        self.rows: dict[str, int] = dict.fromkeys(self._buf, 0)

    def bind(self, engine: Engine) -> None:
        self.engine = engine

    def _add(self, table: str, cols: dict[str, np.ndarray]) -> None:
        self._buf[table].append(cols)
        n = len(next(iter(cols.values())))
        self._rows[table] += n
        self.rows[table] += n
        if self._rows[table] >= self.flush_rows:
            self._flush(table)

    def _flush(self, table: str) -> None:
        parts = self._buf[table]
        if not parts:
            return
        cols = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
        batch = pa.table(cols).replace_schema_metadata({
            "cycles_per_sample": str(self.cyc), "sample_us": str(self.cfg.sample_us), "k": str(self.cfg.k),
            "start": self.cfg.start.isoformat(), "seed": str(self.cfg.seed)})
        writer = self._writers.get(table)
        if writer is None:
            writer = self._writers[table] = pq.ParquetWriter(self.dir / f"{table}.parquet", batch.schema,
                                                             compression="zstd")
        writer.write_table(batch)
        self._buf[table] = []
        self._rows[table] = 0

    def close(self) -> None:
        for table in self._buf:
            self._flush(table)
        for w in self._writers.values():
            w.close()

    def lifecycle(self, t: float, job: int, state: JobState) -> None:
        self._add("lifecycle", {"t_us": np.array([round(t * 1e6)]), "job": np.array([job]),
                                "state": np.array([state.value])})

    def blocks(self, t: float, cycle: int, nodes: np.ndarray, jobs: np.ndarray, samples: np.ndarray,
               sample_us: int | None = None) -> None:
        if sample_us is not None and sample_us != self.cfg.sample_us:
            raise NotImplementedError("the Parquet sink has one S per file (cycles_per_sample); "
                                      "an adaptive schedule's blocks go through the record sink")
        instr = np.rint(samples * self.cyc).astype(np.int64)  # (n, 3, k): K samples per region, in order
        cols: dict[str, np.ndarray] = {"cycle": np.full(len(nodes), cycle, np.int64),
                                       "node": nodes.astype(np.int32), "job": jobs}
        for i, region in enumerate(("before", "during", "after")):
            for s in range(self.cfg.k):
                cols[f"{region}{s}" if self.cfg.k > 1 else region] = instr[:, i, s]
        self._add("blocks", cols)

    def windows(self, t_start: float, t_end: float, cycle: int, nodes: np.ndarray, lone: np.ndarray,
                paused: np.ndarray) -> None:
        self._add("windows", {"cycle": np.full(len(nodes), cycle, np.int64), "node": nodes.astype(np.int32),
                              "lone": lone, "paused": paused})

    def left(self, t: float, job: int, node: int, blocks: int, last_cycle: int, paused_us: int,
             alone_us: int) -> None:
        self._add("left", {"t_us": np.array([round(t * 1e6)]), "job": np.array([job]), "node": np.array([node]),
                           "blocks": np.array([blocks]), "last_cycle": np.array([last_cycle]),
                           "paused_us": np.array([paused_us]), "alone_us": np.array([alone_us])})
