"""The fold keeps its sums per sample length S and the ``mixed_s`` estimator combines them
(issue 36): blocks at one S change nothing, blocks at several S are charged by ``mixed_estimate``'s
rule over exact per-S sums, in any order of arrival, and the charge says what each S contributed."""

from __future__ import annotations

import math
import random
from dataclasses import replace

import numpy as np
import pytest
from factories import block, job_event, left

from nodeshare.schemas import Charge, JobState, ShutterBatch, decode_model, encode
from nodeshare.schemas.events import MAX_CHARGE_LEVELS
from nodeshare.streams.core.accounting import (
    JobAccount,
    LevelSums,
    NodeStream,
    Origin,
    PricingPolicy,
    estimate_streams,
    fold_messages,
    level_evidence,
)
from nodeshare.streams.core.degradation import (
    ESTIMATORS,
    MIXED_S,
    REFILL_CORRECTED,
    DegradationSums,
    LevelResult,
    estimate,
    filtered_degradation,
    totals_of,
)
from nodeshare.streams.core.shutter_policy import LevelStats, mixed_estimate

IPC, LIFE = "node.ipc", "jobs.lifecycle"
POLICY = PricingPolicy(rate_per_core_hour=1.5)


def _blocks(rng: random.Random, n: int, d: float, *, node: str = "n1", first: int = 0, noise: float = 0.003,
            job: str = "j1") -> list:
    """n blocks Alg. 4 accepts whose refill-corrected D is about ``d``."""
    out = []
    for i in range(n):
        co = round(rng.uniform(0.9, 1.1), 6)
        solo = round(co / (1 - d) * (1 + noise * rng.uniform(-1, 1)), 6)
        out.append(block(co, solo, round(co + 0.001, 6), job=job, node=node, cycle=first + i))
    return out


def _batch(blocks: list, sample_us: int, seq: int = 0) -> ShutterBatch:
    first, last = blocks[0], blocks[-1]

    def columns(region: str) -> dict[str, tuple[int, ...]]:
        ss = [s for b in blocks for s in getattr(b, region)]
        return {f: tuple(getattr(s, f) for s in ss) for f in ("instructions", "cycles", "threads")}

    return ShutterBatch.model_validate({
        "event_id": f"bat-{first.job_id}-{first.node}-{first.cycle}", "source": "test", "event_time": last.event_time,
        "job_id": first.job_id, "node": first.node, "seq": seq, "k": 1, "sample_us": sample_us,
        "counter": first.counter, "cycle": tuple(b.cycle for b in blocks),
        "before": columns("before"), "during": columns("during"), "after": columns("after")})


def _charge(ipc: list, nodes: tuple[str, ...] = ("n1",), policy: PricingPolicy = POLICY) -> Charge:
    msgs = [(Origin(IPC, 0, i), r.job_id.encode(), encode(r), 0.0) for i, r in enumerate(ipc)]
    msgs.append((Origin(LIFE, 0, 0), b"j1", encode(job_event("j1", JobState.ENDED, nodes=nodes)), 0.0))
    [c] = fold_messages(msgs, policy)
    return c


def _levels(groups: dict[int, list]) -> dict[int, LevelStats]:
    out = {}
    for s, blocks in groups.items():
        m = np.array([[x.before[0].instructions / x.before[0].cycles, x.during[0].instructions / x.during[0].cycles,
                       x.after[0].instructions / x.after[0].cycles] for x in blocks])
        st = out[s] = LevelStats()
        st.add_many(m[:, 0], m[:, 1], m[:, 2])
    return out


def test_merging_into_fresh_sums_is_exact():
    rng = random.Random(1)
    sums = DegradationSums()
    for b in _blocks(rng, 30, 0.05):
        sums.add(b)
    fresh = DegradationSums()
    fresh.merge(sums)
    assert totals_of(fresh) == totals_of(sums)
    assert estimate(fresh, REFILL_CORRECTED) == estimate(sums, REFILL_CORRECTED)


