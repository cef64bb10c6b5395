"""`nodeshare bench stream`: what one stream worker sustains, next to what the broker can deliver.

Two runs, each on topics and consumer groups of its own:

* **Throughput.** At least ``blocks`` shutter blocks of a calibrated cluster run (producers.calibrated)
  are published to ``node.ipc`` in the batches its agents would send at ``max_blocks =
  per_message`` (schema 3; full batches, batches closed by age, a leaving job's short last batch
  and its marker); then a raw confluent-kafka consumer
  reads the topic, once only reading and once also JSON-decoding every message (the yardsticks:
  what the broker and a client deliver on this machine), then a faust worker whose one agent only
  counts messages (faust's own ceiling: its consumer hands each message over in a task of its
  own), and then one ``nodeshare worker`` consumes it, timed through its
  ``nodeshare_shutter_blocks_total`` counter from its first block to its last. The worker does
  all its usual work per batch: the job's reducer, and a running estimate per batch, which the
  placement router forwards to the placement manager.
* **Latency.** The worker, the ledger sink and the archive sink run while jobs (batches, their
  JobLeftNode marker, then the end event) are published at a steady ``rate`` blocks per second.
  A job's latency runs from the send of its last event to the moment its charge row is durable
  in the ledger.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import threading
import time
import urllib.request
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import numpy as np
from confluent_kafka import Consumer, TopicPartition
from prometheus_client.parser import text_string_to_metric_families

from nodeshare.bench.machine import machine_stamp
from nodeshare.deploy.broker import broker_for, free_port
from nodeshare.deploy.processes import start_worker, stop_process
from nodeshare.deploy.topics import create_topics
from nodeshare.producers.batching import DEFAULT_MAX_BLOCKS, FlushPolicy
from nodeshare.producers.calibrated import CalibratedConfig, run_cluster
from nodeshare.producers.calibrated_records import RecordSink
from nodeshare.producers.job_mix import cluster_specs, library
from nodeshare.producers.kafka_producer import EventProducer
from nodeshare.runtime.config import Settings
from nodeshare.runtime.consumer import run_in_thread
from nodeshare.schemas import SCHEMA_VERSION, JobLeftNode, ShutterBatch, encode
from nodeshare.schemas.catalog import JOBS_LIFECYCLE, NODE_IPC, key_of
from nodeshare.sinks.archive import ArchiveSink
from nodeshare.sinks.ledger import LedgerSink

Progress = Callable[[str, int, int], None]  # (stage, done, total)

#: Jobs ending per second in the latency run: above the busiest hour of either real trace a site
#: hands us, scaled to 10,000 nodes (EPCC Cirrus 2024: 7,928 job ends in one hour while 440 nodes
#: were busy on average, 50/s; DOST-ASTI COARE 2020: 71 ends in its busiest hour on 24 nodes, 8/s).
JOB_ENDS_PER_S = 80.0


#: The records below are written as JSON without a model (fast), for hundreds of thousands of blocks.
_T0 = datetime(2026, 1, 1, tzinfo=UTC)
_CYC = 8_320_000  # cycles of one 3.2 ms sample on 2.6 GHz x 1 thread


def batch_json(job: str, node: str, first_cycle: int, instructions: np.ndarray, seq: int = 0) -> str:
    """A valid batch of K = 1 shutter blocks (cycles from ``first_cycle``) with these (n, 3)
    instruction counts, as JSON (fast: no model)."""
    n = len(instructions)

    def region(col: int) -> str:
        ones, cycles = ",".join(["1"] * n), ",".join([str(_CYC)] * n)
        return (f'{{"instructions":[{",".join(map(str, instructions[:, col].tolist()))}],"cycles":[{cycles}],'
                f'"threads":[{ones}]}}')

    return (
        f'{{"event_id":"{job}-{first_cycle}","schema_version":{SCHEMA_VERSION},"source":"bench","event_time":'
        f'"2026-01-01T00:00:00Z","kind":"shutter_batch","job_id":"{job}","node":"{node}","seq":{seq},'
        f'"k":1,"sample_us":3200,"counter":"simulated",'
        f'"cycle":[{",".join(map(str, range(first_cycle, first_cycle + n)))}],'
        f'"before":{region(0)},"during":{region(1)},"after":{region(2)}}}'
    )


def left_json(job: str, node: str, blocks: int) -> str:
    """The JobLeftNode marker closing a stream of ``blocks`` blocks (cycles 0..blocks-1)."""
    return (f'{{"event_id":"{job}-left","schema_version":{SCHEMA_VERSION},"source":"bench",'
            f'"event_time":"2026-01-01T01:00:00Z",'
            f'"kind":"job_left_node","job_id":"{job}","node":"{node}","blocks_sent":{blocks},'
            f'"last_cycle":{blocks - 1},"paused_us":{blocks * 3200},"alone_us":0}}')


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


@dataclass
class StreamBench:
    blocks: int
    blocks_per_message: int
    messages: int
    partitions: int
    raw_s: float
    raw_read_blocks_per_s: float  # a confluent-kafka consumer that only reads
    raw_decode_blocks_per_s: float  # ... and JSON-decodes every message: the yardstick of ratio_to_raw
    faust_count_only_blocks_per_s: float  # the same topic through a faust agent that only counts messages
    worker_s: float
    blocks_per_s: float
    ratio_to_raw: float
    offered_blocks_per_s: float  # in the latency run
    job_ends_per_s: float  # ... and the jobs ending per second in it
    achieved_blocks_per_s: float
    latency_jobs: int
    latency_p50_s: float
    latency_p99_s: float
    latency_max_s: float
    broker: str
    machine: str
    date: str


def _fresh(settings: Settings, bootstrap: str, run: str, **update: Any) -> Settings:
    tag = f"bench-{run}-{uuid.uuid4().hex[:6]}"
    return settings.model_copy(update={"bootstrap": bootstrap, "topic_prefix": f"{tag}.",
                                       "app_id": f"nodeshare-{tag}", **update})


def _job_blocks(job: str, node: str, n: int, rng: np.random.Generator, per_message: int) -> list[bytes]:
    """A job's ``n`` blocks as batches of ``per_message``."""
    instr = synthetic_instructions(n, rng)
    return [batch_json(job, node, c, instr[c:c + per_message], seq=i).encode()
            for i, c in enumerate(range(0, n, per_message))]


