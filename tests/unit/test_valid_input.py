"""Valid input never stops billing, and the physics a charge's inputs must obey.

Each test here failed on the code before the fix it names: an idle job divided by zero in every
worker, non-terminal lifecycle events were charged or crashed the fold, impossible job times
priced decades, markers were trusted blindly, a correction waited for ever behind a wrong node
list, and a requeued run was priced from the first run's blocks.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta

import pytest
from factories import POLICY, T0, batch, block, job_event, left

from nodeshare.schemas import Charge, DeadLetter, JobEvent, JobLeftNode, JobState, encode
from nodeshare.schemas.events import EstimateStatus
from nodeshare.schemas.serde import decode_model
from nodeshare.streams.core.accounting import (
    MARKER_SLACK_S,
    MAX_PAUSE_SHARE,
    Origin,
    PricingPolicy,
    apply_message,
    fold_messages,
    fold_states,
)
from nodeshare.streams.core.degradation import ESTIMATORS, degradation_from_sums, estimate_from_totals

IPC, LIFE = "node.ipc", "jobs.lifecycle"
NOW = T0 + timedelta(hours=1)  # the broker's timestamp of every message here


def messages(records: list, broker_s: float = NOW.timestamp()) -> list[tuple]:
    """Records (or raw (topic, bytes)) as messages of job j1, each topic's offsets from 0."""
    offsets = {IPC: 0, LIFE: 0}
    out = []
    for r in records:
        topic, value = r if isinstance(r, tuple) else (LIFE if isinstance(r, JobEvent) else IPC, encode(r))
        out.append((Origin(topic, 0, offsets[topic]), b"j1", value, broker_s))
        offsets[topic] += 1
    return out


def run(records: list, broker_s: float = NOW.timestamp()) -> tuple[list[Charge], list[DeadLetter]]:
    """Every charge and dead letter the worker's fold makes of these records, in this order."""
    account, charges, letters = None, [], []
    for origin, key, value, ts in messages(records, broker_s):
        new, out, _ = apply_message(account, origin, key, value, ts, POLICY)
        account = new if new is not None else account
        charges += [decode_model(Charge, o.value) for o in out if o.topic == "ledger.charges"]
        letters += [decode_model(DeadLetter, o.value) for o in out if o.topic == "dlq"]
    return charges, letters


# --------------------------------------------------------------------------- an idle job (item 1)


def test_no_progress_alone_has_no_degradation_by_hand():
    assert degradation_from_sums(0.0, 0.5) is None
    assert degradation_from_sums(2.0, 1.5) == 0.25  # (2 - 1.5) / 2


@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_a_job_that_retires_nothing_alone_is_charged_the_standard_price(estimator):
    """Blocks whose during window retired 0 instructions (the job slept, or waited on I/O or MPI,
    while it ran alone): no slowdown is measurable, so no discount and, above all, no exception in
    the fold, the running estimate or the charge."""
    idle = batch(block(0.5, 0.0, 0.5, cycle=0), block(0.5, 0.0, 0.5, cycle=1))
    policy = PricingPolicy(rate_per_core_hour=1.5, estimator=estimator)
    account = None
    for origin, key, value, ts in messages([idle]):
        account, _, _ = apply_message(account, origin, key, value, ts, policy)
    assert account is not None and account.running_estimate(policy).degradation == 0.0
    (charge,) = fold_messages(messages([idle, left("j1", "n1", 2, 1), job_event("j1", JobState.ENDED)]), policy)
    assert charge.price == charge.standard_price == 24.0 and charge.degradation == 0.0
    assert charge.degradation_unfiltered is None and charge.blocks_used == 0 and charge.blocks_rejected == 2
    want = EstimateStatus.NO_PROGRESS_ALONE if estimator == "unfiltered" else EstimateStatus.NO_ACCEPTED_BLOCKS
    assert charge.estimate_status is want


def test_estimate_from_zero_sums_names_the_reason():
    r = estimate_from_totals(0.0, 0.0, 0.0, 1.0, 0, 3, estimator="unfiltered")
    assert r.status is EstimateStatus.NO_PROGRESS_ALONE and r.degradation == 0.0 and r.unfiltered is None


# --------------------------------------------------------------------------- lifecycle events (item 5)


def raw_event(**changes) -> tuple[str, bytes]:
    """A terminal event's bytes with fields changed behind the schema's back (as another producer might)."""
    d = json.loads(encode(job_event("j1", JobState.ENDED)))
    d.update({k: v.isoformat() if isinstance(v, datetime) else v for k, v in changes.items()})
    return LIFE, json.dumps(d).encode()


