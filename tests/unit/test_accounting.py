"""The per-job reducer: one charge per job, whatever the interleaving, redelivery or bad input."""

import json

import pytest
from factories import block, job_event, left
from hypothesis import given, settings
from hypothesis import strategies as st

from nodeshare.schemas import Charge, DeadLetter, JobState, Record, decode_model, encode
from nodeshare.streams.core.accounting import JobAccount, Origin, PricingPolicy, fold_messages, process_message
from nodeshare.streams.core.degradation import filtered_degradation
from nodeshare.streams.core.pricing import fair_charge

POLICY = PricingPolicy(rate_per_core_hour=2.0, price_at_bound=False, short_margin=0.0)  # the arithmetic of Eq. 1-4 at
# the point estimate (the short-sample margin its 3.2 ms blocks would add: test_confidence)
IPC, LIFE = "node.ipc", "jobs.lifecycle"


def two_node_job(job: str = "j1") -> tuple[list[Record], list[Record]]:
    """(node.ipc records, jobs.lifecycle records) of a job on n1 and n2."""
    n1 = [block(1.0, 2.0, 1.0, job=job, node="n1", cycle=0), block(0.8, 1.0, 0.82, job=job, node="n1", cycle=3)]
    n2 = [block(1.0, 0.9, 1.0, job=job, node="n2", cycle=1), block(0.9, 1.2, 0.9, job=job, node="n2", cycle=2)]
    ipc = [n1[0], n2[0], n1[1], n2[1], left(job, "n1", 2, 3), left(job, "n2", 2, 2)]
    life = [job_event(job, JobState.SUBMITTED), job_event(job, JobState.STARTED, nodes=("n1", "n2")),
            job_event(job, JobState.ENDED, nodes=("n1", "n2"), cores=32, run_s=7200)]
    return ipc, life


def as_messages(records: list[Record], topic: str, start: int = 0) -> list[tuple]:
    return [(Origin(topic, 0, start + i), r.job_id.encode(), encode(r), 0.0) for i, r in enumerate(records)]


def test_charge_equals_the_pure_functions_on_the_blocks():
    ipc, life = two_node_job()
    [charge] = fold_messages(as_messages(ipc, IPC) + as_messages(life, LIFE), POLICY)
    blocks = [r for r in ipc if r.kind == "shutter_block"]
    d = filtered_degradation(blocks, estimator=POLICY.estimator)
    amounts = fair_charge(2.0, 32, 7200, d.degradation)
    assert charge.degradation == d.degradation and d.blocks_used == 3 and d.blocks_rejected == 1
    assert (charge.estimator, charge.degradation_corrected, charge.degradation_filtered) == (
        "mixed_s", d.corrected, d.filtered)
    assert d.degradation == d.corrected  # blocks at one S: mixed_s is the refill-corrected estimate
    assert (charge.standard_price, charge.price, charge.dividend) == (
        amounts.standard_price, amounts.price, amounts.dividend)
    assert charge.standard_price == 2.0 * 32 * 2  # L * C * T_co with T_co = 2 h
    assert [n.node for n in charge.nodes] == ["n1", "n2"] and charge.revision == 0
    assert {(r.topic, r.first_offset, r.last_offset) for r in charge.event_range} == {(IPC, 0, 5), (LIFE, 2, 2)}


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_same_charge_for_every_interleaving_of_the_two_topics(data):
    ipc, life = two_node_job()
    a, b = as_messages(ipc, IPC), as_messages(life, LIFE)
    # Merge the two topics at random positions, each keeping its own order (as Kafka guarantees).
    order = data.draw(st.permutations([0] * len(a) + [1] * len(b)))
    ia, ib, merged = iter(a), iter(b), []
    for which in order:
        merged.append(next(ia) if which == 0 else next(ib))
    reference = fold_messages(a + b, POLICY)
    assert fold_messages(merged, POLICY) == reference and len(reference) == 1


def messy_job(job: str = "j9") -> tuple[list[Record], list[Record]]:
    """Everything that can go wrong on the two topics, short of undecodable bytes."""
    ipc = [
        block(1.0, 2.0, 1.0, job=job, node="n1", cycle=0),
        block(0.7, 2.0, 0.7, job=job, node="rogue", cycle=0),  # a node the job does not run on
        block(1.0, 1.5, 1.0, job=job, node="n1", cycle=2),
        block(1.0, 3.0, 1.0, job=job, node="n1", cycle=1),  # out of order
        left(job, "n1", 3, 2),
        block(0.5, 1.0, 0.5, job=job, node="n1", cycle=5),  # after the job left n1
        block(0.9, 1.0, 0.9, job=job, node="n2", cycle=0),
        left(job, "n2", 1, 0),
    ]
    ended = job_event(job, JobState.ENDED, nodes=("n1",), run_s=3600)
    life = [job_event(job, JobState.SUBMITTED), job_event(job, JobState.STARTED, nodes=("n1",)), ended,
            ended.model_copy(update={"event_id": "dup"}),  # duplicate: ignored
            job_event(job, JobState.ENDED, nodes=("n1", "n2"), run_s=4000).model_copy(update={"event_id": "fix"})]
    return ipc, life


