"""The stream bench's workload: valid records that complete every job exactly once."""

from __future__ import annotations

import numpy as np

from nodeshare.bench.stream import _latency_schedule, calibrated_ipc
from nodeshare.schemas import ShutterBatch, decode
from nodeshare.schemas.catalog import JOBS_LIFECYCLE, NODE_IPC
from nodeshare.streams.core.accounting import Origin, PricingPolicy, fold_messages


def test_latency_schedule_is_valid_input_that_prices_every_job_once() -> None:
    schedule = _latency_schedule(jobs=7, blocks_per_job=5, concurrent=3, seed=1, per_message=2)
    assert len(schedule) == 7 * (3 + 2)  # batches of 2, 2 and 1 blocks, the marker, the end
    assert sum(completes for *_, completes in schedule) == 7 and sum(s[3] for s in schedule) == 7 * 5
    offsets = {NODE_IPC.name: -1, JOBS_LIFECYCLE.name: -1}
    messages = []
    for topic, key, value, _, _ in schedule:
        offsets[topic] += 1
        messages.append((Origin(topic, 0, offsets[topic]), key, value, 1.8e9))
    charges = fold_messages(messages, PricingPolicy())
    assert sorted(c.job_id for c in charges) == sorted({k.decode() for _, k, *_ in schedule})
    assert all(c.blocks_used + c.blocks_rejected == 5 and c.run_time_s == 3600 for c in charges)
    # each job's completing event is its last one
    last = {}
    for i, (_, key, _, _, completes) in enumerate(schedule):
        last[key] = (i, completes)
    assert all(completes for _, completes in last.values())


def test_the_throughput_input_is_a_calibrated_run_in_the_agents_batches() -> None:
    messages = calibrated_ipc(600, per_message=8, nodes=4)
    records = [decode(NODE_IPC, value) for _, value, _ in messages]
    batches = [r for r in records if isinstance(r, ShutterBatch)]
    assert sum(n for *_, n in messages) == sum(len(b.cycle) for b in batches) >= 600
    assert max(len(b.cycle) for b in batches) == 8 and len({r.node for r in batches}) == 4
    assert all(key == r.job_id.encode() for (key, _, _), r in zip(messages, records, strict=True))
    # calibrated IPC: a job's blocks differ (noise, phases), unlike a constant synthetic stream
    assert len({b.during.instructions for b in batches}) == len(batches)


def test_latency_schedule_spreads_job_ends_out() -> None:
    schedule = _latency_schedule(jobs=60, blocks_per_job=64, concurrent=10, seed=1, per_message=8)
    sent, ends = 0, []
    for *_, size, completes in schedule:
        sent += size
        if completes:
            ends.append(sent)
    gaps = np.diff(ends[10:-10])  # between the first slot's first end and the last slots' drain
    assert len(ends) == 60 and gaps.max() <= 2 * 64 * 8 / 10  # about a job's blocks / slots apart, no bursts