@pytest.mark.parametrize(("changes", "says"), [
    ({"state": "started"}, "end_time: a started job has not ended"),
    ({"state": "started", "end_time": T0 - timedelta(hours=1)}, "end_time"),
    ({"state": "submitted", "nodes": []}, "start_time: a submitted job has not started"),
    ({"end_time": T0 - timedelta(seconds=1)}, "end_time: precedes start_time"),
    ({"nodes": ["n1", "n1"]}, "nodes: a node is listed twice"),
    ({"start_time": datetime.fromtimestamp(1, UTC)}, "start_time 1970-01-01"),
    ({"end_time": datetime(2099, 1, 1, tzinfo=UTC)}, "end_time 2099-01-01"),
    ({"submit_time": datetime(1999, 12, 31, tzinfo=UTC)}, "submit_time 1999-12-31"),
])
def test_lifecycle_events_that_cannot_be_right_are_dead_letters_and_never_charged(changes, says):
    charges, letters = run([left("j1", "n1", 0, -1), raw_event(**changes)])
    assert not charges
    assert len(letters) == 1 and says in f"{letters[0].field}: {letters[0].reason}", letters[0]


def test_a_valid_terminal_event_beside_them_is_charged():
    charges, letters = run([left("j1", "n1", 0, -1), raw_event()])
    assert not letters and len(charges) == 1 and charges[0].run_time_s == 3600


# --------------------------------------------------------------------------- markers (item 6)


def marker(blocks_sent: int, paused_s: float = 0.0, alone_s: float = 0.0, last_cycle: int = 3,
           at: datetime = NOW) -> JobLeftNode:
    return JobLeftNode(event_id="l-n1", source="t", event_time=at, job_id="j1", node="n1", blocks_sent=blocks_sent,
                       last_cycle=last_cycle, paused_us=round(paused_s * 1e6), alone_us=round(alone_s * 1e6))


FOUR = batch(*[block(1.0, 1.25, 1.0, cycle=c) for c in range(4)])  # D_shared = 0.2 by hand: (1.25 - 1) / 1.25


def priced(*records) -> Charge:
    charges, _ = run([*records, job_event("j1", JobState.ENDED)])
    (charge,) = charges
    return charge


def test_a_sound_marker_is_applied_by_hand():
    c = priced(FOUR, marker(4, paused_s=36.0, alone_s=0.0))
    # billed 3600 - 36 = 3564 s, T_solo = 0.8 * 3564 = 2851.2 s, P_solo = 1.5 * 16 * 2851.2 / 3600 = 19.008;
    # Eq. 4: price = P_solo * T_solo / T_co = 19.008 * 0.792 = 15.054336
    assert c.pause_credit_s == 36.0 and c.evidence_problems == () and c.price == pytest.approx(15.054336)


def test_blocks_that_never_arrived_are_said_and_the_rest_price():
    c = priced(FOUR, marker(400))
    assert c.blocks_used == 4 and c.degradation == pytest.approx(0.2)
    assert c.evidence_problems == ("node n1: 396 of the 400 blocks its marker says were sent never arrived",)


def test_a_marker_that_counts_fewer_blocks_than_arrived_is_refused():
    c = priced(FOUR, marker(0, paused_s=100.0, last_cycle=-1))
    assert c.pause_credit_s == 0.0 and c.blocks_used == 4  # its claims set aside, the blocks (each checked) count
    assert "4 blocks counted but its marker says 0 were sent" in c.evidence_problems[0]


@pytest.mark.parametrize("paused_s", [1e6, 3600.0, 1800.0])
def test_a_marker_claiming_more_pause_than_shutters_make_is_refused_toward_the_higher_price(paused_s):
    """A pause credit as long as the run made the job free; refused, the job pays as if not paused."""
    c = priced(FOUR, marker(4, paused_s=paused_s))
    assert c.pause_credit_s == 0.0 and c.price == pytest.approx(1.5 * 16 * 0.8 * 0.8)  # D 0.2, no credit
    assert "more than shutters pause a job in a run of 3600.000 s (5% of it)" in c.evidence_problems[0]


@pytest.mark.parametrize("alone_s", [3600.0, 3660.0, 2 * 3600.0])
def test_time_alone_beyond_the_run_only_raises_the_price(alone_s):
    """A claim of time alone shrinks the discount (D = D_shared (1 - A / T)) and is clamped to the run:
    refusing it would have bought the largest discount (a claim 14 s past a bound gave 74% off)."""
    c = priced(FOUR, marker(4, alone_s=alone_s))
    assert c.evidence_problems == () and c.alone_s == 3600.0 and c.price == c.standard_price == 24.0


def test_a_refused_marker_never_lowers_the_price():
    honest = priced(FOUR, marker(4, paused_s=30.0, alone_s=1800.0))
    undercounted = priced(FOUR, marker(0, paused_s=30.0, alone_s=1800.0, last_cycle=-1))  # its credit set aside
    assert undercounted.evidence_problems and undercounted.price > honest.price
    assert undercounted.alone_s == honest.alone_s == 1800.0


def test_the_pause_bound_allows_the_stated_slack_only():
    limit = 3600 * MAX_PAUSE_SHARE + MARKER_SLACK_S  # 190 s
    assert priced(FOUR, marker(4, paused_s=limit)).evidence_problems == ()
    assert priced(FOUR, marker(4, paused_s=limit + 1.0)).evidence_problems != ()


# --------------------------------------------------------------------------- revisions and requeues (items 4, 6)


