"""Schema 3: shutter blocks travel in columnar batches (streams.core.blocks, streams.core.accounting).

A charge is a function of the *set* of blocks: however an agent cuts a stream into batches, and
whatever it re-sends after a crash, the same blocks give the same bits. A bad block is refused
with its index and reason while the rest of its batch counts.
"""

from __future__ import annotations

import base64
import itertools
import json
import math
import random
from datetime import UTC, datetime, timedelta

import numpy as np
import pytest
from factories import POLICY, batch, block, job_event, left
from hypothesis import given, settings
from hypothesis import strategies as st

from nodeshare.producers.batching import Batcher, FlushPolicy
from nodeshare.schemas import DeadLetter, JobState, ShutterBatch, decode, decode_model, encode
from nodeshare.schemas.catalog import NODE_IPC
from nodeshare.schemas.serde import DecodeError
from nodeshare.streams.core.accounting import Origin, apply_message, fold_messages
from nodeshare.streams.core.blocks import block_rows, counted_after, prior_max
from nodeshare.streams.core.degradation import ExactSum, add_rows, filtered_degradation

IPC = "node.ipc"


def stream(n: int, seed: int, job: str = "j1") -> list:
    """n blocks of one job on node n1 with varied IPCs (some pass Alg. 4, some do not)."""
    rng = random.Random(seed)
    out = []
    for c in range(n):
        b = round(rng.uniform(0.5, 1.5), 6)
        out.append(block(b, round(b + rng.uniform(-0.05, 0.4), 6), round(b + rng.uniform(-0.08, 0.08), 6),
                         job=job, cycle=3 * c + rng.randrange(3)))
    return out


def charge_of(batches: list, job: str = "j1", sent: int | None = None) -> object:
    blocks = sum(b.blocks for b in batches)
    msgs = [(Origin(IPC, 0, i), job.encode(), encode(b), 0.0) for i, b in enumerate(batches)]
    last = max(max(b.cycle) for b in batches)
    msgs.append((Origin(IPC, 0, len(batches)), job.encode(), encode(left(job, "n1", sent or blocks, last)), 0.0))
    msgs.append((Origin("jobs.lifecycle", 0, 0), job.encode(), encode(job_event(job, JobState.ENDED)), 0.0))
    [charge] = fold_messages(msgs, POLICY)
    return charge


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 60), seed=st.integers(0, 10_000), cuts=st.lists(st.integers(1, 59), max_size=8))
def test_any_batching_of_the_same_blocks_gives_the_same_charge_bits(n: int, seed: int, cuts: list[int]) -> None:
    blocks = stream(n, seed)
    edges = sorted({0, n, *(c for c in cuts if c < n)})
    batched = [batch(*blocks[a:b], seq=i) for i, (a, b) in enumerate(itertools.pairwise(edges))]
    one_by_one = [batch(b, seq=i) for i, b in enumerate(blocks)]
    whole, split, single = charge_of([batch(*blocks)]), charge_of(batched), charge_of(one_by_one)
    fields = {"event_range"}  # the offsets differ with the number of messages, nothing else may
    assert whole.model_dump(exclude=fields) == split.model_dump(exclude=fields) == single.model_dump(exclude=fields)
    # ... and the estimate is Alg. 4 block by block, as the reference accumulator computes it (the point
    # estimate: a stream of rejected blocks has none, and is priced at the prior's bound)
    ref = filtered_degradation(blocks, POLICY.delta, whole.estimator)
    assert (whole.degradation_point, whole.blocks_used, whole.blocks_rejected) == (
        ref.degradation, ref.blocks_used, ref.blocks_rejected)


