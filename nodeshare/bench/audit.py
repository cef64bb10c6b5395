"""`nodeshare bench audit`: how fast the vectorized audit recomputes charges from a large archive.

The calibrated cluster simulator runs a shared cluster until it has sent the asked number of
shutter blocks; its node.ipc and jobs.lifecycle records (the topics the audit reads) are archived
as the archive sink would store them, then compacted. Then, in alternating rounds so that a
shared machine's drift slows both alike: the vectorized recomputation of every charge, and a
plain DuckDB scan of the same files (reading every column: the value bytes, the typed columns
and every element of the typed list columns) as the yardstick.
"""

from __future__ import annotations

import math
import shutil
import time
import uuid
from collections import defaultdict
from collections.abc import Callable, Iterator
from concurrent.futures import Executor, ProcessPoolExecutor
from contextlib import AbstractContextManager, contextmanager
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
from nodeshare.sinks.fast_audit import FastResult, fast_recompute
from nodeshare.streams.core.accounting import PricingPolicy

from .machine import machine_stamp


@dataclass
class AuditBench:
    blocks: int
    jobs: int
    samples: int
    files: int
    archive_mb: float
    audit_s: float
    samples_per_s: float
    scan_s: float
    ratio_to_scan: float  # the median of the rounds' ratios
    ratio_range: tuple[float, float]  # the lowest and highest round
    rounds: int
    machine: str
    date: str
    # the same recomputation as one Dask task per archive partition on a LocalCluster of N worker
    # processes (median seconds of the rounds, cluster start excluded)
    samples_per_s_by_workers: dict[str, int] = field(default_factory=dict)
    speedup_2_workers: float | None = None
    partitions: int = 0
    # the machine's own yardstick: the same tasks on a plain pool of N processes, no Dask; what two
    # processes gain here bounds what two Dask workers can
    samples_per_s_by_processes: dict[str, int] = field(default_factory=dict)
    speedup_2_processes: float | None = None


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
    """Seconds of the plain scan and of the audit, in alternating rounds (a machine that slows down
    mid-bench slows both alike), and the audit's last result."""
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


def _partition_task(root: str, partition: int) -> int:
    """One distributed task: the fast recomputation of one partition; the samples it checked."""
    return fast_recompute(Path(root), {}, PricingPolicy(), (partition,), threads=1).samples


@contextmanager
def _dask_pool(workers: int) -> Iterator[Executor]:
    """A LocalCluster of ``workers`` processes, as a concurrent.futures executor."""
    from nodeshare.sinks.audit import dask_client

    with dask_client(workers=workers) as client:
        yield client.get_executor(pure=False)


def _plain_pool(workers: int) -> ProcessPoolExecutor:
    """A plain process pool: no scheduler, no serialization beyond the pool's (the machine's own ceiling)."""
    return ProcessPoolExecutor(max_workers=workers)


def _timed_pools(root: Path, workers: list[int], rounds: int,
                 pool: Callable[[int], AbstractContextManager[Executor]]) -> tuple[dict[int, float], int, int]:
    """Median seconds of the recomputation as one task per partition (largest first) on a pool of
    each number of workers (a first round warms every worker up and is not counted), the samples
    the tasks checked, and the number of partitions."""
    partitions = ParquetArchive(root).largest_partitions_first([NODE_IPC.name, JOBS_LIFECYCLE.name])
    seconds: dict[int, float] = {}
    samples = 0
    for n in workers:
        with pool(n) as executor:
            runs = []
            for r in range(rounds + 1):
                t = time.perf_counter()
                samples = sum(executor.map(_partition_task, [str(root)] * len(partitions), partitions))
                if r:
                    runs.append(time.perf_counter() - t)
        seconds[n] = float(np.median(runs))
    return seconds, samples, len(partitions)


def run_audit_bench(workdir: Path, blocks: int, rounds: int = 11,
                    progress: Callable[[int], None] | None = None, workers: list[int] | None = None) -> AuditBench:
    root = workdir / f"bench-archive-{uuid.uuid4().hex[:8]}"
    by_workers: dict[int, float] = {}
    by_processes: dict[int, float] = {}
    partitions = 0
    try:
        jobs = write_simulated_archive(root, blocks, progress=progress)
        files = ParquetArchive(root).files()
        archive_mb = round(sum(f.stat().st_size for f in files) / 1e6, 1)
        scan, runs, result = _timed_rounds(root, rounds)
        if workers:
            by_workers, spread_samples, partitions = _timed_pools(root, workers, max(3, rounds // 2), _dask_pool)
            if spread_samples != result.samples:
                raise RuntimeError(f"the partitions' tasks checked {spread_samples} samples, one process "
                                   f"{result.samples}")
            by_processes = _timed_pools(root, workers, max(3, rounds // 2), _plain_pool)[0]
    finally:
        shutil.rmtree(root, ignore_errors=True)  # hundreds of MB at large sizes; the bench regenerates it
    if result.ineligible or len(result.charges) != jobs or result.parsed_rows:
        raise RuntimeError(f"the simulated archive must be all clean and read from its typed columns: "
                           f"{len(result.charges)} charges of {jobs} jobs, {len(result.ineligible)} ineligible, "
                           f"{result.parsed_rows} rows parsed")
    audit_s, scan_s = float(np.median(runs)), float(np.median(scan))
    ratios = [s / a for s, a in zip(scan, runs, strict=True)]
    samples = result.samples
    return AuditBench(
        blocks=samples // 3, jobs=jobs, samples=samples, files=len(files),
        archive_mb=archive_mb,
        audit_s=round(audit_s, 3), samples_per_s=round(samples / audit_s),
        scan_s=round(scan_s, 4), ratio_to_scan=round(float(np.median(ratios)), 4),
        ratio_range=(round(min(ratios), 4), round(max(ratios), 4)), rounds=rounds,
        machine=machine_stamp(),
        date=datetime.now(UTC).date().isoformat(),
        samples_per_s_by_workers={str(n): round(samples / t) for n, t in by_workers.items()},
        speedup_2_workers=round(by_workers[1] / by_workers[2], 3) if {1, 2} <= by_workers.keys() else None,
        partitions=partitions,
        samples_per_s_by_processes={str(n): round(samples / t) for n, t in by_processes.items()},
        speedup_2_processes=round(by_processes[1] / by_processes[2], 3) if {1, 2} <= by_processes.keys() else None,
    )