@settings(max_examples=100, deadline=None)
@given(st.data())
def test_every_revision_is_the_same_for_every_interleaving(data):
    ipc, life = messy_job()
    a, b = as_messages(ipc, IPC), as_messages(life, LIFE)
    order = data.draw(st.permutations([0] * len(a) + [1] * len(b)))
    ia, ib = iter(a), iter(b)
    merged = [next(ia) if which == 0 else next(ib) for which in order]
    reference = fold_messages(a + b, POLICY)
    assert [c.revision for c in reference] == [0, 1]
    assert fold_messages(merged, POLICY) == reference
    first, second = reference
    assert first.blocks_used + first.blocks_rejected == 2 and first.blocks_ignored == 1  # n1 only
    assert [n.node for n in second.nodes] == ["n1", "n2"] and "nodes" in second.revision_reason


@settings(max_examples=60, deadline=None)
@given(cut=st.integers(0, 9), replay_from=st.integers(0, 9))
def test_redelivery_after_a_crash_changes_nothing(cut, replay_from):
    ipc, life = two_node_job()
    msgs = as_messages(ipc, IPC) + as_messages(life, LIFE)
    replay_from = min(replay_from, cut)
    # The worker applied msgs[:cut], crashed, and faust redelivers from an older committed offset.
    redelivered = msgs[:cut] + msgs[replay_from:]
    assert fold_messages(redelivered, POLICY) == fold_messages(msgs, POLICY)


def _run(msgs: list[tuple]) -> tuple[JobAccount, list]:
    state, outs = None, []
    for origin, key, value, ts in msgs:
        new, out, _ = process_message(state, origin, key, value, ts, POLICY)
        state = new if new is not None else state
        outs += out
    return JobAccount.model_validate_json(state), outs


def _dead_letters(outs: list) -> list[DeadLetter]:
    return [decode_model(DeadLetter, o.value) for o in outs if o.topic == "dlq"]


def test_out_of_order_cycle_is_dead_lettered_and_not_counted():
    job = job_event("j1", JobState.ENDED)
    ipc = [block(1, 2, 1, cycle=5), block(1, 2, 1, cycle=4), left("j1", "n1", 2, 5)]
    _acc, outs = _run(as_messages(ipc, IPC) + as_messages([job], LIFE))
    [dl] = _dead_letters(outs)
    assert "out of order" in dl.reason and dl.origin_offset == 1
    [charge] = [decode_model(Charge, o.value) for o in outs if o.topic == "ledger.charges"]
    assert charge.blocks_used == 1 and charge.blocks_ignored == 1  # counted: it came before n1's close


def test_duplicate_end_event_is_dead_lettered_and_charges_once():
    ended = job_event("j1", JobState.ENDED)
    again = ended.model_copy(update={"event_id": "resent"})
    _, outs = _run(as_messages([left("j1", "n1", 0, -1)], IPC) + as_messages([ended, again], LIFE))
    assert len([o for o in outs if o.topic == "ledger.charges"]) == 1
    assert "duplicate terminal event" in _dead_letters(outs)[0].reason


def test_corrected_end_event_produces_a_superseding_revision():
    ended = job_event("j1", JobState.ENDED, run_s=3600)
    corrected = job_event("j1", JobState.FAILED, run_s=1800).model_copy(update={"event_id": "fix"})
    msgs = as_messages([block(1, 2, 1, cycle=0), left("j1", "n1", 1, 0)], IPC) + as_messages([ended, corrected], LIFE)
    first, second = fold_messages(msgs, POLICY)
    assert (first.revision, second.revision) == (0, 1) and first.revision_reason == ""
    assert "end_time" in second.revision_reason and "state" in second.revision_reason
    assert second.run_time_s == 1800 and second.standard_price == first.standard_price / 2
    assert second.degradation == first.degradation == 0.5  # same blocks, same evidence
    assert first.event_id != second.event_id


