"""`nodeshare bench audit`: how fast the vectorized audit recomputes charges from a large archive.

The calibrated cluster simulator runs a shared cluster until it has sent the asked number of
shutter blocks; its node.ipc and jobs.lifecycle records (the topics the audit reads) are archived
as the archive sink would store them, then compacted. Then, in alternating rounds so that a
shared machine's drift slows both alike: the vectorized recomputation of every charge, and a
plain DuckDB scan of the same files (reading every column: the value bytes, the typed columns
and every element of the typed list columns) as the yardstick. Then the scaling: the same audit on
one thread (the per-core yardstick), and on local Dask clusters of 1, 2, ... worker processes,
each with its throughput, its efficiency (throughput / (workers x one thread's)) and its tasks.
"""

from __future__ import annotations

import math
import shutil
import time
import uuid
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path

import duckdb
import numpy as np
import pyarrow as pa
from aiokafka.partitioner import murmur2

from nodeshare.producers.calibrated import SLOTS, CalibratedConfig, JobSpec, run_cluster
from nodeshare.producers.calibrated_records import RecordSink
from nodeshare.producers.job_mix import synthetic_jobs
from nodeshare.schemas import TOPIC_OF_RECORD, ShutterBlock, encode, key_of
from nodeshare.schemas.catalog import JOBS_LIFECYCLE, NODE_IPC
from nodeshare.sinks.archive import IPC_FIELDS, IPC_LISTS, ArchivedEvent, ParquetArchive
from nodeshare.sinks.audit import dask_client, on_dask
from nodeshare.sinks.fast_audit import FastResult, Runner, fast_recompute, in_process, plan_chunks
from nodeshare.streams.core.accounting import PricingPolicy

from .machine import machine_stamp


@dataclass
class AuditBench:
    blocks: int
    jobs: int
    samples: int
    files: int
    row_groups: int
    archive_mb: float
    # the audit as ``nodeshare audit`` runs it by default: tasks on a thread per core of this process
    audit_s: float
    samples_per_s: float
    scan_s: float
    ratio_to_scan: float  # the median of the rounds' ratios
    ratio_range: tuple[float, float]  # the lowest and highest round
    rounds: int
    machine: str
    date: str
    tasks: int = 0
    # the per-core yardstick: the same audit on one thread of this process (one task)
    single_thread_samples_per_s: int = 0
    # per count of Dask worker processes (one thread each, a LocalCluster, started before the clock):
    # samples_per_s, efficiency = samples_per_s / (workers x single_thread_samples_per_s), tasks
    by_workers: dict[str, dict[str, float]] = field(default_factory=dict)
    speedup_2_workers: float | None = None  # 2 Dask workers over the single thread
    efficiency_1_worker: float | None = None
    # the one-thread run's seconds per step (medians; ``fast_recompute``'s timings): what the tasks
    # take (tasks_s), what runs beside them (terminals_s, duplicates_s) and what the driver does
    # alone before and after (plan_s, merge_s, charges_s, the rest of total_s)
    steps_s: dict[str, float] = field(default_factory=dict)
    serial_fraction: float | None = None  # what workers do not shorten, of total_s (Amdahl's law)
    # per worker count: the most any number of perfect workers could speed the one thread up by
    # while the driver stays one thread (an upper bound: merging more chunks costs more)
    speedup_bound: dict[str, float] = field(default_factory=dict)


#: A broker appends a record a few milliseconds after the agent stamped it (the archive keeps the
#: broker's timestamp; the clock rule compares the two).
_BROKER_LAG_MS = 3
_MAX_NODES = 4  # the widest job of the bench's cluster


class _ArchivingSink(RecordSink):
    """The calibrated simulator's records as the archive sink stores them: each audited topic's
    records encoded as the producers encode them, keyed and partitioned as the Kafka producer
    does (murmur2 of the key), numbered per partition, written in sink-sized batches. The topics
    the audit does not read (shutter windows, CAT episodes, inventory) are not built."""

    TOPICS = (NODE_IPC.name, JOBS_LIFECYCLE.name)

    def __init__(self, cfg: CalibratedConfig, archive: ParquetArchive, partitions: int, batch: int) -> None:
        super().__init__(cfg)
        self.archive, self.partitions, self.batch = archive, partitions, batch
        self.offsets: dict[tuple[str, int], int] = defaultdict(int)
        self.pending: dict[str, list[ArchivedEvent]] = {t: [] for t in self.TOPICS}
        self.blocks_written = 0

    def windows(self, t_start: float, t_end: float, cycle: int, nodes: np.ndarray, lone: np.ndarray,
                paused: np.ndarray) -> None:
        pass  # node.shutter

    def cat_profile(self, t: float, job: int, nodes: tuple[str, ...]) -> None:
        pass  # node.llc

    def flush(self, force: bool = False) -> None:
        for record in self.drain():
            topic = TOPIC_OF_RECORD[type(record)].name
            if topic not in self.pending:
                continue
            key = key_of(record)
            partition = (murmur2(key) & 0x7FFFFFFF) % self.partitions  # Kafka's default partitioner
            offset = self.offsets[(topic, partition)]
            self.offsets[(topic, partition)] = offset + 1
            stamp = round(record.event_time.timestamp() * 1000) + _BROKER_LAG_MS
            self.pending[topic].append(ArchivedEvent(topic, partition, offset, stamp, key, encode(record)))
            self.blocks_written += isinstance(record, ShutterBlock)
        for topic, rows in self.pending.items():
            if rows and (force or len(rows) >= self.batch):
                self.archive.write(topic, rows)
                rows.clear()


