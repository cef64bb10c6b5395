"""The worker's fold, the reference audit and the fast (DuckDB) audit agree on generated archives.

Each example is an archive of several jobs, each generated on its own: one to three nodes, blocks
with IPCs at the edges of what the paths handle (zero, just above and below the fast path's fixed
point, ordinary), bad values (no thread, no cycle), K = 1 or 2, batches at S = 3.2 and 51.2 ms in
one stream (the adaptive schedule; each job's estimator drawn, ``mixed_s`` the most often), batches
re-sent or out of order,
markers that undercount, overcount or claim more time than the job ran, copies of markers, nodes
that never close, terminal events with corrections, requeued runs and undecodable bytes. The
worker folds each job's two topics in a random interleaving; the audits read the archive.

What must hold, for every job:
* the worker never raises;
* the worker and the reference audit agree on every charge both make, and on each job's current
  revision; the worker may also have charged a revision that a correction superseded while the
  audit, reading every marker first, skipped it (never the other way round), and the audit then
  checks that row against the superseded revision it recomputes;
* the fast path prices a job only as the reference does, bit for bit ("a fast match means the
  reference agrees", by construction); it may decline any job.

``NODESHARE_DIFFERENTIAL_EXAMPLES`` sets how many archives (default 200, of 50 jobs each: 10,000
generated job histories per run of the suite).
"""

from __future__ import annotations

import json
import os
import random
import tempfile
from collections import defaultdict
from dataclasses import replace
from datetime import timedelta
from pathlib import Path

from factories import CYCLES, T0
from hypothesis import given, settings
from hypothesis import strategies as st

from nodeshare.schemas import Charge, JobEvent, JobLeftNode, JobState, ShutterBatch, encode
from nodeshare.schemas.events import CounterSource
from nodeshare.schemas.serde import decode_model
from nodeshare.sinks.archive import ArchivedEvent, ParquetArchive
from nodeshare.sinks.audit import archived_messages, recompute
from nodeshare.sinks.fast_audit import fast_recompute
from nodeshare.streams.core.accounting import Origin, PricingPolicy, apply_message
from nodeshare.streams.core.degradation import ESTIMATORS, MIXED_S

EXAMPLES = int(os.environ.get("NODESHARE_DIFFERENTIAL_EXAMPLES", "200"))
JOBS = 50
POLICY = PricingPolicy(rate_per_core_hour=1.5)
IPC, LIFE = "node.ipc", "jobs.lifecycle"
BROKER = T0 + timedelta(hours=12)  # every message's broker timestamp

def _block(rnd: random.Random, k: int, hostile: bool, edge: bool, lift: float | None = None
           ) -> tuple[tuple[list[int], ...], ...]:
    """A block's three regions of K samples (instructions, cycles, threads). Mostly what a shutter
    measures (before and after near one IPC, during above it: Alg. 4 accepts it); in a hostile job
    also any IPC, zero counts and no thread. An ``edge`` block sits at the fast path's fixed-point
    edge: an IPC of one instruction in 2**30 cycles is 2**-30, in 2**30 - 5000 cycles just above
    it, and half of that is below the edge and no multiple of 2**-82."""
    if edge:
        cycles = [rnd.choice([2**30, 2**30 - 5000])] * k
        return tuple(([rnd.choice(counts) for _ in range(k)], cycles, [1] * k)
                     for counts in ([0, 1], [2, 3], [0, 1]))
    base, drawn = rnd.uniform(0.3, 2.0), rnd.uniform(0.0, 0.6)
    lift = drawn if lift is None else lift * rnd.uniform(0.9, 1.1)
    out = []
    for ipc in (base + rnd.uniform(-0.03, 0.03), base * (1 + lift), base + rnd.uniform(-0.03, 0.03)):
        if hostile and rnd.random() < 0.2:
            ipc = rnd.choice([0.0, rnd.uniform(0.0, 3.0)])
        threads = [rnd.choice([1, 1, 1, 4, 0]) if hostile else 1 for _ in range(k)]
        out.append(([round(max(0.0, ipc + rnd.uniform(-0.01, 0.01)) * CYCLES) for _ in range(k)], [CYCLES] * k,
                    threads))
    return tuple(out)