@pytest.mark.parametrize("sample_us", [3200, 51200])
@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_blocks_at_one_s_are_charged_as_before(estimator, sample_us):
    """One S: every estimator's result is the one over all blocks (the fold before sums per S), and
    mixed_s is refill_corrected bit for bit, with one level of evidence (priced with the short-sample
    margin at the shortest S, which nothing longer checked)."""
    rng = random.Random(2)
    blocks = _blocks(rng, 12, 0.06) + _blocks(rng, 12, 0.04, node="n2")
    n1, n2 = blocks[:12], blocks[12:]
    ipc = [_batch(n1[:5], sample_us), _batch(n2, sample_us), _batch(n1[5:], sample_us, seq=1),
           left("j1", "n1", 12, 11), left("j1", "n2", 12, 11)]
    policy = replace(POLICY, estimator=estimator)
    c = _charge(ipc, ("n1", "n2"), policy)
    reference = filtered_degradation(blocks, estimator=estimator)  # one block at a time, one sum
    assert c.degradation_shared == reference.degradation and c.interval_blocks == reference.interval_blocks
    if estimator != MIXED_S:
        assert c.levels == ()
        return
    rc = _charge(ipc, ("n1", "n2"), replace(POLICY, estimator=REFILL_CORRECTED))
    # at the shortest S nothing longer checked the estimate: the same estimate, priced with the margin
    short = sample_us <= POLICY.short_sample_us
    priced = {"degradation", "degradation_low", "degradation_high", "solo_time_s", "solo_price", "price", "dividend",
              "short_margin_applied"}
    skip = {"estimator", "levels"} | (priced if short else set())
    assert c.model_dump(exclude=skip) == rc.model_dump(exclude=skip)
    assert c.short_margin_applied == (POLICY.short_margin if short else 0.0) and rc.short_margin_applied == 0.0
    [level] = c.levels
    assert (level.sample_us, level.blocks_used, level.used) == (sample_us, 24, True)
    assert level.degradation == rc.degradation_corrected


def test_sums_per_s_keep_the_other_estimators_over_all_blocks():
    rng = random.Random(3)
    short, long_ = _blocks(rng, 20, 0.01), _blocks(rng, 8, 0.07, first=20)
    ipc = [_batch(short, 3200), _batch(long_, 51200), left("j1", "n1", 28, 27)]
    for estimator in (REFILL_CORRECTED, "poppa_alg4", "unfiltered"):
        c = _charge(ipc, policy=replace(POLICY, estimator=estimator))
        ref = filtered_degradation(short + long_, estimator=estimator)
        assert (c.degradation_shared, c.degradation_corrected, c.interval_blocks) == (
            ref.degradation, ref.corrected, ref.interval_blocks)


def test_a_short_s_biased_low_is_left_out():
    """Twolf's case: 3.2 ms reads D of 1%, 51.2 ms 7%: the charge is the long level's, not the pool's."""
    rng = random.Random(4)
    short, long_ = _blocks(rng, 30, 0.01), _blocks(rng, 10, 0.07, first=30)
    c = _charge([_batch(short, 3200), _batch(long_, 51200), left("j1", "n1", 40, 39)],
                policy=replace(POLICY, estimator=MIXED_S, price_at_bound=False))
    one_level = filtered_degradation(long_, estimator=REFILL_CORRECTED)
    assert c.degradation_shared == one_level.degradation and c.interval_blocks == 10
    assert [(v.sample_us, v.blocks_used, v.used) for v in c.levels] == [(3200, 30, False), (51200, 10, True)]
    pooled = filtered_degradation(short + long_, estimator=REFILL_CORRECTED)
    assert c.degradation_corrected == pooled.corrected < c.degradation_shared  # recorded, not applied
    proto = mixed_estimate(_levels({3200: short, 51200: long_}))
    assert proto.levels_used == (51200,) and c.degradation_shared == pytest.approx(proto.degradation, abs=1e-12)


def test_levels_that_agree_are_pooled_by_inverse_variance():
    rng = random.Random(5)
    short, long_ = _blocks(rng, 30, 0.05), _blocks(rng, 10, 0.05, first=30)
    c = _charge([_batch(short, 3200), _batch(long_, 51200), left("j1", "n1", 40, 39)],
                policy=replace(POLICY, estimator=MIXED_S, price_at_bound=False))
    assert all(v.used for v in c.levels) and c.interval_blocks == 40
    d = {v.sample_us: v.degradation for v in c.levels}
    assert min(d.values()) <= c.degradation_shared <= max(d.values())
    proto = mixed_estimate(_levels({3200: short, 51200: long_}))
    assert c.degradation_shared == pytest.approx(proto.degradation, abs=1e-9)
    assert c.degradation_high > c.degradation_point > c.degradation_low  # a t interval from the pooled SE