def test_a_bad_block_is_refused_with_its_index_and_the_rest_of_the_batch_counts() -> None:
    good = stream(5, 1)
    raw = json.loads(encode(batch(*good)))
    raw["during"]["cycles"][2] = 0  # block 2: a zero cycle count
    raw["before"]["threads"][4] = 0  # block 4: no thread
    value = json.dumps(raw).encode()
    account, out, counts = apply_message(None, Origin(IPC, 0, 7), b"j1", value, 0.0, POLICY)
    [dl] = [decode_model(DeadLetter, o.value) for o in out if o.topic == "dlq"]
    assert [(r.index, r.field, r.reason) for r in dl.rows] == [(2, "during.cycles", "must be > 0"),
                                                             (4, "before.threads", "must be > 0")]
    assert dl.reason.startswith("2 of 5 blocks refused (the others counted); block 2: during.cycles")
    assert (dl.origin_topic, dl.origin_offset) == (IPC, 7) and base64.b64decode(dl.value_b64) == value
    assert account is not None and account.nodes["n1"].blocks == 3 and counts is not None
    assert counts.accepted + counts.rejected == 3 and counts.refused == 2
    # the three good blocks count exactly as they would alone
    assert account.degradation().blocks_used == filtered_degradation([good[i] for i in (0, 1, 3)]).blocks_used


def test_a_batch_of_the_wrong_shape_is_refused_whole() -> None:
    raw = json.loads(encode(batch(*stream(3, 2))))
    raw["after"]["instructions"] = raw["after"]["instructions"][:-1]
    with pytest.raises(DecodeError, match=r"after\.instructions: expected 3 blocks x k=1 = 3 samples, got 2"):
        decode(NODE_IPC, json.dumps(raw).encode())
    _, out, _ = apply_message(None, Origin(IPC, 0, 0), b"j1", json.dumps(raw).encode(), 0.0, POLICY)
    assert [o.kind for o in out] == ["decode"]


def test_an_agent_that_resends_overlapping_cycles_in_other_batches_counts_each_cycle_once() -> None:
    """After a crash the agent re-sends from its spool, cut differently: cycles already counted are
    refused as out of order (their indexes named), the new ones count, the charge is unchanged."""
    blocks = stream(12, 3)
    first = [batch(*blocks[:5], seq=0), batch(*blocks[5:8], seq=1)]
    again = [batch(*blocks[3:10], seq=0), batch(*blocks[9:], seq=1)]  # overlaps 3..7 and block 9
    msgs = [(Origin(IPC, 0, i), b"j1", encode(b), 0.0) for i, b in enumerate(first + again)]
    account = None
    refused = []
    for m in msgs:
        account, out, _ = apply_message(account, *m, POLICY)
        refused += [[r.index for r in decode_model(DeadLetter, o.value).rows] for o in out if o.topic == "dlq"]
    assert refused == [[0, 1, 2, 3, 4], [0]]
    assert account is not None and account.nodes["n1"].blocks == 12 and account.nodes["n1"].ignored == 6
    assert charge_of(first + again, sent=12).model_dump(exclude={"event_range", "blocks_ignored"}) == \
        charge_of([batch(*blocks)]).model_dump(exclude={"event_range", "blocks_ignored"})


def test_counted_after_keeps_only_cycles_above_everything_before_them() -> None:
    cycle = np.array([4, 5, 5, 3, 9, 7, 10])
    valid = np.array([True, True, True, True, False, True, True])
    assert counted_after(cycle, valid, 3).tolist() == [True, True, False, False, False, True, True]
    assert counted_after(cycle, valid, 8).tolist() == [False, False, False, False, False, False, True]
    # what a refused block is said to come after: the last counted cycle, never a bad block's cycle
    assert prior_max(cycle, valid, 3).tolist() == [3, 4, 5, 5, 5, 5, 7]


def test_block_means_for_k_2_and_3_are_fsum_over_k() -> None:
    b = block((1.0, 0.7), (1.2, 1.1), (0.9, 0.8))
    rows = block_rows(batch(b, b.model_copy(update={"cycle": 1})))
    assert rows.before.tolist() == [math.fsum([1.0, 0.7]) / 2] * 2
    three = block_rows(block((0.1, 0.2, 0.3), (1.0, 1.0, 1.1), (0.1, 0.2, 0.31)))
    assert three.before[0] == math.fsum([0.1, 0.2, 0.3]) / 3 and three.after[0] == math.fsum([0.1, 0.2, 0.31]) / 3