def job_history(rnd: random.Random, job: str) -> tuple[list[bytes], list[bytes]]:
    """One job's node.ipc values (each node's in its order, nodes interleaved) and lifecycle values.
    Plain ``random`` draws from a seed hypothesis gives: hypothesis's own draws are too slow for
    10,000 histories a run, and a failure still names its seed."""
    hostile = rnd.random() < 0.4  # else only what valid input does: requeues, corrections, idle blocks
    p = 1.0 if hostile else 0.0  # the odds of each hostile event scale by this
    nodes = rnd.sample(["n1", "n2", "n3", "n4"], rnd.randint(1, 3))
    k = rnd.choice([1, 1, 1, 2])
    edge = rnd.random() < 0.1  # the job's blocks sit at the fast path's fixed-point edge
    runs = rnd.choice([1, 1, 1, 1, 2])  # a requeued job runs twice under its id
    # Under the adaptive schedule (issue 36) a node's batches come at S = 3.2 ms and 51.2 ms, and the
    # short S may read D low (its window ends before the cache refilled): the fold keeps sums per S.
    mixed = rnd.random() < 0.5
    lift = {51200: rnd.uniform(0.05, 0.6)}
    lift[3200] = lift[51200] * rnd.choice([1.0, 0.9, 0.5, 0.2])
    per_node: dict[str, list[bytes]] = {n: [] for n in nodes}
    life: list[bytes] = []
    cycle = 0
    for run in range(runs):
        start, end = T0 + timedelta(hours=3 * run), T0 + timedelta(hours=3 * run + 1)
        for node in nodes:
            values = per_node[node]
            blocks = []
            for _ in range(rnd.randint(0, 14 if mixed else 6)):
                cycle += rnd.choice([1, 1, 1, 2])
                blocks.append((cycle, *_block(rnd, k, hostile, edge and rnd.random() < 0.8)))
            sample_us = [rnd.choice([3200, 51200]) if mixed else 3200 for _ in range(2)]
            if mixed:  # each batch's blocks measured at its S
                cut_at = rnd.randint(0, len(blocks))
                blocks = [(c, *_block(rnd, k, hostile, edge and rnd.random() < 0.8,
                                      lift[sample_us[0] if i < cut_at else sample_us[1]]))
                          for i, (c, *_) in enumerate(blocks)]
            if rnd.random() < 0.12 * p and len(blocks) > 1:  # out of order
                blocks[0], blocks[1] = blocks[1], blocks[0]
            cut = cut_at if mixed else rnd.randint(0, len(blocks))
            batches = [(b, s_us) for b, s_us in zip((blocks[:cut], blocks[cut:]), sample_us, strict=True) if b]
            for i, (bs, s_us) in enumerate(batches):
                values.append(encode(_batch(job, node, k, bs, start + timedelta(seconds=i + 1), s_us)))
            if batches and rnd.random() < 0.12 * p:  # a batch re-sent
                values.append(values[-1])
            if rnd.random() < 0.08 * p:  # bytes nobody can read
                values.append(b'{"kind": "shutter_batch", "job_id": "' + job.encode() + b'"')
            if rnd.random() < 0.1 * p:  # the node never closes this run's stream
                continue
            run_us = 3600 * 10**6
            marker = JobLeftNode(
                event_id=f"{node}/left/{job}", source="t", event_time=end, job_id=job, node=node,
                blocks_sent=max(0, len(blocks) + (rnd.choice([0, 0, 0, 0, 1, 5, -1]) if hostile else 0)),
                last_cycle=max((b[0] for b in blocks), default=-1),
                paused_us=rnd.choice([0, 1000, 20_000_000, *([run_us, 10**12] if hostile else [])]),
                alone_us=rnd.choice([0, 0, run_us // 2, *([run_us, 2 * run_us] if hostile else [])]))
            values.append(encode(marker))
            if rnd.random() < 0.1 * p:  # a copy of the marker
                values.append(values[-1])
        listed = list(nodes)
        if rnd.random() < 0.1 * p:  # the resource manager names a node that never reports
            listed.append("n9")
        state = JobState.CANCELLED if run < runs - 1 else rnd.choice([JobState.ENDED, JobState.FAILED])
        life.append(encode(_end(job, f"end{run}", state, tuple(listed), start, end)))
        if rnd.random() < 0.17:  # a correction: the wrong node dropped, or a shorter run
            life.append(encode(_end(job, f"fix{run}", state, tuple(nodes), start, end - timedelta(minutes=20))))
    ipc: list[bytes] = []
    queues = [list(v) for v in per_node.values() if v]
    while queues:  # each node's values keep their order; the nodes' streams interleave
        q = rnd.choice(queues)
        ipc.append(q.pop(0))
        queues = [q for q in queues if q]
    return ipc, life


def _batch(job: str, node: str, k: int, blocks: list, at, sample_us: int = 3200) -> ShutterBatch:
    cols = {r: {f: tuple(x for b in blocks for x in b[1 + i][j]) for j, f in enumerate(("instructions", "cycles",
                                                                                      "threads"))}
            for i, r in enumerate(("before", "during", "after"))}
    return ShutterBatch.model_validate({
        "event_id": f"b-{job}-{node}-{blocks[0][0]}", "source": "t", "event_time": at, "job_id": job, "node": node,
        "seq": 0, "k": k, "sample_us": sample_us, "counter": CounterSource.SIMULATED,
        "cycle": tuple(b[0] for b in blocks), **cols})


def _end(job: str, eid: str, state: JobState, nodes: tuple[str, ...], start, end) -> JobEvent:
    return JobEvent(event_id=eid, source="t", event_time=end, job_id=job, state=state, user="u", account="a",
                    program="p", cores=8, nodes=nodes, start_time=start, end_time=end)


def _worker(ipc: list[tuple[int, bytes]], life: list[tuple[int, bytes]], key: bytes, rnd: random.Random,
            policy: PricingPolicy = POLICY) -> dict[tuple[str, int], Charge]:
    """The worker's fold of one job, its two topics interleaved at random (each in its own order)."""
    labels = [IPC] * len(ipc) + [LIFE] * len(life)
    rnd.shuffle(labels)  # a random merge that keeps each topic's own order
    queues = {IPC: iter(ipc), LIFE: iter(life)}
    merged = [(topic, *next(queues[topic])) for topic in labels]
    account, out = None, {}
    for topic, offset, value in merged:
        new, produced, _ = apply_message(account, Origin(topic, 0, offset), key, value, BROKER.timestamp(), policy)
        account = new if new is not None else account
        for o in produced:
            if o.topic == "ledger.charges":
                c = decode_model(Charge, o.value)
                out.setdefault((c.job_id, c.revision), c)
    return out


@settings(max_examples=EXAMPLES, deadline=None, derandomize=True)
@given(st.integers(0, 2**64))
def test_the_worker_and_both_audits_agree(seed):
    rnd = random.Random(seed)
    histories = [job_history(rnd, f"j{i}") for i in range(JOBS)]
    # each job's estimator (the audits take it from the job's ledger row), mixed_s the most often
    policies = {f"j{i}": replace(POLICY, estimator=rnd.choice([*ESTIMATORS, MIXED_S, MIXED_S])) for i in range(JOBS)}
    rows: dict[str, list[ArchivedEvent]] = defaultdict(list)
    per_job: dict[str, tuple[list, list]] = {}
    offsets = {IPC: 0, LIFE: 0}
    for i, (ipc, life) in enumerate(histories):
        job, key = f"j{i}", f"j{i}".encode()
        placed: dict[str, list[tuple[int, bytes]]] = {IPC: [], LIFE: []}
        for topic, values in ((IPC, ipc), (LIFE, life)):
            for v in values:
                rows[topic].append(ArchivedEvent(topic, 0, offsets[topic], round(BROKER.timestamp() * 1000), key, v))
                placed[topic].append((offsets[topic], v))
                offsets[topic] += 1
        per_job[job] = (placed[IPC], placed[LIFE])
    with tempfile.TemporaryDirectory() as tmp:
        archive = ParquetArchive(Path(tmp) / "archive")
        for topic, evs in rows.items():
            archive.write(topic, evs)
        superseded: dict = {}
        reference = recompute(archived_messages(ParquetArchive(archive.location)), policies, POLICY, superseded)
        fast = fast_recompute(archive.location, policies, POLICY)
    for job, (ipc, life) in per_job.items():
        worker = _worker(ipc, life, job.encode(), rnd, policies[job])
        ref = {k: c for k, c in reference.items() if k[0] == job}
        for key in worker.keys() & ref.keys():
            assert worker[key] == ref[key], (key, _explain(worker[key], ref[key]))
        assert max(worker, default=None) == max(ref, default=None), (job, sorted(worker), sorted(ref))
        assert ref.keys() <= worker.keys(), (job, sorted(worker), sorted(ref))
        for key in worker.keys() - ref.keys():  # charged before a correction superseded it: the audit checks it
            assert worker[key] == superseded[key], (key, _explain(worker[key], superseded[key]))
    for key, charge in fast.charges.items():
        assert charge == reference[key], (key, _explain(charge, reference[key]))


def _explain(a: Charge, b: Charge) -> dict:
    da, db = json.loads(encode(a)), json.loads(encode(b))
    return {f: (da[f], db.get(f)) for f in da if da[f] != db.get(f)}