def test_a_mixed_charge_is_the_same_in_any_order_and_across_nodes():
    """Levels combine across nodes by S (n1 starts at 3.2 ms, n2 at 51.2 ms), whatever order the
    nodes' batches interleave in, and equal the estimate from per-S sums of the blocks one by one."""
    rng = random.Random(6)
    a_short, a_long = _blocks(rng, 9, 0.02), _blocks(rng, 3, 0.06, first=9)
    b_long, b_short = _blocks(rng, 4, 0.065, node="n2"), _blocks(rng, 7, 0.02, node="n2", first=4)
    markers = [left("j1", "n1", 12, 11), left("j1", "n2", 11, 10)]
    policy = replace(POLICY, estimator=MIXED_S)
    one = _charge([_batch(a_short, 3200), _batch(b_long, 51200), _batch(a_long, 51200),
                   _batch(b_short, 3200), *markers], ("n1", "n2"), policy)
    two = _charge([_batch(b_long[:2], 51200), _batch(b_long[2:], 51200, seq=1), _batch(b_short, 3200),
                   _batch(a_short[:4], 3200), _batch(a_short[4:], 3200, seq=1), _batch(a_long, 51200),
                   *markers], ("n1", "n2"), policy)
    assert [(v.sample_us, v.blocks_used) for v in one.levels] == [(3200, 16), (51200, 7)]
    assert one.degradation_shared > 0.05  # the long S is trusted
    assert one.model_dump(exclude={"event_range"}) == two.model_dump(exclude={"event_range"})
    by_s = {3200: DegradationSums(), 51200: DegradationSums()}
    total = DegradationSums()
    for s_us, blocks in ((3200, a_short + b_short), (51200, a_long + b_long)):
        for x in blocks:
            by_s[s_us].add(x)
            total.add(x)
    ref = estimate(total, MIXED_S, by_s)
    assert (one.degradation_shared, one.interval_blocks) == (ref.degradation, ref.interval_blocks)


def test_per_s_sums_persist_and_reload():
    rng = random.Random(7)
    account = JobAccount(job_id="j1")
    for i, (blocks, s) in enumerate([(_blocks(rng, 5, 0.02), 3200), (_blocks(rng, 5, 0.07, first=5), 51200)]):
        account.apply(_batch(blocks, s), Origin(IPC, 0, i), POLICY)
    ns = account.nodes["n1"]
    assert ns.sample_us == 3200 and set(ns.levels) == {51200} and isinstance(ns.levels[51200], LevelSums)
    again = JobAccount.loads(account.dumps(), "j1")
    assert again == account
    for estimator in ESTIMATORS:
        assert estimate_streams([again.nodes["n1"]], estimator) == estimate_streams([ns], estimator)


def test_a_stream_from_before_sums_per_s_keeps_its_blocks():
    """State written before this version has no S: its blocks are level 0 (the shortest, never trusted
    over a longer S), and the other estimators see every block as before."""
    rng = random.Random(8)
    old = NodeStream()
    sums = old.sums()
    for b in _blocks(rng, 6, 0.03):
        sums.add(b)
    old.store(sums)
    old.blocks = 6
    state = old.model_dump(exclude={"sample_us", "levels"})
    restored = NodeStream.model_validate(state)
    assert restored.sample_us == 0 and restored.levels == {}
    assert estimate_streams([restored], REFILL_CORRECTED) == estimate(sums, REFILL_CORRECTED)
    level = restored.level(51200)
    assert level is not restored and set(restored.levels) == {51200}


def test_the_charge_lists_a_bounded_number_of_levels():
    levels = tuple(LevelResult(3200 * (i + 1), i + 1, 0, 0.01, 0.001, i == 3) for i in range(MAX_CHARGE_LEVELS + 5))
    res = replace(filtered_degradation([], estimator=MIXED_S), levels=levels)
    out = level_evidence(res)
    assert len(out) == MAX_CHARGE_LEVELS and [v.sample_us for v in out] == sorted(v.sample_us for v in out)
    assert any(v.used for v in out) and out[-1].sample_us == 3200 * (MAX_CHARGE_LEVELS + 5)
    assert decode_model(Charge, encode(_charge([_batch(_blocks(random.Random(9), 3, 0.02), 3200),
                                               left("j1", "n1", 3, 2)],
                                              policy=replace(POLICY, estimator=MIXED_S)))).levels[0].used


