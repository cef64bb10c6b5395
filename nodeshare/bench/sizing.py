"""`nodeshare bench sizing` (issue 42, item 7): what a cluster asks of the pipeline, per node-hour,
measured on a calibrated simulated cluster, and scaled to 100, 1,000 and 10,000 nodes.

Measured here, on the records the node agents and the resource manager would send:
* messages and encoded bytes per topic and node-hour (after a warm-up, once the cluster is full);
* the Parquet archive's bytes per node-hour, per topic, in the default 4 partitions (murmur2 on
  the key, as producers partition) after ``archive compact`` has merged the sink's small files;
* the stream worker's state per job, for jobs running, charged and queued: its size in memory,
  measured live (the drop in traced memory when the fold's accounts of that kind are let go), and
  its JSON (what a fold snapshot holds for it, before compression);
* the same at 10,000 jobs in memory at once (the accounts copied under new job ids): worker memory
  per running job, and per charged job, at that count (the cluster figures take the larger of the
  two measurements);
* what a settled job costs once its account left memory (``fold_evict_after_s`` after its charge,
  issue 42 item 6): its entry in the partition's index, in memory and the time it adds to each
  snapshot, and its compressed account on ``accounting.settled``.

Taken from other benchmarks (their figures are inputs, named in the result): the blocks per second
one stream worker folds (``bench stream``), the samples per second one audit thread recomputes
(``bench audit``) and the shutter windows per second the ledger sink counts (``bench ledger``).
Scaling is linear in nodes for the per-block and per-job work; what grows with time instead (the
accounts the worker keeps, the snapshots that carry them, the archive an audit reads whole) is
given per day. The broker's own limits are not measured here.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import shutil
import tempfile
import time
import tracemalloc
from collections import defaultdict
from collections.abc import Callable, Iterator
from datetime import date
from pathlib import Path
from typing import Any

from nodeshare.bench.machine import machine_stamp
from nodeshare.producers.batching import FlushPolicy
from nodeshare.producers.calibrated import SLOTS, CalibratedConfig, run_cluster
from nodeshare.producers.calibrated_records import RecordSink
from nodeshare.producers.job_mix import cluster_specs, library
from nodeshare.schemas import JobEvent, Record, ShutterBatch, encode
from nodeshare.schemas.catalog import JOBS_LIFECYCLE, NODE_IPC, NODE_SHUTTER, TOPIC_OF_RECORD, key_of
from nodeshare.sinks.archive import ArchivedEvent, ParquetArchive
from nodeshare.streams.core import fold_snapshot
from nodeshare.streams.core.accounting import JobAccount, Message, Origin, PricingPolicy, fold_states
from nodeshare.streams.worker.copartition import kafka_partition

#: ``bench stream`` on this machine (README, 2026-11-26): blocks per second one worker folds (the
#: CLI's default is the same figure; give your machine's).
FOLD_BLOCKS_PER_S = 188_928.0
#: ``bench audit`` on this machine (README, 2026-11-26): samples per second on one thread (1.89-2.15 M).
AUDIT_SAMPLES_PER_S = 1_890_000.0
#: ``bench ledger`` on this machine (README, 2026-11-26): shutter windows per second the ledger sink
#: counts into its co-runner table.
LEDGER_WINDOWS_PER_S = 107_481.0
CLUSTERS = (100, 1_000, 10_000)
#: Jobs held at once for the figures at scale (issue 42: "worker memory per running job at 10,000 jobs")
JOBS_AT_SCALE = 10_000
#: ``fold_evict_after_s``'s default: how long a charged account stays in memory
EVICT_AFTER_S = 300.0
#: Partitions the archive is written in (the configured default).
PARTITIONS = 4

Progress = Callable[[float, float], None]  # (simulated seconds done, total)


def simulate(nodes: int, seconds: float, seed: int, progress: Progress | None = None,
             ) -> list[tuple[float, Record]]:
    """Every record a full calibrated cluster of ``nodes`` sends in ``seconds``, with its time (s)."""
    cfg = CalibratedConfig(nodes=nodes, seed=seed)
    # jobs of 10 minutes on average, twice as many as the slots can run in the time, arriving over
    # its first half: the cluster stays full with a queue behind it
    jobs = max(4, round(2 * SLOTS * nodes * max(1.0, seconds / 600)))
    specs = cluster_specs(cfg, jobs, mean_work_s=600.0, span_s=seconds / 2)
    programs, _ = library()
    sink = RecordSink(cfg, FlushPolicy())
    out: list[tuple[float, Record]] = []

    def take(t: float) -> None:
        out.extend(((r.event_time - cfg.start).total_seconds(), r) for r in sink.drain())
        if progress:
            progress(min(t, seconds), seconds)

    run_cluster(cfg, specs, programs, sink, until_s=seconds, progress=take)
    take(seconds)
    return out


def traffic(records: list[tuple[float, Record]], since_s: float) -> dict[str, dict[str, int]]:
    """Per topic: messages, encoded value bytes and key bytes, and blocks, of the records from ``since_s``."""
    out: dict[str, dict[str, int]] = defaultdict(lambda: {"messages": 0, "value_bytes": 0, "key_bytes": 0,
                                                          "blocks": 0})
    for t, r in records:
        if t < since_s:
            continue
        row = out[TOPIC_OF_RECORD[type(r)].name]
        row["messages"] += 1
        row["value_bytes"] += len(encode(r))
        row["key_bytes"] += len(key_of(r))
        row["blocks"] += len(r.cycle) if isinstance(r, ShutterBatch) else 0
    return dict(out)


def archive_bytes(records: list[tuple[float, Record]], since_s: float, root: Path) -> dict[str, int]:
    """Bytes on disk per topic of the records from ``since_s``, archived and compacted as the sink does."""
    archive = ParquetArchive(root)
    by_topic: dict[str, list[ArchivedEvent]] = defaultdict(list)
    offsets: dict[tuple[str, int], int] = defaultdict(int)
    for t, r in records:
        if t < since_s:
            continue
        topic = TOPIC_OF_RECORD[type(r)].name
        key = key_of(r)
        partition = kafka_partition(key, PARTITIONS)
        rows = by_topic[topic]
        rows.append(ArchivedEvent(kafka_topic=topic, partition=partition, offset=offsets[(topic, partition)],
                                  timestamp_ms=round(r.event_time.timestamp() * 1000), key=key, value=encode(r)))
        offsets[(topic, partition)] += 1
    for topic, rows in by_topic.items():
        for i in range(0, len(rows), 5_000):  # written in pieces, then merged as `archive compact` merges them
            archive.write(topic, rows[i:i + 5_000])
    archive.compact()
    return {topic: sum(f.stat().st_size for f in (root / f"topic={topic}").rglob("*.parquet"))
            for topic in by_topic}


def fold_inputs(records: list[tuple[float, Record]]) -> list[tuple[Message, Record]]:
    """The records the charge fold reads (``node.ipc``, ``jobs.lifecycle``) as the messages of one
    partition, each with its record."""
    offsets: dict[str, int] = defaultdict(int)
    out = []
    for _, r in records:
        topic = TOPIC_OF_RECORD[type(r)].name
        if topic in (NODE_IPC.name, JOBS_LIFECYCLE.name):
            out.append(((Origin(topic, 0, offsets[topic]), key_of(r), encode(r), r.event_time.timestamp()), r))
            offsets[topic] += 1
    return out


@contextlib.contextmanager
def tracing() -> Iterator[Callable[[], int]]:
    """``tracemalloc`` on for the block (unless it already was); yields what reads the memory traced
    now, after a garbage collection."""
    started = not tracemalloc.is_tracing()
    if started:
        tracemalloc.start()

    def held() -> int:
        gc.collect()
        return tracemalloc.get_traced_memory()[0]

    try:
        yield held
    finally:
        if started:
            tracemalloc.stop()


def _traced(build: Callable[[], Any]) -> tuple[Any, int]:
    """What ``build`` returns and the traced memory it still holds."""
    with tracing() as held:
        before = held()
        built = build()
        return built, held() - before


def worker_state(records: list[tuple[float, Record]]) -> dict[str, float]:
    """The fold's accounts after every record: per running, charged and queued job, bytes in
    memory (live: the drop in traced memory when the accounts of that kind are let go) and JSON
    bytes (what a fold snapshot holds, before compression); running jobs per node; and per
    settled job, its index entry in memory and its message on ``accounting.settled``."""
    messages = [m for m, _ in fold_inputs(records)]
    with tracing() as held:
        accounts, _ = fold_states(messages, PricingPolicy())
        del messages
        # running: blocks arrived, no charge yet; queued: no block yet (its submitted or started event only)
        kinds = {"running": [k for k, a in accounts.items() if a.revision < 0 and a.nodes],
                 "charged": [k for k, a in accounts.items() if a.revision >= 0],
                 "queued": [k for k, a in accounts.items() if a.revision < 0 and not a.nodes]}
        out: dict[str, float] = {"accounts": len(accounts)}
        settled = [(k, accounts[k]) for k in kinds["charged"] if fold_snapshot.settled(accounts[k])]
        config = fold_snapshot.config_of(PricingPolicy())
        out["settled_record_bytes"] = round(sum(
            len(fold_snapshot.encode_settled(0, 12, config, a)) + len(fold_snapshot.settled_key(0, k, (10**9, 10**6)))
            for k, a in settled) / len(settled)) if settled else 0
        del settled  # it holds charged accounts, which are weighed by letting them go
        for kind, keys in kinds.items():
            out[f"{kind}_jobs"] = len(keys)
            out[f"{kind}_json_bytes"] = round(sum(len(accounts[k].dumps()) for k in keys) / len(keys)) if keys else 0
            before = held()
            for k in keys:
                del accounts[k]
            out[f"{kind}_memory_bytes"] = round((before - held()) / len(keys)) if keys else 0
    nodes = {r.node for _, r in records if isinstance(r, ShutterBatch)}
    out["running_jobs_per_node"] = round(out["running_jobs"] / max(1, len(nodes)), 2)
    return out


def at_scale(records: list[tuple[float, Record]], jobs: int = JOBS_AT_SCALE) -> dict[str, float]:
    """Worker memory per job with ``jobs`` accounts of one kind in memory at once: the cluster's
    running (then charged) accounts, folded once, copied (``copy.deepcopy``, each under a job id of
    its own) until there are ``jobs``; and a settled index of ``jobs`` entries, encoded as a snapshot.
    Copies, not a fold of ``jobs`` jobs' records: that would take minutes under ``tracemalloc``."""
    final, _ = fold_states([m for m, _ in fold_inputs(records)], PricingPolicy())
    out: dict[str, float] = {"jobs": jobs}
    for kind, pick in (("running", lambda a: a.revision < 0 and bool(a.nodes)),
                       ("charged", fold_snapshot.settled)):
        chosen = [a for a in final.values() if pick(a)]
        if not chosen:
            out[f"{kind}_memory_bytes"] = 0
            continue

        def copies(chosen: list[JobAccount] = chosen) -> dict[bytes, JobAccount]:
            held = {}
            for i in range(jobs):
                a = copy.deepcopy(chosen[i % len(chosen)])
                a.job_id = f"{a.job_id}.{i}"
                held[a.job_id.encode()] = a
            return held

        held, size = _traced(copies)
        out[f"{kind}_memory_bytes"] = round(size / len(held))
        del held

    def index() -> fold_snapshot.SettledIndex:
        """A partition's index as the worker holds it: 7-digit job ids (their bytes held by it alone,
        once the account left), marks of offsets past the small integers Python shares."""
        return {f"{7_000_000 + i}".encode(): fold_snapshot.pack((10**9 + i, 10**8 + 7 * i, 10**6 + i))
                for i in range(jobs)}

    held, size = _traced(index)
    out["settled_index_bytes"] = round(size / len(held), 1)
    started = time.perf_counter()  # what each index entry adds to a snapshot of its partition
    fold_snapshot.encode_snapshot(0, 12, {NODE_IPC.name: 1, JOBS_LIFECYCLE.name: 1},
                                  fold_snapshot.config_of(PricingPolicy()), {}, settled=held)
    out["snapshot_us_per_settled"] = round((time.perf_counter() - started) / len(held) * 1e6, 2)
    return out


