"""`nodeshare bench audit`: how fast the vectorized audit recomputes charges from a large archive.

A synthetic archive of valid records (K = 1 shutter blocks around a per-job true IPC ratio,
JobLeftNode markers and end events) is written the way the archive sink writes, then timed:
the vectorized recomputation of every charge, and a plain DuckDB scan of the same files
(reading every column: the value bytes and the typed columns) as the yardstick, in alternating
rounds so that a shared machine's drift slows both alike.
"""

from __future__ import annotations

import json
import platform
import shutil
import time
import uuid
from dataclasses import asdict, dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

import duckdb
import numpy as np
import pyarrow as pa

from nodeshare.schemas import SCHEMA_VERSION
from nodeshare.streams.accounting import PricingPolicy

from .archive import IPC_FIELDS, ArchivedEvent, ParquetArchive
from .fast_audit import fast_recompute

_T0 = datetime(2026, 1, 1, tzinfo=UTC)
_CYC = 8_320_000  # cycles of one 3.2 ms sample on 2.6 GHz x 1 thread


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


def block_json(job: str, node: str, cycle: int, before: int, during: int, after: int) -> str:
    """A valid K = 1 shutter block with these instruction counts, as JSON (fast: no model)."""
    return (
        f'{{"event_id":"{job}-{cycle}","schema_version":{SCHEMA_VERSION},"source":"bench","event_time":'
        f'"2026-01-01T00:00:00Z","kind":"shutter_block","job_id":"{job}","node":"{node}","cycle":{cycle},'
        f'"k":1,"sample_us":3200,"counter":"simulated",'
        f'"before":[{{"instructions":{before},"cycles":{_CYC},"threads":1}}],'
        f'"during":[{{"instructions":{during},"cycles":{_CYC},"threads":1}}],'
        f'"after":[{{"instructions":{after},"cycles":{_CYC},"threads":1}}]}}'
    )


def left_json(job: str, node: str, blocks: int) -> str:
    """The JobLeftNode marker closing a stream of ``blocks`` blocks (cycles 0..blocks-1)."""
    return (f'{{"event_id":"{job}-left","schema_version":{SCHEMA_VERSION},"source":"bench",'
            f'"event_time":"2026-01-01T01:00:00Z",'
            f'"kind":"job_left_node","job_id":"{job}","node":"{node}","blocks_sent":{blocks},'
            f'"last_cycle":{blocks - 1},"paused_us":{blocks * 3200}}}')


def end_json(job: str, node: str) -> str:
    """The job's end event: one hour on ``node`` with 8 cores."""
    end = _T0 + timedelta(hours=1)
    return json.dumps({
        "event_id": f"{job}-end", "source": "bench", "event_time": end.isoformat(), "kind": "job_event",
        "job_id": job, "state": "ended", "user": "u", "account": "a", "program": "p", "cores": 8,
        "nodes": [node], "start_time": _T0.isoformat(), "end_time": end.isoformat(),
    })


def synthetic_instructions(n: int, rng: np.random.Generator) -> np.ndarray:
    """(n, 3) instruction counts (before, during, after) of one job's K = 1 blocks: a solo IPC in
    0.5-2.0, slowed by 0-40% next to its co-runners (before and after), with 2% noise."""
    solo, slow = rng.uniform(0.5, 2.0), rng.uniform(0.6, 1.0)
    noise = rng.normal(1.0, 0.02, size=(n, 3))
    ipc = np.column_stack([solo * slow * noise[:, 0], solo * noise[:, 1], solo * slow * noise[:, 2]])
    return np.rint(ipc * _CYC).astype(np.int64)