def test_without_an_accepted_block_at_any_s_there_is_no_estimate():
    c = _charge([_batch([block(1.0, 0.9, 1.0, cycle=0)], 3200), _batch([block(1.0, 0.8, 1.0, cycle=1)], 51200),
                 left("j1", "n1", 2, 1)], policy=replace(POLICY, estimator=MIXED_S))
    assert c.estimate_status.value == "no_accepted_blocks" and c.interval_method == "prior"
    assert [(v.sample_us, v.blocks_rejected, v.degradation, v.used) for v in c.levels] == [
        (3200, 1, None, False), (51200, 1, None, False)]
    assert math.isclose(c.degradation, 0.25)


def test_the_fast_audit_groups_by_s_and_prices_mixed_s_as_the_fold(tmp_path):
    """The DuckDB fold sums per (job, node, S): a two-node job whose nodes start at different S is
    priced by the fast path (not left to the reference) with the fold's charge, bit for bit."""
    from factories import archive_records

    from nodeshare.sinks.fast_audit import fast_recompute

    rng = random.Random(10)
    a_short, a_long = _blocks(rng, 9, 0.01), _blocks(rng, 5, 0.06, first=9)
    b_long, b_short = _blocks(rng, 4, 0.065, node="n2"), _blocks(rng, 7, 0.01, node="n2", first=4)
    records = [_batch(a_short, 3200), _batch(b_long, 51200), _batch(a_long, 51200), _batch(b_short, 3200),
               left("j1", "n1", 14, 13), left("j1", "n2", 11, 10), job_event("j1", JobState.ENDED, nodes=("n1", "n2"))]
    archive, _, _ = archive_records(tmp_path, records)
    policy = replace(POLICY, estimator=MIXED_S)
    fast = fast_recompute(archive, {"j1": policy}, POLICY)
    assert fast.ineligible == set()
    fold = _charge(records[:-1], ("n1", "n2"), policy)
    got = fast.charges[("j1", 0)]
    assert [(v.sample_us, v.blocks_used, v.used) for v in got.levels] == [(3200, 16, False), (51200, 9, True)]
    assert got.model_dump(exclude={"event_range"}) == fold.model_dump(exclude={"event_range"})
    assert [(n.node, n.first_cycle, n.last_cycle, n.blocks) for n in got.nodes] == [("n1", 0, 13, 14),
                                                                                     ("n2", 0, 10, 11)]


def test_the_settings_choose_mixed_s_and_the_adaptive_schedule_by_default():
    from nodeshare.runtime.config import Settings
    from nodeshare.scenarios import ClusterChoice, ScenarioError

    fixed = Settings(estimator="refill_corrected", shutter_schedule="fixed")
    assert (fixed.policy().estimator, fixed.shutter_policy()) == ("refill_corrected", None)
    s = Settings()
    assert (s.estimator, s.shutter_schedule, s.price_at_bound) == ("mixed_s", "adaptive", False)
    assert s.policy().estimator == MIXED_S
    pol = s.shutter_policy()
    assert pol is not None and (pol.ladder_us, pol.k, pol.period_ms) == ((3200, 12800, 51200), 1, 200)
    choice = ClusterChoice.from_settings(s)
    assert choice.schedule == pol and choice.config().schedule == pol
    with pytest.raises(ScenarioError):
        ClusterChoice.from_settings(s, engine="simple")


def test_the_experiments_take_mixed_s_and_run_the_pairs_under_the_adaptive_schedule():
    from nodeshare.experiments.poppa import experiment_pairwise, experiment_pricing
    from nodeshare.streams.core.shutter_policy import ShutterPolicy

    r = experiment_pairwise(iterations=1, programs=("MILC", "LAMMPS"), estimator=MIXED_S)
    # under the fixed schedule every block has one S: mixed_s is refill_corrected
    assert r["estimators"][MIXED_S]["mae_pct"] == r["estimators"][REFILL_CORRECTED]["mae_pct"]
    assert r["schedule"] == "fixed"
    adaptive = experiment_pricing(iterations=1, programs=("MILC", "LAMMPS"), estimator=MIXED_S,
                                  schedule=ShutterPolicy())
    fixed = experiment_pricing(iterations=1, programs=("MILC", "LAMMPS"), estimator=MIXED_S)
    assert (adaptive["schedule"], fixed["schedule"]) == ("adaptive", "fixed")
    # the schedule given is the one run: the adaptive schedule takes fewer, longer samples
    blocks = {k: sum(x["blocks_used"] for x in v["job_rows"]) for k, v in (("a", adaptive), ("f", fixed))}
    assert 0 < blocks["a"] < blocks["f"]
