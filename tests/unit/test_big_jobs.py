"""Capability-sized jobs (issue 44, item 4): a job's markers fold in work linear in its nodes, and
its charge stays far below a broker's 1,000,000-byte message limit whatever its size.

No timing here (the project has no timed unit tests): the fold's work is counted instead, as calls
that visit one node's stream."""

from __future__ import annotations

import hashlib
import json
from collections import Counter

import pytest
from factories import batch, block, job_event, left

from nodeshare.schemas import Charge, JobState, decode_model, encode
from nodeshare.schemas.events import MAX_CHARGE_NODES, MAX_CHARGE_PROBLEMS
from nodeshare.sinks.audit import diff_charges
from nodeshare.streams.core.accounting import (
    JobAccount,
    MomentState,
    NodeStream,
    Origin,
    PricingPolicy,
    apply_message,
    fold_states,
    node_blocks,
)

POLICY = PricingPolicy()
IPC, LIFE = "node.ipc", "jobs.lifecycle"
KAFKA_MESSAGE_LIMIT = 1_000_000  # librdkafka's default message.max.bytes


def nodes_of(n: int) -> tuple[str, ...]:
    return tuple(f"nid{i:06d}" for i in range(n))


def big_job(n: int, *, end_first: bool = True, blocks_on: int = 0, blocks_sent: int = 0,
            paused: dict[str, int] | None = None) -> list[tuple]:
    """Messages of job J on n nodes: its end event (first or last), a batch of two blocks on each of the
    first ``blocks_on`` nodes, and every node's marker, in node order (the order that made each marker
    walk every node before it)."""
    nodes = nodes_of(n)
    ipc = [batch(block(1.0, 1.3, 1.01, job="J", node=nd, cycle=0), block(0.9, 1.2, 0.92, job="J", node=nd, cycle=1))
           for nd in nodes[:blocks_on]]
    markers = []
    for nd in nodes:
        m = left("J", nd, 2 if nd in nodes[:blocks_on] else blocks_sent, 1 if nd in nodes[:blocks_on] else -1)
        markers.append(m.model_copy(update={"paused_us": (paused or {}).get(nd, 0)}))
    ipc_msgs = [(Origin(IPC, 0, i), b"J", encode(r), 1.79e9) for i, r in enumerate([*ipc, *markers])]
    end = (Origin(LIFE, 0, 0), b"J", encode(job_event("J", JobState.ENDED, nodes=nodes)), 1.79e9)
    return [end, *ipc_msgs] if end_first else [*ipc_msgs, end]


def the_charge(messages: list[tuple]) -> tuple[JobAccount, Charge]:
    accounts, out = fold_states(messages, POLICY)
    [charge] = [decode_model(Charge, o.value) for o in out]
    return accounts[b"J"], charge


def counted_work(monkeypatch: pytest.MonkeyPatch, messages: list[tuple]) -> int:
    """Calls that visit one node's stream (its runs, its sums, its IPC moments) while folding."""
    calls: Counter[str] = Counter()
    for cls, name in ((JobAccount, "_runs_of"), (NodeStream, "sums"), (MomentState, "moments")):
        original = getattr(cls, name)

        def counting(*args, _original=original, _name=name, **kwargs):
            calls[_name] += 1
            return _original(*args, **kwargs)
        monkeypatch.setattr(cls, name, counting)
    account = None
    for m in messages:  # the stream worker's step: running estimates are its timer's
        account, _, _ = apply_message(account, *m, POLICY, running_estimates=False)
    monkeypatch.undo()
    return sum(calls.values())


@pytest.mark.parametrize("end_first", [True, False])
def test_a_jobs_markers_fold_in_work_linear_in_its_nodes(monkeypatch, end_first):
    """Ten times the nodes, about ten times the work, not a hundred. (Mutation: a marker that builds
    an estimate over every node, or readiness that walks the terminal event's nodes per marker, fails.)"""
    small = counted_work(monkeypatch, big_job(100, end_first=end_first, blocks_on=100))
    large = counted_work(monkeypatch, big_job(1000, end_first=end_first, blocks_on=1000))
    assert large < 13 * small, (small, large)


def test_a_marker_that_completes_no_charge_publishes_no_estimate_over_the_job():
    """The worker's timer publishes running estimates; the final one comes with the charge."""
    account, published = None, []
    for m in big_job(50, blocks_on=3):
        account, out, _ = apply_message(account, *m, POLICY, running_estimates=False)
        published += [o.topic for o in out]
    assert published == ["estimates.degradation", "ledger.charges"]