def scale(per_node_hour: dict[str, float], state: dict[str, float], clusters: tuple[int, ...],
          fold_blocks_per_s: float, audit_samples_per_s: float, job_ends_per_node_hour: float,
          ledger_windows_per_s: float = LEDGER_WINDOWS_PER_S, evict_after_s: float = EVICT_AFTER_S,
          ) -> list[dict[str, Any]]:
    """The figures of a cluster of each size in ``clusters`` (linear in nodes). ``state`` is
    ``worker_state``'s, with ``at_scale``'s per-job memory where it has it."""
    out = []
    for n in clusters:
        blocks_per_s = per_node_hour["blocks"] * n / 3600
        running = state["running_jobs_per_node"] * n
        ends_per_day = job_ends_per_node_hour * n * 24
        out.append({
            "nodes": n,
            "messages_per_s": round(per_node_hour["messages"] * n / 3600, 1),
            "ingest_mb_per_s": round(per_node_hour["bytes"] * n / 3600 / 1e6, 3),
            "blocks_per_s": round(blocks_per_s),
            "worker_cores": round(blocks_per_s / fold_blocks_per_s, 3),
            "shutter_windows_per_s": round(per_node_hour["windows"] * n / 3600),
            # the ledger sink counts every window into its co-runner table, in one process
            "ledger_sink_load": round(per_node_hour["windows"] * n / 3600 / ledger_windows_per_s, 3),
            "archive_gb_per_day": round(per_node_hour["archive_bytes"] * n * 24 / 1e9, 2),
            "running_jobs": round(running),
            "worker_state_running_mb": round(running * state["running_memory_bytes"] / 1e6, 1),
            "running_json_mb": round(running * state["running_json_bytes"] / 1e6, 1),
            # charged accounts in memory: those charged in the last ``evict_after_s`` (bounded)
            "worker_state_charged_mb": round(
                ends_per_day / 86400 * evict_after_s * state["charged_memory_bytes"] / 1e6, 1),
            # what still grows: each settled job's index entry (memory, and every snapshot) ...
            "worker_settled_index_mb_per_day": round(ends_per_day * state["settled_index_bytes"] / 1e6, 1),
            # ... and its account on accounting.settled (the broker's disk: one per state a job left memory in)
            "settled_topic_mb_per_day": round(ends_per_day * state["settled_record_bytes"] / 1e6, 1),
            # ... and the CPU every snapshot spends on the index, for each day of it (all partitions' snapshots)
            "snapshot_s_per_day_of_index": round(ends_per_day * state["snapshot_us_per_settled"] / 1e6, 2),
            # without eviction (fold_evict_after_s = inf), every charged account stays: this much more a day
            "worker_state_charged_mb_per_day_kept": round(ends_per_day * state["charged_memory_bytes"] / 1e6, 1),
            # an audit reads the whole archive (node.ipc, jobs.lifecycle): this much per day it holds
            "audit_core_hours_per_archived_day": round(
                per_node_hour["samples"] * n * 24 / audit_samples_per_s / 3600, 2),
        })
    return out