class _Enough(Exception):
    """Raised from the simulation's progress hook once it has made enough blocks."""


def calibrated_ipc(blocks: int, per_message: int, nodes: int = 128, seed: int = 1,
                   progress: Progress | None = None) -> list[tuple[bytes, bytes, int]]:
    """The ``node.ipc`` messages (key, JSON value, blocks it carries) of a calibrated cluster run
    (producers.calibrated: the built-in programs, K = 1, S = 3.2 ms, P = 200 ms), batched as the
    agents batch at ``max_blocks = per_message`` (full batches, batches closed by age, the short
    last batch of a job that leaves, its JobLeftNode marker), up to at least ``blocks`` blocks. No
    lifecycle events: nothing is charged, so the worker's throughput is the fold's alone."""
    cfg = CalibratedConfig(nodes=nodes, seed=seed)
    specs = cluster_specs(cfg, 8 * nodes, mean_work_s=600.0, span_s=60.0)  # a full cluster, a queue behind
    programs, _ = library()
    sink = RecordSink(cfg, FlushPolicy(max_blocks=per_message))
    out: list[tuple[bytes, bytes, int]] = []
    made = 0

    def take(_t: float) -> None:
        nonlocal made
        for r in sink.drain():
            if isinstance(r, ShutterBatch | JobLeftNode):
                n = len(r.cycle) if isinstance(r, ShutterBatch) else 0
                out.append((key_of(r), encode(r), n))
                made += n
        if progress:
            progress("simulating a calibrated cluster", min(made, blocks), blocks)
        if made >= blocks:
            raise _Enough

    with contextlib.suppress(_Enough):
        run_cluster(cfg, specs, programs, sink, progress=take)
    if made < blocks:
        raise RuntimeError(f"the calibrated run ended after {made} of {blocks} blocks; give it more nodes")
    return out