def test_a_10000_node_charge_encodes_far_below_the_message_limit_and_its_digest_covers_every_node():
    n = 10_000
    account, charge = the_charge(big_job(n, blocks_on=20, blocks_sent=3))
    size = len(encode(charge))
    assert size < KAFKA_MESSAGE_LIMIT // 10, size
    assert charge.nodes == () and charge.node_summary is not None and charge.node_summary.count == n
    assert charge.node_summary.blocks == 40 == charge.blocks_used + charge.blocks_rejected
    assert charge.node_summary.blocks_sent == 40 + 3 * (n - 20)
    # every node but the 20 with blocks missed 3: one problem each, kept to a bounded list and a count
    assert len(charge.evidence_problems) == MAX_CHARGE_PROBLEMS + 1
    assert charge.evidence_problems[-1].startswith(f"... and {n - 20 - MAX_CHARGE_PROBLEMS} more")
    # the detail is the archive's fold: its JSON, as `nodes` would have held it, is what the digest hashes
    detail = node_blocks(account.streams_for(0))
    listed = json.dumps([d.model_dump(mode="json") for d in detail], separators=(",", ":")).encode()
    assert len(detail) == n and hashlib.sha256(listed).hexdigest() == charge.node_summary.sha256


def test_a_job_up_to_the_bound_lists_every_node_as_before():
    _, charge = the_charge(big_job(MAX_CHARGE_NODES, blocks_on=2))
    assert charge.node_summary is None and [b.node for b in charge.nodes] == list(nodes_of(MAX_CHARGE_NODES))
    assert b'"node_summary":null' in encode(charge)


def test_the_audit_finds_one_nodes_numbers_moved_to_another_in_a_capability_job():
    """Same totals, different nodes: only the digest differs, and diff_charges reports it."""
    n = MAX_CHARGE_NODES + 1
    _, honest = the_charge(big_job(n, paused={"nid000007": 2_000_000}))
    _, moved = the_charge(big_job(n, paused={"nid000900": 2_000_000}))
    assert honest.node_summary is not None and moved.node_summary is not None
    assert honest.node_summary.paused_s == moved.node_summary.paused_s == 2.0 and honest.price == moved.price
    assert [m.field for m in diff_charges(honest, moved)] == ["node_summary"]


def test_the_readiness_cache_is_not_state_and_a_restored_account_charges_the_same():
    messages = big_job(1500, blocks_on=5)
    _, whole = the_charge(messages)
    account = None
    for m in messages[:700]:
        account, _, _ = apply_message(account, *m, POLICY)
    assert account is not None and account._open.by_revision  # the cache is in use ...
    raw = account.dumps()
    assert b"_open" not in raw and JobAccount.loads(raw, "J") == account  # ... and neither persisted nor compared
    restored, charges = JobAccount.loads(raw, "J"), []
    for m in messages[700:]:
        restored, out, _ = apply_message(restored, *m, POLICY)
        charges += [decode_model(Charge, o.value) for o in out if o.topic == "ledger.charges"]
    assert charges == [whole]


def test_a_requeued_job_charges_each_run_from_its_own_streams():
    """streams_for's k-th stream rule, kept: run 2 waits for each node's second marker."""
    first = job_event("R", JobState.FAILED, nodes=("a", "b"))
    assert first.start_time is not None and first.end_time is not None
    again = first.end_time + (first.end_time - first.start_time)
    second = job_event("R", JobState.ENDED, nodes=("b", "c")).model_copy(
        update={"event_id": "run2", "start_time": first.end_time, "end_time": again, "event_time": again})
    m1 = [left("R", n, 0, -1) for n in ("a", "b")]
    m2 = [left("R", n, 0, -1, at_s=7200).model_copy(update={"event_id": f"left2-{n}"}) for n in ("b", "c")]
    records = [(LIFE, first), (IPC, m1[0]), (LIFE, second), (IPC, m2[1]), (IPC, m1[1])]
    account, charged = None, []
    for i, (topic, r) in enumerate(records):
        account, out, _ = apply_message(account, Origin(topic, 0, i), b"R", encode(r), 1.79e9, POLICY)
        charged += [decode_model(Charge, o.value).revision for o in out if o.topic == "ledger.charges"]
    assert charged == [0]  # run 1 closed; run 2's b is still open (b's first stream is run 1's)
    account, out, _ = apply_message(account, Origin(IPC, 0, 9), b"R", encode(m2[0]), 1.79e9, POLICY)
    assert [decode_model(Charge, o.value).revision for o in out if o.topic == "ledger.charges"] == [1]
    assert account is not None and account.streams_for(1) is not None