def write_synthetic_archive(root: Path, blocks: int, blocks_per_job: int = 1000, seed: int = 1,
                            batch: int = 50_000) -> int:
    """Write ``blocks`` shutter blocks (plus markers and end events) into an archive at ``root``."""
    rng = np.random.default_rng(seed)
    archive = ParquetArchive(root)
    jobs = max(1, blocks // blocks_per_job)
    ipc_rows: list[ArchivedEvent] = []
    life_rows: list[ArchivedEvent] = []
    offset = 0

    def flush(force: bool = False) -> None:
        nonlocal ipc_rows
        if ipc_rows and (force or len(ipc_rows) >= batch):
            archive.write("node.ipc", ipc_rows)
            ipc_rows = []

    for j in range(jobs):
        job = str(1_000_000 + j)
        n = blocks_per_job if j < jobs - 1 else blocks - blocks_per_job * (jobs - 1)
        instr = synthetic_instructions(n, rng)
        ts = int(_T0.timestamp() * 1000) + j
        for c in range(n):
            b, d, a = instr[c]
            value = block_json(job, f"n{j % 97}", c, b, d, a)
            ipc_rows.append(ArchivedEvent("node.ipc", 0, offset, ts, job.encode(), value.encode()))
            offset += 1
        left = left_json(job, f"n{j % 97}", n)
        ipc_rows.append(ArchivedEvent("node.ipc", 0, offset, ts, job.encode(), left.encode()))
        offset += 1
        life = end_json(job, f"n{j % 97}")
        life_rows.append(ArchivedEvent("jobs.lifecycle", 0, j, ts, job.encode(), life.encode()))
        flush()
    flush(force=True)
    archive.write("jobs.lifecycle", life_rows)
    return jobs


def run_audit_bench(workdir: Path, blocks: int, rounds: int = 5) -> AuditBench:
    root = workdir / f"bench-archive-{uuid.uuid4().hex[:8]}"
    jobs = write_synthetic_archive(root, blocks)
    archive = ParquetArchive(root)
    files = archive.files()
    glob = str(root / "topic=*" / "date=*" / "p*.parquet").replace("'", "''")
    # The yardstick reads every column of every file: the value bytes and the typed columns.
    strings = [n for n, kind, _ in IPC_FIELDS if kind == pa.string()]
    numbers = [n for n, kind, _ in IPC_FIELDS if kind != pa.string()]
    everything = (f"SELECT count(*), sum(octet_length(value) + octet_length(key)), "
                  f"sum({' + '.join(f'coalesce({n}, 0)' for n in numbers)}), "
                  f"sum({' + '.join(f'coalesce(length({n}), 0)' for n in strings)}) "
                  f"FROM read_parquet('{glob}', union_by_name = true)")
    scan, runs = [], []
    for _ in range(rounds):  # interleaved: a machine that slows down mid-bench slows both alike
        t = time.perf_counter()
        duckdb.connect().execute(everything).fetchall()
        scan.append(time.perf_counter() - t)
        t = time.perf_counter()
        result = fast_recompute(root, {}, PricingPolicy())
        runs.append(time.perf_counter() - t)
    assert not result.ineligible and len(result.charges) == jobs, "the synthetic archive must be all clean"
    assert result.parsed_rows == 0, "every synthetic record must be read from its typed columns"
    audit_s, scan_s = float(np.median(runs)), float(np.median(scan))
    ratios = [s / a for s, a in zip(scan, runs, strict=True)]
    samples = result.samples
    archive_mb = round(sum(f.stat().st_size for f in files) / 1e6, 1)
    shutil.rmtree(root)  # hundreds of MB at large sizes; the bench regenerates it
    return AuditBench(
        blocks=blocks, jobs=jobs, samples=samples, files=len(files),
        archive_mb=archive_mb,
        audit_s=round(audit_s, 3), samples_per_s=round(samples / audit_s),
        scan_s=round(scan_s, 4), ratio_to_scan=round(float(np.median(ratios)), 4),
        ratio_range=(round(min(ratios), 4), round(max(ratios), 4)), rounds=rounds,
        machine=f"{platform.machine()}, {available_cores()} cores, Python {platform.python_version()}",
        date=datetime.now(UTC).date().isoformat(),
    )


def available_cores() -> int:
    """CPUs this process may run on (the affinity mask, not the host's count)."""
    import os

    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def as_json(bench: AuditBench) -> str:
    return json.dumps(asdict(bench), indent=2)