def test_a_copy_of_a_block_after_the_job_left_the_node_is_dead_lettered():
    """A block at or below the closed stream's last cycle is a copy of what it counted; one past it
    is the job running on the node again (requeued), which opens the node's next stream."""
    msgs = as_messages([block(1, 2, 1, cycle=9), left("j1", "n1", 1, 9), block(1, 2, 1, cycle=9)], IPC)
    account, outs = _run(msgs)
    assert "left the node" in _dead_letters(outs)[0].reason and not account.earlier
    account, outs = _run(as_messages([block(1, 2, 1, cycle=9), left("j1", "n1", 1, 9), block(1, 2, 1, cycle=10)], IPC))
    assert not _dead_letters(outs) and account.earlier["n1"][0].blocks == 1 and not account.nodes["n1"].closed


def test_blocks_after_the_charge_do_not_change_it():
    msgs = as_messages([left("j1", "n1", 0, -1)], IPC) + as_messages([job_event("j1", JobState.ENDED)], LIFE)
    msgs += as_messages([block(1, 2, 1, node="n9", cycle=1)], IPC, start=1)
    _acc, outs = _run(msgs)
    [charge] = [decode_model(Charge, o.value) for o in outs if o.topic == "ledger.charges"]
    assert charge.blocks_used == 0 and [n.node for n in charge.nodes] == ["n1"]
    assert _dead_letters(outs) == []  # n9 may yet be named by a correction: kept, not priced


def test_blocks_from_nodes_the_job_did_not_run_on_are_ignored():
    ipc = [block(1, 2, 1, node="n1", cycle=0), block(0.5, 2, 0.5, node="rogue", cycle=0), left("j1", "n1", 1, 0)]
    [charge] = fold_messages(as_messages(ipc, IPC) + as_messages([job_event("j1", JobState.ENDED)], LIFE), POLICY)
    assert charge.degradation == 0.5 and charge.blocks_used == 1 and charge.blocks_ignored == 0
    assert [n.node for n in charge.nodes] == ["n1"]


def test_charge_waits_for_every_node_to_close():
    ipc = [block(1, 2, 1, node="n1", cycle=0), left("j1", "n1", 1, 0)]
    end = job_event("j1", JobState.ENDED, nodes=("n1", "n2"))
    assert fold_messages(as_messages(ipc, IPC) + as_messages([end], LIFE), POLICY) == []
    closing = as_messages([left("j1", "n2", 0, -1)], IPC, start=2)
    assert len(fold_messages(as_messages(ipc, IPC) + as_messages([end], LIFE) + closing, POLICY)) == 1


def test_job_cancelled_before_it_started_is_not_charged():
    cancelled = job_event("j1", JobState.SUBMITTED).model_copy(update={"state": JobState.CANCELLED})
    assert fold_messages(as_messages([cancelled], LIFE), POLICY) == []


def test_a_job_alone_on_its_node_pays_the_standard_price():
    """No block because no co-runner (its marker says it was alone all along): nothing to discount."""
    [c] = fold_messages(as_messages([left("j1", "n1", 0, -1, alone_us=1_800_000_000)], IPC)
                        + as_messages([job_event("j1", JobState.ENDED, cores=4, run_s=1800)], LIFE), POLICY)
    assert c.estimate_status.value == "no_blocks" and c.price == c.standard_price == 2.0 * 4 * 0.5


def test_a_job_that_shared_without_a_block_pays_the_prior_bound_never_the_standard_price_in_silence():
    """No block although it shared its node all along (alone 0): no estimate, so the stated prior's
    upper end (0.25) over the time it shared; Eq. 4: 2 * 4 * 0.5 * 0.75^2."""
    [c] = fold_messages(as_messages([left("j1", "n1", 0, -1)], IPC)
                        + as_messages([job_event("j1", JobState.ENDED, cores=4, run_s=1800)], LIFE), POLICY)
    assert c.estimate_status.value == "no_blocks" and c.interval_method == "prior" and c.degradation == 0.25
    assert c.price == pytest.approx(2.0 * 4 * 0.5 * 0.75**2) and c.degradation_point == 0.0


@pytest.mark.parametrize("value", [b"\xde\xad\xbe\xef", b'{"kind":"shutter_block"', b'{"kind":"job_event"}'])
def test_undecodable_bytes_go_to_the_dead_letter_topic_with_origin(value):
    new_state, out, _ = process_message(None, Origin(IPC, 3, 42), b"j1", value, 1.7e9, POLICY)
    assert new_state is None
    [dl] = _dead_letters(out)
    assert (dl.origin_topic, dl.origin_partition, dl.origin_offset) == (IPC, 3, 42)
    assert dl.reason and dl.value_b64


def test_key_must_match_the_job_id():
    rec = block(1, 2, 1, job="j1")
    new_state, out, _ = process_message(None, Origin(IPC, 0, 0), b"j2", encode(rec), 0.0, POLICY)
    assert new_state is None and _dead_letters(out)[0].field == "key"