def simulated_jobs(cfg: CalibratedConfig, blocks: int, waves: float = 5.0) -> list[JobSpec]:
    """Jobs for about ``blocks`` shutter blocks on a full cluster. A shared node sends one block
    per cycle, for the job in the slot left alone, so a job on ``n`` nodes sends about
    ``n * run time / (2 cycles)``; each slot runs about ``waves`` jobs one after another, all
    submitted early so that a queue keeps every node shared. (Contention stretches run times, so
    a run sends somewhat more blocks than asked.)"""
    cycle_s = 3 * cfg.k * cfg.sample_us / 1e6 + cfg.period_ms / 1e3
    makespan_s = blocks / cfg.nodes * cycle_s
    widths = [s.nodes for s in synthetic_jobs(1000, cfg.seed, max_nodes=_MAX_NODES)]
    n = max(2, math.ceil(waves * SLOTS * cfg.nodes / float(np.mean(widths))))
    specs = synthetic_jobs(n, cfg.seed, span_s=0.1 * makespan_s, max_nodes=_MAX_NODES)
    scale = blocks * 2 * cycle_s / sum(s.work_s * s.nodes for s in specs)
    return [replace(s, work_s=s.work_s * scale) for s in specs]


def write_simulated_archive(root: Path, blocks: int, *, nodes: int = 64, partitions: int = 4, seed: int = 1,
                            batch: int = 50_000, progress: Callable[[int], None] | None = None) -> int:
    """Run the calibrated cluster simulator until it has sent about ``blocks`` shutter blocks (every
    job runs to its end) and archive its node.ipc and jobs.lifecycle records at ``root``; then
    compact, as an operator would. Returns the number of jobs; ``progress`` gets the blocks so far."""
    cfg = CalibratedConfig(nodes=nodes, seed=seed)
    archive = ParquetArchive(root)
    sink = _ArchivingSink(cfg, archive, partitions, batch)

    def step(_t: float) -> None:
        sink.flush()
        if progress is not None:
            progress(sink.blocks_written)

    result = run_cluster(cfg, simulated_jobs(cfg, blocks), sink=sink, progress=step)
    sink.flush(force=True)
    archive.compact()
    return len(result.truth)


def _timed_rounds(root: Path, rounds: int) -> tuple[list[float], list[float], FastResult]:
    """Seconds of the plain scan and of the audit (tasks on a thread per core), in alternating rounds
    (a machine that slows down mid-bench slows both alike), and the audit's last result."""
    glob = ParquetArchive(root).glob_sql()
    # The yardstick reads every column of every file: the value bytes, the typed scalar columns and
    # every element of the typed list columns (a batch's blocks).
    strings = [n for n, kind, _ in IPC_FIELDS if kind == pa.string()]
    numbers = [n for n, kind, _ in IPC_FIELDS if kind != pa.string()]
    lists = [n for n, _, _ in IPC_LISTS]
    everything = (f"SELECT count(*), sum(octet_length(value) + octet_length(key)), "
                  f"sum({' + '.join(f'coalesce({n}, 0)' for n in numbers)}), "
                  f"sum({' + '.join(f'coalesce(length({n}), 0)' for n in strings)}), "
                  f"sum({' + '.join(f'coalesce(list_sum({n}), 0)' for n in lists)}) "
                  f"FROM read_parquet('{glob}', union_by_name = true)")
    scan, runs = [], []
    result = FastResult()
    for _ in range(rounds):
        t = time.perf_counter()
        duckdb.connect().execute(everything).fetchall()
        scan.append(time.perf_counter() - t)
        t = time.perf_counter()
        result = fast_recompute(root, {}, PricingPolicy())
        runs.append(time.perf_counter() - t)
    return scan, runs, result