def ended(nodes: tuple[str, ...], start_h: float = 0, end_h: float = 1, eid: str = "e",
          state: JobState = JobState.ENDED) -> JobEvent:
    return JobEvent(event_id=eid, source="slurm", event_time=T0 + timedelta(hours=end_h), job_id="j1", state=state,
                    user="u", account="a", program="p", cores=16, nodes=nodes,
                    start_time=T0 + timedelta(hours=start_h), end_time=T0 + timedelta(hours=end_h))


def fold(records: list) -> tuple[list[Charge], int]:
    accounts, out = fold_states(messages(records, broker_s=(T0 + timedelta(hours=6)).timestamp()), POLICY)
    return [decode_model(Charge, o.value) for o in out], accounts[b"j1"].revision


def test_a_correction_that_drops_a_wrong_node_is_charged_without_waiting_for_it():
    charges, revision = fold([FOUR, marker(4), ended(("n1", "n2"), eid="end"), ended(("n1",), eid="fix")])
    assert revision == 1 and [(c.revision, [n.node for n in c.nodes]) for c in charges] == [(1, ["n1"])]
    assert "nodes" in charges[0].revision_reason


def test_a_revision_whose_nodes_closed_is_still_charged_before_its_correction():
    charges, _ = fold([FOUR, marker(4), ended(("n1",), eid="end"),
                       ended(("n1",), end_h=0.5, eid="fix")])
    assert [c.revision for c in charges] == [0, 1] and charges[1].run_time_s == 1800


def test_a_correction_of_the_start_time_corrects_the_run_and_a_later_requeue_is_its_own_run():
    """A correction that moves the start (same run: its times overlap) was read as a requeue and waited
    for ever for a second stream; then a real requeue's blocks priced the corrected revision."""
    first = batch(*[block(1.0, 1.5, 1.0, cycle=c) for c in range(3)])  # D 1/3
    again = batch(*[block(1.0, 1.01, 1.0, cycle=c) for c in range(10, 13)])
    end, fix = ended(("n1",), 0, 1, "end"), ended(("n1",), 5 / 60, 1, "fix")
    charges, revision = fold([first, left("j1", "n1", 3, 2), end, fix,
                              again, left("j1", "n1", 3, 12, at_s=3 * 3600), ended(("n1",), 2, 3, "run2")])
    assert revision == 2 and [(c.revision, c.nodes[0].first_cycle) for c in charges] == [(0, 0), (1, 0), (2, 10)]
    assert charges[1].run_time_s == 3300 and "start_time" in charges[1].revision_reason


def test_a_requeued_run_is_priced_from_its_own_blocks():
    first = batch(block(1.0, 1.25, 1.0, cycle=0))  # D 0.2
    again = batch(block(1.0, 2.0, 1.0, cycle=10), block(1.0, 2.0, 1.0, cycle=11))  # D 0.5
    charges, _ = fold([first, left("j1", "n1", 1, 0), ended(("n1",), 0, 1, "run1", JobState.CANCELLED),
                       again, left("j1", "n1", 2, 11, at_s=5 * 3600), ended(("n1",), 2, 5, "run2")])
    assert [(c.revision, c.blocks_used, c.degradation) for c in charges] == [(0, 1, 0.2), (1, 2, 0.5)]
    assert (charges[1].nodes[0].first_cycle, charges[1].nodes[0].last_cycle) == (10, 11)


def test_a_requeued_run_without_blocks_closes_with_its_own_marker_and_a_copy_is_refused():
    run1, run2 = left("j1", "n1", 0, -1, alone_us=3600 * 10**6), left("j1", "n1", 0, -1, at_s=5 * 3600)
    records = [run1, ended(("n1",), 0, 1, "run1", JobState.CANCELLED), run1, run2, ended(("n1",), 2, 5, "run2")]
    charges, _ = fold(records)
    assert [(c.revision, c.alone_s) for c in charges] == [(0, 3600.0), (1, 0.0)]
    _, letters = run(records, (T0 + timedelta(hours=6)).timestamp())
    assert [dl.reason for dl in letters] == ["job already left this node (a copy of its marker)"]


def test_each_revision_is_the_same_whatever_the_order_the_topics_interleave():
    """The requeue and the correction, in every order of the two topics that keeps each one's own order."""
    import itertools

    ipc = [FOUR, marker(4), batch(block(1.0, 2.0, 1.0, cycle=10)), marker(1, last_cycle=10, at=T0 + timedelta(hours=5))]
    life = [ended(("n1",), 0, 1, "run1", JobState.CANCELLED), ended(("n1",), 0, 0.5, "fix1", JobState.CANCELLED),
            ended(("n1",), 2, 5, "run2")]
    seen = set()
    for where in itertools.combinations(range(len(ipc) + len(life)), len(life)):
        i, j, order = iter(ipc), iter(life), []
        for n in range(len(ipc) + len(life)):
            order.append(next(j) if n in where else next(i))
        charges, _ = fold(order)
        seen.add(tuple((c.revision, c.price, c.blocks_used) for c in charges))
    assert len(seen) == 1 and [r for r, _, _ in next(iter(seen))] == [0, 1, 2]