def run_sizing_bench(nodes: int = 16, hours: float = 1.0, seed: int = 7, clusters: tuple[int, ...] = CLUSTERS,
                     fold_blocks_per_s: float = FOLD_BLOCKS_PER_S, audit_samples_per_s: float = AUDIT_SAMPLES_PER_S,
                     ledger_windows_per_s: float = LEDGER_WINDOWS_PER_S, progress: Progress | None = None,
                     jobs_at_scale: int = JOBS_AT_SCALE) -> dict[str, Any]:
    """The sizing figures of a simulated cluster of ``nodes`` over ``hours`` (the first fifth is
    warm-up, left out of the rates)."""
    seconds = hours * 3600
    records = simulate(nodes, seconds, seed, progress)
    warm = seconds / 5
    node_hours = nodes * (seconds - warm) / 3600
    flows = traffic(records, warm)
    work_dir = Path(tempfile.mkdtemp(prefix="nodeshare-sizing-"))
    try:
        stored = archive_bytes(records, warm, work_dir / "archive")
    finally:
        with contextlib.suppress(OSError):
            shutil.rmtree(work_dir)
    state = worker_state(records)
    scaled = at_scale(records, jobs_at_scale)
    # the per-job memory at 10,000 jobs is what a large cluster's worker holds; the index's too
    state |= {f"{k}_at_scale": v for k, v in scaled.items()}
    state["settled_index_bytes"] = scaled["settled_index_bytes"]
    state["snapshot_us_per_settled"] = scaled["snapshot_us_per_settled"]
    # copies allocate exactly what they hold, where the live fold's lists and dicts over-allocate as
    # they grow: the clusters take the larger of the two per-job figures
    sized = state | {f"{kind}_memory_bytes": max(scaled[f"{kind}_memory_bytes"], state[f"{kind}_memory_bytes"])
                     for kind in ("running", "charged")}
    ends = sum(1 for t, r in records if t >= warm and isinstance(r, JobEvent) and r.ran)
    per_node_hour = {
        "messages": sum(f["messages"] for f in flows.values()) / node_hours,
        "bytes": sum(f["value_bytes"] + f["key_bytes"] for f in flows.values()) / node_hours,
        "blocks": sum(f["blocks"] for f in flows.values()) / node_hours,
        "samples": 3 * sum(f["blocks"] for f in flows.values()) / node_hours,  # K = 1: before, during, after
        "archive_bytes": sum(stored.values()) / node_hours,
        "job_ends": ends / node_hours,
        "windows": flows.get(NODE_SHUTTER.name, {}).get("messages", 0) / node_hours,
    }
    warnings = [] if state["charged_jobs"] else [
        f"no job was charged in {hours} simulated hours on {nodes} nodes: the charged figures are 0; simulate longer"]
    return {
        "warnings": warnings,
        "simulated_nodes": nodes, "simulated_hours": hours, "warm_up_hours": round(warm / 3600, 3), "seed": seed,
        "per_node_hour": {k: round(v, 1) for k, v in per_node_hour.items()},
        "per_topic_per_node_hour": {
            topic: {"messages": round(f["messages"] / node_hours, 1),
                    "bytes": round((f["value_bytes"] + f["key_bytes"]) / node_hours),
                    "archive_bytes": round(stored.get(topic, 0) / node_hours)}
            for topic, f in sorted(flows.items())},
        "worker_state": state,
        "inputs": {"fold_blocks_per_s": fold_blocks_per_s, "audit_samples_per_s": audit_samples_per_s,
                   "ledger_windows_per_s": ledger_windows_per_s},
        "clusters": scale(per_node_hour, sized, clusters, fold_blocks_per_s, audit_samples_per_s,
                          per_node_hour["job_ends"], ledger_windows_per_s),
        "machine": machine_stamp(), "date": date.today().isoformat(),
    }