def _timed(root: Path, runner: Runner, rounds: int, steps: dict[str, float] | None = None) -> tuple[float, int]:
    """Median seconds of the recomputation on ``runner`` (a first round warms it up and is not
    counted), and the samples it checked; ``steps`` gets the median seconds of each of its steps."""
    runs = []
    samples = 0
    laps: list[dict[str, float]] = []
    for r in range(rounds + 1):
        timings: dict[str, float] = {}
        t = time.perf_counter()
        samples = fast_recompute(root, {}, PricingPolicy(), runner=runner, timings=timings).samples
        if r:
            runs.append(time.perf_counter() - t)
            laps.append(timings)
    if steps is not None:
        steps.update({k: round(float(np.median([lp.get(k, 0.0) for lp in laps])), 4) for k in sorted(laps[0])})
    return float(np.median(runs)), samples


def speedup_bound(steps: dict[str, float], workers: int) -> float:
    """How much faster than one thread the audit can be on ``workers`` perfect worker processes
    while its driver stays one thread: the tasks shrink to tasks_s / workers, but no further than
    what runs beside them (the lifecycle decoding, the duplicate check); the charges, built in
    groups on the workers, to charges_s / workers; the plan, the merge and the rest do not shrink
    at all (Amdahl's law)."""
    total, tasks, charges = steps["total_s"], steps.get("tasks_s", 0.0), steps.get("charges_s", 0.0)
    beside = max(steps.get("terminals_s", 0.0), steps.get("duplicates_s", 0.0))
    return total / (total - tasks - charges + charges / workers + max(tasks / workers, beside))


def run_audit_bench(workdir: Path, blocks: int, rounds: int = 11,
                    progress: Callable[[int], None] | None = None, workers: list[int] | None = None) -> AuditBench:
    root = workdir / f"bench-archive-{uuid.uuid4().hex[:8]}"
    by_workers: dict[str, dict[str, float]] = {}
    try:
        jobs = write_simulated_archive(root, blocks, progress=progress)
        view = ParquetArchive(root)
        files = view.files()
        row_groups = sum(len(view.row_groups(f)) for f in files)
        archive_mb = round(sum(f.stat().st_size for f in files) / 1e6, 1)
        scan, runs, result = _timed_rounds(root, rounds)
        tasks = len(plan_chunks(view, in_process().tasks))
        steps: dict[str, float] = {}
        single_s, single_samples = _timed(root, in_process(1), max(3, rounds // 2), steps)
        single = single_samples / single_s
        for n in workers or []:
            with dask_client(workers=n) as client:
                runner = on_dask(client)
                seconds, spread_samples = _timed(root, runner, max(3, rounds // 2))
            if spread_samples != result.samples:
                raise RuntimeError(f"{n} workers' tasks checked {spread_samples} samples, one process {result.samples}")
            rate = spread_samples / seconds
            by_workers[str(n)] = {"samples_per_s": round(rate), "efficiency": round(rate / (n * single), 3),
                                  "tasks": len(plan_chunks(view, runner.tasks))}
    finally:
        shutil.rmtree(root, ignore_errors=True)  # hundreds of MB at large sizes; the bench regenerates it
    if result.ineligible or len(result.charges) != jobs or result.suspect_rows:
        raise RuntimeError(f"the simulated archive must be all clean and read from its typed columns: "
                           f"{len(result.charges)} charges of {jobs} jobs, {len(result.ineligible)} ineligible, "
                           f"{result.suspect_rows} rows whose typed columns are not their values")
    audit_s, scan_s = float(np.median(runs)), float(np.median(scan))
    ratios = [s / a for s, a in zip(scan, runs, strict=True)]
    samples = result.samples
    return AuditBench(
        blocks=samples // 3, jobs=jobs, samples=samples, files=len(files), row_groups=row_groups,
        archive_mb=archive_mb,
        audit_s=round(audit_s, 3), samples_per_s=round(samples / audit_s),
        scan_s=round(scan_s, 4), ratio_to_scan=round(float(np.median(ratios)), 4),
        ratio_range=(round(min(ratios), 4), round(max(ratios), 4)), rounds=rounds,
        machine=machine_stamp(),
        date=datetime.now(UTC).date().isoformat(),
        tasks=tasks, single_thread_samples_per_s=round(single), by_workers=by_workers,
        speedup_2_workers=round(by_workers["2"]["samples_per_s"] / single, 3) if "2" in by_workers else None,
        efficiency_1_worker=by_workers["1"]["efficiency"] if "1" in by_workers else None,
        steps_s=steps, serial_fraction=round(1.0 - (steps["tasks_s"] + steps["charges_s"]) / steps["total_s"], 4),
        speedup_bound={str(n): round(speedup_bound(steps, n), 2) for n in (2, 4, 16)},
    )