@settings(max_examples=60, deadline=None)
@given(st.lists(st.one_of(st.floats(0, 1e4), st.floats(0, 1e-12), st.just(0.0), st.floats(1e9, 1e12)),
                max_size=80))
def test_bulk_exact_sums_equal_fsum_in_any_split(values: list[float]) -> None:
    """add_many is exact: its value is math.fsum of everything added, in however many arrays."""
    one, split = ExactSum(), ExactSum()
    one.add_many(np.array(values, dtype=np.float64))
    for i in range(0, len(values), 7):
        split.add_many(np.array(values[i:i + 7], dtype=np.float64))
    assert one.value == split.value == math.fsum(values)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(-1e12, 1e12), min_size=3 * 5, max_size=3 * 5))
def test_rows_summed_at_once_equal_fsum_of_each_target(values: list[float]) -> None:
    """add_rows: one pass over a matrix, two rows may name the same sum (negative and huge values
    go one by one); each sum's value is math.fsum of exactly its rows."""
    a, b = ExactSum(), ExactSum()
    matrix = np.array(values, dtype=np.float64).reshape(3, 5)
    add_rows([a, b, a], matrix)
    assert a.value == math.fsum(values[:5] + values[10:]) and b.value == math.fsum(values[5:10])


def test_a_count_beyond_float64_exactness_is_refused_per_block() -> None:
    raw = json.loads(encode(batch(*stream(3, 4))))
    raw["during"]["instructions"][1] = 2**63 + 5  # beyond int64 too
    rec = decode(NODE_IPC, json.dumps(raw).encode())
    assert isinstance(rec, ShutterBatch)
    rows = block_rows(rec)
    assert rows.valid.tolist() == [True, False, True]
    assert [(p.index, p.field, p.reason) for p in rows.problems] == [(1, "during.instructions", "must be below 2**53")]


def test_the_batcher_flushes_by_count_bytes_age_shape_and_leave() -> None:
    t0 = datetime(2026, 1, 1, tzinfo=UTC)

    def add(b: Batcher, cycle: int, s: float, job: str = "a", k: int = 1, v: int = 1000) -> list[ShutterBatch]:
        samples = [(v, 2000, 1)] * k
        return b.add(job_id=job, node="n1", source="t", cycle=cycle, k=k, sample_us=3200, counter="simulated",
                     before=samples, during=samples, after=samples, at=t0 + timedelta(seconds=s))

    b = Batcher(FlushPolicy(max_blocks=3, max_age_s=10))
    assert add(b, 0, 0) == [] and add(b, 1, 1) == []
    full = add(b, 2, 2)  # the third block fills it
    assert [x.cycle for x in full] == [(0, 1, 2)] and full[0].seq == 0
    assert full[0].event_time == t0 + timedelta(seconds=2)  # its newest block's time
    add(b, 3, 3)
    add(b, 4, 4, job="b")
    assert b.due(t0 + timedelta(seconds=12.9)) == []  # a's open batch is 9.9 s old
    assert [(x.job_id, x.cycle, x.seq) for x in b.due(t0 + timedelta(seconds=13))] == [("a", (3,), 1)]
    assert [x.cycle for x in add(b, 5, 5, job="b", k=2)] == [(4,)]  # another K: b's batch closes first
    left = b.close("b", "n1")
    assert left is not None and left.cycle == (5,) and left.k == 2 and b.close("b", "n1") is None
    assert [x.seq for x in add(b, 6, 6, job="b")] == [] and b.open[("b", "n1")].seq == 0  # a new stream
    # the byte bound: counts of 18 digits fill about 1 KiB in a few blocks
    small = Batcher(FlushPolicy(max_blocks=4096, max_bytes=1024))
    sizes = [len(x.cycle) for c in range(100) for x in add(small, c, c, v=10**17)]
    assert sizes and max(sizes) < 20
    # what the agent keeps in its spool's meta comes back whole
    again = Batcher(FlushPolicy(max_blocks=3, max_age_s=10))
    again.restore(json.loads(json.dumps(b.state())))
    assert again.flush_all() == b.flush_all()