def publish_blocks(settings: Settings, blocks: int, per_message: int, progress: Progress | None = None,
                   ) -> tuple[int, int]:
    """At least ``blocks`` shutter blocks of a calibrated run on ``node.ipc``, in the agents'
    batches, keyed by job (no lifecycle: no charges); returns (messages, blocks) sent."""
    messages = calibrated_ipc(blocks, per_message, progress=progress)
    topic = settings.topic(NODE_IPC.name)
    with EventProducer(settings, client_id="nodeshare-bench") as producer:
        for i, (key, value, _) in enumerate(messages):
            producer.send_raw(topic, key, value)
            if progress and i % 1000 == 0:
                progress("publishing", i, len(messages))
    return len(messages), sum(n for _, _, n in messages)


def raw_consume(settings: Settings, topic: str, expected: int, timeout_s: float = 120.0, decode: bool = False,
                ) -> float:
    """Seconds a plain confluent-kafka consumer takes to read ``expected`` messages of ``topic``
    (``decode``: and ``json.loads`` each), from its first message to its last."""
    consumer = Consumer(settings.client_config(**{
        "group.id": f"{settings.app_id}-raw{'-decode' if decode else ''}", "enable.auto.commit": False,
        "auto.offset.reset": "earliest",
        "fetch.max.bytes": 52_428_800, "max.partition.fetch.bytes": 10_485_760}))
    parts = consumer.list_topics(topic, timeout=10).topics[topic].partitions
    consumer.assign([TopicPartition(topic, p, 0) for p in parts])
    got, first, last = 0, 0.0, 0.0
    deadline = time.monotonic() + timeout_s
    try:
        while got < expected and time.monotonic() < deadline:
            batch = consumer.consume(10_000, timeout=1.0)
            if batch and not first:
                first = time.monotonic()
            good = [v for m in batch if m.error() is None and (v := m.value())]
            if decode:
                for v in good:
                    json.loads(v)
            got += len(good)
            last = time.monotonic()
    finally:
        consumer.close()
    if got < expected:
        raise RuntimeError(f"the raw consumer read {got}/{expected} messages of {topic} in {timeout_s:.0f} s")
    return last - first


