"""`nodeshare bench ledger`: how many shutter windows per second the ledger sink can count.

The ledger sink reads ``node.shutter`` next to the charges, to keep the analysts' co-runner
counts (``Ledger.count_shutters``). This times its two steps without a broker, on a synthetic
cluster of nodes each sharing ``jobs_per_node`` jobs in turn: decoding each message (the same
pydantic decode the sink does) and counting a batch in one transaction of the DuckDB file.
It also reports the charges of capability jobs (``bigjob``: fold time and charge bytes).
"""

from __future__ import annotations

import tempfile
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from nodeshare.schemas import ShutterWindow, decode, encode
from nodeshare.schemas.catalog import NODE_SHUTTER
from nodeshare.sinks.ledger import Ledger

from .bigjob import run_bigjob_bench
from .machine import machine_stamp

_T0 = datetime(2026, 1, 1, tzinfo=UTC)


def synthetic_windows(windows: int, nodes: int, jobs_per_node: int) -> list[bytes]:
    """Encoded shutter windows, round robin over the nodes; on each node the lone job rotates."""
    out = []
    for i in range(windows):
        n, cycle = i % nodes, i // nodes
        jobs = [f"{1_000_000 + n * jobs_per_node + j}" for j in range(jobs_per_node)]
        lone = jobs[cycle % jobs_per_node]
        start = _T0 + timedelta(milliseconds=10 * cycle)
        out.append(encode(ShutterWindow(
            event_id=f"n{n}/{cycle}", source="bench", event_time=start, node=f"n{n}", cycle=cycle, lone_job=lone,
            paused_jobs=tuple(j for j in jobs if j != lone), start=start, end=start + timedelta(milliseconds=3))))
    return out


def run_ledger_bench(windows: int = 100_000, nodes: int = 1_000, jobs_per_node: int = 4,
                     batch: int = 10_000) -> dict[str, Any]:
    raws = synthetic_windows(windows, nodes, jobs_per_node)
    t = time.perf_counter()
    decoded = [decode(NODE_SHUTTER, r) for r in raws]
    decode_s = time.perf_counter() - t
    assert all(isinstance(w, ShutterWindow) for w in decoded)
    with tempfile.TemporaryDirectory() as tmp, Ledger(Path(tmp) / "bench.duckdb") as ledger:
        t = time.perf_counter()
        counted = sum(ledger.count_shutters(decoded[i:i + batch]) for i in range(0, windows, batch))  # type: ignore[arg-type]
        count_s = time.perf_counter() - t
        pairs = len(ledger.co_runner_counts())
    assert counted == windows and pairs == nodes * jobs_per_node * (jobs_per_node - 1)
    per_window = (decode_s + count_s) / windows
    return {
        "windows": windows, "nodes": nodes, "jobs_per_node": jobs_per_node, "batch": batch,
        "decode_us_per_window": round(decode_s / windows * 1e6, 2),
        "count_us_per_window": round(count_s / windows * 1e6, 2),
        "windows_per_s": round(1 / per_window),
        **run_bigjob_bench(),  # the charges of capability jobs: fold time and bytes
        "machine": machine_stamp(),
        "date": datetime.now(UTC).date().isoformat(),
    }