def test_state_round_trips_through_json():
    ipc, _life = two_node_job()
    acc, _ = _run(as_messages(ipc[:3], IPC))
    assert JobAccount.model_validate_json(acc.dumps()) == acc
    assert json.loads(acc.dumps())["nodes"]["n1"]["blocks"] == 2  # n1 cycles 0 and 3


def test_pause_credit_is_the_longest_per_node_pause():
    # alone all along on both nodes (no co-runner, so no block): D = 0
    n1 = left("j1", "n1", 0, -1, alone_us=3_600_000_000).model_copy(update={"paused_us": 2_000_000})
    n2 = left("j1", "n2", 0, -1, alone_us=3_600_000_000).model_copy(update={"paused_us": 3_500_000})
    end = job_event("j1", JobState.ENDED, nodes=("n1", "n2"), cores=10, run_s=3600)
    [c] = fold_messages(as_messages([n1, n2], IPC) + as_messages([end], LIFE), POLICY)
    assert c.pause_credit_s == 3.5 and c.billed_time_s == 3596.5
    # no blocks, so D = 0 and T_solo = 3596.5 s; Eq. 4: L * (T_solo / T_co) * C * T_solo
    assert c.price == pytest.approx(2.0 * (3596.5 / 3600) * 10 * 3596.5 / 3600) and c.standard_price == 20.0
    assert [n.paused_s for n in c.nodes] == [2.0, 3.5]


def test_a_charge_lost_in_a_crash_is_sent_again_when_its_trigger_is_redelivered():
    """The worker persisted the job's state, then died before the charge left its producer buffer:
    the redelivered event that completed the job must emit the same charge again."""
    ipc, life = two_node_job()
    msgs = as_messages(ipc, IPC) + as_messages(life, LIFE)
    state, outs = None, []
    for origin, key, value, ts in msgs:
        new, out, _ = process_message(state, origin, key, value, ts, POLICY)
        state, outs = (new if new is not None else state), outs + out
    [charge] = [o for o in outs if o.topic == "ledger.charges"]
    trigger = msgs[-1]  # the end event arrived last, so it completed the job
    again_state, again, _ = process_message(state, *trigger, POLICY)
    assert again_state is None and [o.value for o in again] == [charge.value]
    _, nothing, _ = process_message(state, *msgs[0], POLICY)  # any other redelivery stays silent
    assert nothing == []


def test_rebuilt_states_equal_an_uninterrupted_fold_and_resend_completed_charges():
    from nodeshare.streams.core.accounting import fold_states

    ipc, life = two_node_job()
    msgs = as_messages(ipc, IPC) + as_messages(life, LIFE)
    states, charges = fold_states(msgs, POLICY)
    acc, _ = _run(msgs)
    assert states[b"j1"] == acc
    assert [decode_model(Charge, o.value) for o in charges] == fold_messages(msgs, POLICY)


def test_a_batch_without_running_estimates_publishes_none_and_the_later_one_is_the_same():
    """The stream worker folds batches without building a running estimate each and publishes the
    latest per job twice a second (streams.worker.fold_consumer): that estimate must be, bit for bit, the
    one the last batch would have published. Final estimates, with charges, are unchanged.
    (Mutation: ignoring the flag, or running_estimate() reading another state, fails here.)"""
    from factories import batch

    from nodeshare.schemas import DegradationEstimate
    from nodeshare.streams.core.accounting import apply_message

    first = batch(*[block(1.0, 1.3, 1.01, job="j", cycle=c) for c in range(3)])
    second = batch(*[block(0.9, 1.2, 0.92, job="j", cycle=c) for c in range(3, 6)], seq=1)
    messages = as_messages([first, second], IPC)
    each, lazy = None, None
    for m in messages:
        each, out_each, _ = apply_message(each, *m, POLICY)
        lazy, out_lazy, _ = apply_message(lazy, *m, POLICY, running_estimates=False)
        assert [o.topic for o in out_each] == ["estimates.degradation"] and out_lazy == []
    assert lazy is not None and lazy.running_estimate(POLICY) == decode_model(DegradationEstimate, out_each[0].value)
    rest = as_messages([left("j", "n1", 6, 5)], IPC, start=2) + as_messages([job_event("j", JobState.ENDED)], LIFE)
    for m in rest:
        each, out_each, _ = apply_message(each, *m, POLICY)
        lazy, out_lazy, _ = apply_message(lazy, *m, POLICY, running_estimates=False)
        assert out_lazy == out_each  # the marker's and the end's estimates, and the charge
    assert any(o.topic == "ledger.charges" for o in out_lazy)