def _counter(port: int, name: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    return sum(s.value for f in text_string_to_metric_families(text) if f.name == name
               for s in f.samples if s.name == f"{name}_total")


def worker_consume(settings: Settings, workdir: Path, expected: int, timeout_s: float = 600.0,
                   progress: Progress | None = None, count_only: bool = False) -> tuple[float, float]:
    """Start one worker (``count_only``: the counting yardstick, in a consumer group of its own) on
    a topic already full; (seconds, what it counted) from its first count to its last, read from
    its metrics every 0.25 s: blocks for the worker, messages for the counting yardstick."""
    metric = "nodeshare_events_in" if count_only else "nodeshare_shutter_blocks"
    port = free_port()
    update: dict[str, Any] = {"metrics_port": port}
    if count_only:
        update["app_id"] = f"{settings.app_id}-count-only"
    worker = start_worker(settings.model_copy(update=update), workdir / "worker", workdir / "worker.log",
                          loglevel="warn", extra=("--count-only",) if count_only else ())
    try:
        deadline = time.monotonic() + timeout_s
        first_t, first_n, n = 0.0, 0.0, 0.0
        while n < expected:
            if worker.poll() is not None:
                raise RuntimeError(f"the worker exited with {worker.returncode}; see {workdir / 'worker.log'}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the worker handled {n:.0f}/{expected} blocks in {timeout_s:.0f} s")
            time.sleep(0.25)  # a scrape costs the worker time: 10 a second took ~5% of it (py-spy)
            try:
                n = _counter(port, metric)
            except OSError:
                continue  # not serving yet
            if n and not first_t:
                first_t, first_n = time.monotonic(), n
            if progress:
                progress("faust, counting only" if count_only else "worker", int(n), expected)
        return time.monotonic() - first_t, expected - first_n
    finally:
        stop_process(worker)


class TimedLedgerSink(LedgerSink):
    """The ledger sink, noting when each job's first charge row became durable."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.durable_at: dict[bytes, float] = {}

    def write(self, messages: list[Any]) -> None:
        super().write(messages)
        now = time.monotonic()
        for m in messages:
            self.durable_at.setdefault(m.key(), now)


def _latency_schedule(jobs: int, blocks_per_job: int, concurrent: int, seed: int, per_message: int = 16,
                      ) -> list[tuple[str, bytes, bytes, int, bool]]:
    """(catalog topic, key, value, blocks it carries, completes its job) in send order. ``concurrent``
    slots run jobs one after another, a batch per running job per round; slot i starts i/concurrent of
    a job's rounds after slot 0, so jobs end spread out evenly, not in bursts. A job that has sent
    its ``blocks_per_job`` blocks sends its marker and its end event, and its slot starts the next."""
    rng = np.random.default_rng(seed)
    rounds = -(-blocks_per_job // per_message)  # batches per job
    starts = [i * rounds // concurrent for i in range(concurrent)]
    out: list[tuple[str, bytes, bytes, int, bool]] = []
    running: dict[int, tuple[str, list[bytes]]] = {}  # slot -> (job, its batches not sent yet)
    begun = 0
    r = 0
    while begun < jobs or running:
        for slot in range(concurrent):
            if slot not in running and begun < jobs and r >= starts[slot]:
                job = str(3_000_000 + begun)
                running[slot] = (job, _job_blocks(job, f"n{int(job) % 97}", blocks_per_job, rng, per_message)[::-1])
                begun += 1
            if slot not in running:
                continue
            job, left = running[slot]
            size = min(per_message, blocks_per_job - (rounds - len(left)) * per_message)
            out.append((NODE_IPC.name, job.encode(), left.pop(), size, False))
            if not left:
                node = f"n{int(job) % 97}"
                out.append((NODE_IPC.name, job.encode(), left_json(job, node, blocks_per_job).encode(), 0, False))
                out.append((JOBS_LIFECYCLE.name, job.encode(), end_json(job, node).encode(), 0, True))
                del running[slot]
        r += 1
    return out


def latency_run(settings: Settings, workdir: Path, rate: float, seconds: float, job_ends: float = 80.0,
                per_message: int = 16, timeout_s: float = 300.0,
                progress: Progress | None = None) -> tuple[list[float], float]:
    """Publish jobs at ``rate`` blocks/s for ``seconds`` through a running pipeline, ``job_ends``
    of them ending per second (each job's blocks: ``rate / job_ends``); returns each job's latency
    (last event sent to charge row durable) and the block rate achieved."""
    blocks_per_job = max(1, round(rate / job_ends))
    jobs = max(1, round(job_ends * seconds))
    # a job lives concurrent * blocks_per_job / rate seconds of the run: about 5 s, so that ends flow
    # steadily after the first 5 s (real jobs live longer; that changes the state held, not the rate)
    concurrent = max(1, round(5 * job_ends))
    schedule = _latency_schedule(jobs, blocks_per_job, concurrent, seed=2, per_message=per_message)
    create_topics(settings)
    stop = threading.Event()
    ledger = TimedLedgerSink(settings, workdir / "ledger.duckdb")
    threads = [run_in_thread(ledger, stop, "ledger-sink"),
               run_in_thread(ArchiveSink(settings, workdir / "archive"), stop, "archive-sink")]
    worker = start_worker(settings, workdir / "worker", workdir / "worker.log", loglevel="warn")
    sent_at: dict[bytes, float] = {}
    try:
        with EventProducer(settings, client_id="nodeshare-bench") as producer:
            # Warm up: one job through the whole pipeline before the clock starts.
            for topic, key, value, _, _ in _latency_schedule(1, 4, 1, seed=9):
                producer.send_raw(settings.topic(topic), key, value)
            producer.flush()
            deadline = time.monotonic() + 120
            while not ledger.durable_at and time.monotonic() < deadline:
                _check_alive(worker, threads, workdir)
                time.sleep(0.1)
            t0 = time.monotonic()
            blocks = 0
            for i, (topic, key, value, size, completes) in enumerate(schedule):
                if i % 20 == 0:
                    ahead = t0 + blocks / rate - time.monotonic()
                    if ahead > 0:
                        time.sleep(ahead)
                    if progress and i % 2_000 == 0:
                        progress("publishing at a steady rate", i, len(schedule))
                producer.send_raw(settings.topic(topic), key, value)
                blocks += size
                if completes:
                    sent_at[key] = time.monotonic()
            achieved = blocks / (time.monotonic() - t0)
        deadline = time.monotonic() + timeout_s
        while sum(k in ledger.durable_at for k in sent_at) < len(sent_at):
            _check_alive(worker, threads, workdir)
            if time.monotonic() > deadline:
                raise RuntimeError(f"{sum(k in ledger.durable_at for k in sent_at)}/{len(sent_at)} charges "
                                   f"after {timeout_s:.0f} s; see {workdir / 'worker.log'}")
            if progress:
                progress("waiting for charges", sum(k in ledger.durable_at for k in sent_at), len(sent_at))
            time.sleep(0.2)
    finally:
        stop_process(worker)
        stop.set()
        for t in threads:
            t.join(30)
    return [ledger.durable_at[k] - sent_at[k] for k in sent_at], achieved


def _check_alive(worker: Any, threads: list[Any], workdir: Path) -> None:
    if worker.poll() is not None:
        raise RuntimeError(f"the worker exited with {worker.returncode}; see {workdir / 'worker.log'}")
    for t in threads:
        if t.errors:
            raise RuntimeError(f"{t.name} failed: {t.errors[0]}")


def run_stream_bench(settings: Settings, workdir: Path, blocks: int = 1_000_000, rate: float = 48_000.0,
                     seconds: float = 20.0, per_message: int = DEFAULT_MAX_BLOCKS, job_ends: float = JOB_ENDS_PER_S,
                     progress: Progress | None = None) -> StreamBench:
    work = workdir / f"stream-{uuid.uuid4().hex[:8]}"  # ledger, archive and worker logs; removed after
    work.mkdir(parents=True)
    result = _run(settings, work, blocks, rate, seconds, per_message, job_ends, progress)  # on failure, logs stay
    shutil.rmtree(work, ignore_errors=True)
    return result


def _run(settings: Settings, workdir: Path, blocks: int, rate: float, seconds: float, per_message: int,
         job_ends: float, progress: Progress | None) -> StreamBench:
    with broker_for(settings.bootstrap, workdir) as bootstrap:
        s = _fresh(settings, bootstrap, "throughput")
        create_topics(s)
        messages, blocks = publish_blocks(s, blocks, per_message, progress=progress)
        raw_s = raw_consume(s, s.topic(NODE_IPC.name), messages)
        decode_s = raw_consume(s, s.topic(NODE_IPC.name), messages, decode=True)
        floor_s, floor_n = worker_consume(s, workdir / "count-only", messages, progress=progress, count_only=True)
        worker_s, measured = worker_consume(s, workdir / "throughput", blocks, progress=progress)
        lat, achieved = latency_run(_fresh(settings, bootstrap, "latency"), workdir / "latency", rate, seconds,
                                    job_ends=job_ends, per_message=per_message, progress=progress)
    decode_per_s, per_s = blocks / decode_s, measured / worker_s
    return StreamBench(
        blocks=blocks, blocks_per_message=per_message, messages=messages, partitions=settings.partitions,
        raw_s=round(raw_s, 3), raw_read_blocks_per_s=round(blocks / raw_s),
        raw_decode_blocks_per_s=round(decode_per_s),
        faust_count_only_blocks_per_s=round(floor_n / floor_s * blocks / messages),
        worker_s=round(worker_s, 2), blocks_per_s=round(per_s),
        ratio_to_raw=round(per_s / decode_per_s, 4),
        offered_blocks_per_s=rate, job_ends_per_s=job_ends, achieved_blocks_per_s=round(achieved),
        latency_jobs=len(lat),
        latency_p50_s=round(float(np.percentile(lat, 50)), 3), latency_p99_s=round(float(np.percentile(lat, 99)), 3),
        latency_max_s=round(max(lat), 3),
        broker="configured" if settings.bootstrap else "bundled tansu",
        machine=machine_stamp(),
        date=datetime.now(UTC).date().isoformat(),
    )


def as_dict(bench: StreamBench) -> dict[str, Any]:
    return asdict(bench)
