"""A charge that knows how sure it is: the degradation's interval, and the price at its bound."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest
from factories import archive_records, batch, block, job_event, left
from unit.test_schema_evolution import as_version

from nodeshare.schemas import Charge, JobState, decode_model, encode
from nodeshare.schemas.events import EstimateStatus
from nodeshare.sinks.audit import audit, policy_of
from nodeshare.sinks.ledger import Ledger
from nodeshare.streams.core.accounting import Origin, PricingPolicy, fold_messages
from nodeshare.streams.core.confidence import (
    DEFAULT_SHORT_MARGIN,
    MIN_INTERVAL_BLOCKS,
    NO_INTERVAL,
    PRIOR,
    T_RATIO,
    Interval,
    degradation_interval,
    long_samples_untaken,
    short_sample_margin,
    short_sample_widening,
    short_samples_unchecked,
    t_quantile,
    trusted_level_low,
)
from nodeshare.streams.core.degradation import (
    ESTIMATORS,
    MIXED_S,
    POPPA_ALG4,
    REFILL_CORRECTED,
    DegradationResult,
    DegradationSums,
    LevelResult,
    estimate,
    filtered_degradation,
    ratio_standard_error,
)
from nodeshare.streams.core.shutter_policy import trusted_level_below

IPC, LIFE = "node.ipc", "jobs.lifecycle"


def as_messages(records: list, topic: str) -> list[tuple]:
    return [(Origin(topic, 0, i), r.job_id.encode(), encode(r), 0.0) for i, r in enumerate(records)]

BOUND = PricingPolicy(rate_per_core_hour=1.0, price_at_bound=True)  # at the 95% interval's upper end
POINT = PricingPolicy(rate_per_core_hour=1.0)  # the default: at the point estimate


@pytest.mark.parametrize(("p", "dof", "exact"), [
    (0.975, 7, 2.364624), (0.975, 10, 2.228139), (0.975, 30, 2.042272), (0.95, 10, 1.812461),
    (0.995, 20, 2.845340), (0.975, 10**6, 1.959966)])
def test_t_quantiles_match_the_tables(p, dof, exact):
    assert t_quantile(p, dof) == pytest.approx(exact, abs=2e-3)


@pytest.mark.parametrize(("p", "dof", "exact"), [
    (0.975, 1, 12.706205), (0.975, 2, 4.302653), (0.975, 3, 3.182446), (0.995, 1, 63.656741),
    (0.995, 5, 4.032143), (0.9, 6, 1.439756), (0.5, 4, 0.0)])
def test_t_quantiles_below_seven_degrees_of_freedom_are_exact(p, dof, exact):
    """Below 7 degrees of freedom the expansion is 11% short at 1 (p = 0.975) and 36% at p = 0.995;
    there the exact distribution is inverted: the tables' values to their six decimals."""
    assert t_quantile(p, dof) == pytest.approx(exact, abs=1e-6)


def test_a_confidence_beyond_what_the_quantile_can_give_is_refused():
    result = filtered_degradation(_blocks(np.random.default_rng(1), 20, 0.1, 0.02), estimator="unfiltered")
    assert degradation_interval(result, 0.99).method == T_RATIO
    with pytest.raises(ValueError, match="accurate up to"):
        degradation_interval(result, 0.999)


def test_t_quantile_refuses_what_it_cannot_give():
    with pytest.raises(ValueError, match=r"0\.5 <= p < 1"):
        t_quantile(0.4, 10)
    with pytest.raises(ValueError, match="degrees of freedom"):
        t_quantile(0.975, 0)


def test_the_ratio_standard_error_by_hand():
    """Blocks (x, y) = (2, 1) and (4, 3): R = 4 / 6, residuals -1/3 and +1/3, sum of squares 2/9;
    Var(R) = 2 / 1 * (2/9) / 6^2 = 1/81, so SE = 1/9."""
    se = ratio_standard_error(2, 6.0, 4.0, 20.0, 14.0, 10.0)
    assert se == pytest.approx(1 / 9, rel=1e-12)
    assert ratio_standard_error(1, 2.0, 1.0, 4.0, 2.0, 1.0) is None  # one block: no spread
    assert ratio_standard_error(5, 0.0, 1.0, 0.0, 0.0, 1.0) is None  # no progress alone


def _blocks(rng: np.random.Generator, n: int, d_true: float, noise: float, job: str = "j1") -> list:
    """n blocks of a job whose co-located IPC is (1 - d_true) of its solo IPC, with noise."""
    out = []
    for i in range(n):
        solo = round(1.2 * (1 + noise * rng.standard_normal()), 6)
        co = round(solo * (1 - d_true) * (1 + noise * rng.standard_normal()), 6)
        out.append(block(co, solo + 0.06, round(co + 0.001, 6), job=job, cycle=i))
    return out


@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_the_folds_standard_error_is_the_ratio_estimators_over_its_blocks(estimator):
    """The fold's nine product sums give, for each estimator, the standard error computed directly
    from its blocks' x and y; block by block and batch by batch, the same bits."""
    rng = np.random.default_rng(3)
    blocks = _blocks(rng, 40, 0.1, 0.02)
    one = filtered_degradation(blocks, estimator=estimator)
    batched = filtered_degradation([batch(*blocks[:25]), batch(*blocks[25:], seq=1)], estimator=estimator)
    assert one == batched and one.standard_error is not None
    b, d, a = (np.array([sum(s.instructions / s.cycles for s in getattr(bl, r)) for bl in blocks])
               for r in ("before", "during", "after"))
    keep = (abs(b - a) < 0.05) & (b < d) & (a < d)
    if estimator in (REFILL_CORRECTED, MIXED_S):  # mixed_s with one sample length: refill_corrected
        x, y = (d + a - b)[keep], b[keep]
    elif estimator == POPPA_ALG4:
        x, y = d[keep], (0.5 * (b + a))[keep]
    else:
        x, y = d, 0.5 * (b + a)
    r = y.sum() / x.sum()
    direct = math.sqrt(len(x) / (len(x) - 1) * ((y - r * x) ** 2).sum()) / x.sum()
    assert one.standard_error == pytest.approx(direct, rel=1e-9) and one.interval_blocks == len(x)


def test_merged_node_sums_give_the_same_standard_error_as_one_stream():
    rng = np.random.default_rng(5)
    blocks = _blocks(rng, 30, 0.2, 0.03)
    whole, half1, half2 = DegradationSums(), DegradationSums(), DegradationSums()
    for i, bl in enumerate(blocks):
        whole.add(bl)
        (half1 if i % 2 else half2).add(bl)
    half1.merge(half2)
    assert estimate(half1) == estimate(whole)


def test_the_interval_covers_the_true_degradation_at_its_confidence():
    """500 jobs of 20-200 blocks with independent noise around a known D: the 95% interval holds
    the true D for 95% of them (a fixed seed, so the count is a fact, not a chance)."""
    rng = np.random.default_rng(11)
    inside = 0
    for _ in range(500):
        d_true = float(rng.uniform(0.02, 0.3))
        blocks = _blocks(rng, int(rng.integers(20, 200)), d_true, 0.02)
        sums = DegradationSums()
        for bl in blocks:
            sums.add(bl)
        result = estimate(sums, "unfiltered")  # the blocks' during is solo + 0.06: unfiltered is d_true's own
        # what unfiltered measures here: 1 - co / (solo + 0.06) on average
        target = 1 - (1 - d_true) * 1.2 / 1.26
        iv = degradation_interval(result, 0.95, margin_abs=0.0, margin_rel=0.0)  # the t term alone
        assert iv.method == T_RATIO
        inside += iv.low <= target <= iv.high
    assert 0.93 <= inside / 500 <= 0.97, inside


def _charge(blocks: list, policy: PricingPolicy, alone_us: int = 0, run_s: float = 3600) -> Charge:
    [c] = fold_messages(as_messages([batch(*blocks), left("j1", "n1", len(blocks), len(blocks) - 1, run_s, alone_us)],
                                    IPC) + as_messages([job_event("j1", JobState.ENDED, cores=4, run_s=run_s)], LIFE),
                        policy)
    return c


def test_a_charge_carries_its_interval_and_is_priced_at_its_upper_end():
    rng = np.random.default_rng(7)
    blocks = _blocks(rng, 60, 0.15, 0.02)
    bound, point = _charge(blocks, BOUND), _charge(blocks, POINT)
    assert bound.interval_method == T_RATIO and bound.interval_blocks == bound.blocks_used == 60
    assert bound.degradation_low < bound.degradation_point < bound.degradation_high
    assert bound.degradation == bound.degradation_high
    # 3.2 ms blocks only, nothing longer to check them: the point estimate plus the short-sample margin
    assert point.short_margin_applied == bound.short_margin_applied == DEFAULT_SHORT_MARGIN == 0.03
    assert point.degradation == pytest.approx(point.degradation_point + 0.03, rel=1e-12)
    assert (bound.priced_at, point.priced_at, bound.confidence) == ("upper_bound", "estimate", 0.95)
    # Eq. 4 at the bound, by hand: L * C * T * (1 - D)^2 with L = 1, C = 4, T = 1 h
    assert bound.price == pytest.approx(4 * (1 - bound.degradation_high) ** 2, rel=1e-12)
    assert bound.price < point.price and bound.price + bound.dividend == pytest.approx(bound.standard_price)
    # the half-width is t(0.975, 59) standard errors of the estimate, plus the bias and short-sample margins
    result = filtered_degradation(blocks, estimator=BOUND.estimator)
    half = t_quantile(0.975, 59) * result.standard_error + 0.01 + 0.05 * result.degradation + 0.03
    assert (bound.interval_margin_abs, bound.interval_margin_rel) == (0.01, 0.05)
    assert bound.degradation_high - bound.degradation_point == pytest.approx(half, rel=1e-9)


def test_the_bias_margin_widens_the_t_interval_by_hand():
    """D = 0.1 from 20 blocks with SE 0.01: t(0.975, 19) = 2.093 (tables), so the half-width is
    0.02093 + 0.01 + 0.05 x 0.1 = 0.03593; with too few blocks the prior's upper end is at least
    D + m (0.3 + 0.01 + 0.015 = 0.325 above a prior of 0.25)."""
    def result(d: float, blocks: int) -> DegradationResult:
        return DegradationResult(EstimateStatus.OK, d, d, d, blocks, 0, corrected=d, estimator=REFILL_CORRECTED,
                                 standard_error=0.01, interval_blocks=blocks)

    iv = degradation_interval(result(0.1, 20), 0.95)
    assert (iv.low, iv.high) == pytest.approx((0.1 - 0.03593, 0.1 + 0.03593), abs=2e-5)
    bare = degradation_interval(result(0.1, 20), 0.95, margin_abs=0.0, margin_rel=0.0)
    assert iv.high - bare.high == pytest.approx(0.015, abs=1e-12) and bare.low - iv.low == pytest.approx(0.015)
    prior = degradation_interval(result(0.3, MIN_INTERVAL_BLOCKS - 1), 0.95, prior_high=0.25)
    assert (prior.method, prior.low, prior.high) == (PRIOR, 0.0, pytest.approx(0.325))
    assert degradation_interval(result(0.01, MIN_INTERVAL_BLOCKS - 1), 0.95, prior_high=0.25).high == 0.25
    # no estimate at all: no estimator, so no margin (a site's prior_high = 0 gives no discount from nothing)
    for status in (EstimateStatus.NO_BLOCKS, EstimateStatus.NO_ACCEPTED_BLOCKS):
        none = DegradationResult(status, 0.0, None, None, 0, 0, estimator=REFILL_CORRECTED)
        assert degradation_interval(none, 0.95, prior_high=0.0) == Interval(0.0, 0.0, PRIOR, 0)
    with pytest.raises(ValueError, match="margin_rel"):
        degradation_interval(result(0.1, 20), 0.95, margin_rel=-0.1)


def test_a_charge_before_the_margin_is_audited_without_one_and_a_sites_margin_is_audited_as_recorded():
    rng = np.random.default_rng(12)
    blocks = _blocks(rng, 40, 0.12, 0.02)
    site = PricingPolicy(estimator=REFILL_CORRECTED, price_at_bound=True, margin_abs=0.02, margin_rel=0.1)
    charge = _charge(blocks, site)
    assert policy_of(charge) == site and (charge.interval_margin_abs, charge.interval_margin_rel) == (0.02, 0.1)
    # a version-6 row records no margin: its interval had none, and the audit recomputes it so
    bare = PricingPolicy(estimator=REFILL_CORRECTED, price_at_bound=True, margin_abs=0.0, margin_rel=0.0)
    old = _charge(blocks, bare).model_copy(update={"interval_margin_abs": None, "interval_margin_rel": None,
                                                   "schema_version": 6})
    assert policy_of(old) == bare
    assert _charge(blocks, policy_of(old)).degradation_high == old.degradation_high < charge.degradation_high


def test_time_alone_scales_the_interval_as_it_scales_the_estimate():
    rng = np.random.default_rng(8)
    blocks = _blocks(rng, 40, 0.2, 0.02)
    shared, half_alone = _charge(blocks, BOUND), _charge(blocks, BOUND, alone_us=1_800_000_000)
    for f in ("degradation_point", "degradation_low", "degradation_high"):
        assert getattr(half_alone, f) == pytest.approx(getattr(shared, f) * 0.5, rel=1e-12)


def test_too_few_blocks_price_at_the_stated_prior_never_silently_at_the_standard_price():
    rng = np.random.default_rng(9)
    few = _charge(_blocks(rng, MIN_INTERVAL_BLOCKS - 1, 0.05, 0.01), BOUND)
    assert few.interval_method == PRIOR and few.estimate_status is EstimateStatus.OK
    assert (few.degradation_low, few.degradation_high) == (0.0, 0.25) and few.degradation == 0.25
    assert few.price == pytest.approx(4 * 0.75**2) and few.prior_degradation_high == 0.25
    enough = _charge(_blocks(rng, MIN_INTERVAL_BLOCKS, 0.05, 0.01), BOUND)
    assert enough.interval_method == T_RATIO and enough.degradation_high < 0.25


def test_a_job_that_shared_without_any_block_gets_the_prior_over_its_shared_time_only():
    end = job_event("j1", JobState.ENDED, cores=4, run_s=3600)
    [shared] = fold_messages(as_messages([left("j1", "n1", 0, -1, alone_us=2_700_000_000)], IPC)
                             + as_messages([end], LIFE), BOUND)
    assert shared.estimate_status is EstimateStatus.NO_BLOCKS and shared.interval_method == PRIOR
    assert shared.degradation == pytest.approx(0.25 * 0.25)  # the prior over the quarter it shared
    [alone] = fold_messages(as_messages([left("j1", "n1", 0, -1, alone_us=3_600_000_000)], IPC)
                            + as_messages([end], LIFE), BOUND)
    assert alone.degradation == 0.0 and alone.price == alone.standard_price == 4.0


def test_a_job_that_made_no_progress_alone_pays_the_standard_price():
    idle = [block(0.0, 0.0, 0.0, cycle=i) for i in range(12)]
    c = _charge(idle, BOUND)
    assert c.interval_method == NO_INTERVAL and c.degradation == 0.0 and c.price == c.standard_price


def _archived_job(tmp_path, seed: int, policy: PricingPolicy) -> tuple:
    """A 30-block job archived as the archive sink would, and its charge under ``policy``."""
    records = [batch(*_blocks(np.random.default_rng(seed), 30, 0.1, 0.02)), left("j1", "n1", 30, 29),
               job_event("j1", JobState.ENDED, cores=4)]
    archive, _, _ = archive_records(tmp_path, records)
    [c] = fold_messages(as_messages(records[:2], IPC) + as_messages(records[2:], LIFE), policy)
    return archive, c


def test_the_audit_recomputes_the_interval_and_refuses_an_edited_one(tmp_path):
    archive, c = _archived_job(tmp_path, 4, BOUND)
    assert policy_of(c) == BOUND
    for name, update in (("good", {}), ("edited", {"degradation_high": c.degradation_high + 0.01}),
                         ("claimed", {"confidence": 0.99})):  # the numbers are not the 99% interval
        path = tmp_path / f"{name}.duckdb"
        row = c.model_copy(update=update)
        with Ledger(path) as ledger:
            ledger.append([(row, encode(row), 0, 0)])
        for fast in (True, False):
            assert audit(archive, path, BOUND, fast=fast).ok is (name == "good"), (name, fast)


def test_a_charge_made_before_intervals_is_audited_at_its_point_estimate(tmp_path):
    """A version-5 row carries no interval and was priced at its estimate: the audit prices it so."""
    archive, then = _archived_job(tmp_path, 6, replace(POINT, short_margin=0.0))  # a version-5 build had none
    v5 = as_version(then, 5)  # as a version-5 writer wrote it: without every field added since
    row = decode_model(Charge, v5)
    assert row.priced_at == "estimate" and row.degradation_high is None
    path = tmp_path / "v5.duckdb"
    with Ledger(path) as ledger:
        ledger.append([(row, v5, 0, 0)])
    for fast in (True, False):
        assert audit(archive, path, BOUND, fast=fast).ok


def test_a_job_corrected_after_the_upgrade_audits_each_revision_under_the_policy_it_was_priced_by(tmp_path):
    """Revision 0 priced by a schema-6 build (no margin), revision 1 after the upgrade (the default
    margin): the audit, fast path and reference fold alike, recomputes each under its own policy.
    (It recomputed both under the newest row's, and revision 0's interval ends mismatched.)"""
    from datetime import timedelta

    from factories import T0

    old_build, new_build = PricingPolicy(margin_abs=0.0, margin_rel=0.0, short_margin=0.0), PricingPolicy()
    blocks = _blocks(np.random.default_rng(4), 30, 0.1, 0.02)
    end = job_event("j1", JobState.ENDED, cores=4)
    fix = end.model_copy(update={"event_id": "fix", "end_time": T0 + timedelta(seconds=1800),
                                 "event_time": T0 + timedelta(seconds=3700)})
    records = [batch(*blocks), left("j1", "n1", 30, 29), end, fix]
    archive, _, _ = archive_records(tmp_path, records)
    ipc = as_messages(records[:2], IPC)
    [rev0] = fold_messages(ipc + as_messages([end], LIFE), old_build)
    v6 = as_version(rev0, 6)
    [rev1] = [c for c in fold_messages(ipc + as_messages([end, fix], LIFE), new_build) if c.revision == 1]
    with Ledger(tmp_path / "upgraded.duckdb") as ledger:  # archive_records wrote its own ledger.duckdb
        ledger.append([(decode_model(Charge, v6), v6, 0, 0), (rev1, encode(rev1), 0, 1)])
    for fast in (True, False):
        result = audit(archive, tmp_path / "upgraded.duckdb", new_build, fast=fast)
        assert result.ok and result.charges_checked == result.matches == 2, (fast, result.mismatches)
    # and a row that really differs is still found
    forged = rev1.model_copy(update={"revision": 0, "price": rev1.price * 0.5})
    with Ledger(tmp_path / "forged.duckdb") as ledger:
        ledger.append([(forged, encode(forged), 0, 0), (rev1, encode(rev1), 0, 1)])
    assert not audit(archive, tmp_path / "forged.duckdb", new_build, fast=False).ok


def _mixed(levels: list[tuple], d: float = 0.1, status: EstimateStatus = EstimateStatus.OK,
           estimator: str = MIXED_S) -> DegradationResult:
    """A mixed_s estimate with these (S, accepted blocks, used[, blocks Alg. 4 rejected]) levels."""
    full = [(lv[0], lv[1], lv[2], lv[3] if len(lv) > 3 else 0) for lv in levels]
    n, r = sum(b for _, b, _, _ in full), sum(x for *_, x in full)
    return DegradationResult(status, d, d, d, n, r, corrected=d, estimator=estimator, standard_error=0.01,
                             interval_blocks=n, levels=tuple(LevelResult(s, b, x, d, 0.01, u) for s, b, u, x in full))


def test_short_samples_are_unchecked_unless_a_longer_s_has_the_blocks_to_check_them():
    """By hand, at the default 3.2 ms: a longer S checks the shorter ones with MIXED_N_MIN = 4 accepted
    blocks (combine_levels' fewest); fewer, or none, or one it left out, leave them unchecked."""
    short = 3200
    assert short_samples_unchecked(_mixed([(3200, 30, True)]), short)  # the fixed 3.2 ms schedule
    assert short_samples_unchecked(_mixed([(3200, 6, True), (51200, 3, True)]), short)  # 3 long blocks: too few
    assert short_samples_unchecked(_mixed([(3200, 6, True), (12800, 3, True), (51200, 3, True)]), short)
    assert short_samples_unchecked(_mixed([(3200, 20, True), (51200, 0, False)]), short)  # all rejected
    # the shorter S are compared with the longest only: a middle level's blocks check nothing
    assert short_samples_unchecked(_mixed([(3200, 6, True), (12800, 6, True), (51200, 1, True)]), short)
    assert not short_samples_unchecked(_mixed([(3200, 6, True), (51200, 4, True)]), short)  # checked
    assert not short_samples_unchecked(_mixed([(3200, 6, False), (51200, 5, True)]), short)  # long only
    assert not short_samples_unchecked(_mixed([(12800, 9, True)]), short)  # no short sample behind it
    assert not short_samples_unchecked(_mixed([(0, 30, True)]), short)  # S unknown (folded before S was kept)
    assert not short_samples_unchecked(_mixed([(3200, 30, True)], estimator=REFILL_CORRECTED), short)
    assert not short_samples_unchecked(_mixed([], status=EstimateStatus.NO_BLOCKS), short)
    assert short_samples_unchecked(_mixed([(6400, 8, True)]), 6400)  # a site's own threshold
    assert short_sample_margin(_mixed([(3200, 30, True)]), 0.02, short) == 0.02
    assert short_sample_margin(_mixed([(3200, 6, True), (51200, 4, True)]), 0.02, short) == 0.0
    with pytest.raises(ValueError, match="short-sample margin"):
        short_sample_margin(_mixed([(3200, 30, True)]), 1.5, short)
    with pytest.raises(ValueError, match="short-sample margin"):
        short_sample_widening(_mixed([(3200, 30, True)]), -0.1, short)
    # a checked estimate gets neither, its long samples taken or not
    checked = _mixed([(3200, 6, True), (51200, 4, True, 3)])
    assert (short_sample_margin(checked, 0.02, short), short_sample_widening(checked, 0.02, short)) == (0.0, 0.0)


@pytest.mark.parametrize(("levels", "untaken"), [
    ([(3200, 30, True)], True),  # the fixed 3.2 ms schedule: never a long sample
    ([(3200, 6, True), (51200, 3, True)], True),  # three long blocks, all accepted: too short for a fourth
    ([(3200, 6, True), (12800, 1, True), (51200, 2, True)], True),  # three, over two longer S
    ([(3200, 6, True), (51200, 3, True, 1)], False),  # four taken, one rejected by Alg. 4
    ([(3200, 20, True), (51200, 0, False, 6)], False),  # six taken, every one rejected
    ([(3200, 6, True), (12800, 0, False, 2), (51200, 1, True, 1)], False),  # four taken over two S
    ([(3200, 20, True, 40)], True),  # rejected short blocks are not long ones
])
def test_only_unchecked_short_samples_whose_long_ones_were_never_taken_are_priced_with_the_margin(levels, untaken):
    """By hand: every estimate here is unchecked (no longer S with 4 accepted blocks), so its interval
    widens by the margin; its price carries it only where fewer than MIXED_N_MIN = 4 blocks were taken
    at S > 3.2 ms, counting those Alg. 4 rejected. A job that took its long samples and had them
    rejected was measured there (Alg. 4's selection then biases its short blocks high)."""
    result = _mixed(levels)
    assert short_samples_unchecked(result, 3200) and long_samples_untaken(result, 3200) is untaken
    assert short_sample_widening(result, 0.02, 3200) == 0.02
    assert short_sample_margin(result, 0.02, 3200) == (0.02 if untaken else 0.0)


def test_the_short_sample_margin_raises_the_price_and_the_interval_by_hand():
    """D = 0.1 from 20 blocks with SE 0.01, all at 3.2 ms: the interval's half-width is t(0.975, 19)
    x 0.01 + 0.01 + 0.05 x 0.1 + 0.02 = 0.05593 with a margin of 2 points; a job of such blocks, alone
    for a quarter of its hour, is priced at D = (D_shared + 0.03) x 0.75 under the default margin
    and Eq. 4 (4 x (1 - D)^2), its point estimate staying D_shared x 0.75."""
    result = _mixed([(3200, 20, True)])
    iv = degradation_interval(result, 0.95, short=0.02)
    assert (iv.low, iv.high) == pytest.approx((0.1 - 0.05593, 0.1 + 0.05593), abs=2e-5)
    rng = np.random.default_rng(21)
    c = _charge(_blocks(rng, 30, 0.1, 0.02), POINT, alone_us=900_000_000)
    assert (c.short_margin, c.short_sample_us, c.short_margin_applied) == (0.03, 3200, 0.03)
    assert c.degradation == pytest.approx((c.degradation_shared + 0.03) * 0.75, rel=1e-12)
    assert c.degradation_point == pytest.approx(c.degradation_shared * 0.75, rel=1e-12)  # the estimate itself
    assert c.price == pytest.approx(4 * (1 - c.degradation) ** 2, rel=1e-12)
    none = _charge(_blocks(rng, 30, 0.1, 0.02), replace(POINT, short_margin=0.0), alone_us=900_000_000)
    assert none.short_margin_applied == 0.0 and none.degradation == pytest.approx(none.degradation_point, rel=1e-12)


def test_both_audits_recompute_the_short_sample_margin_and_a_row_from_before_it(tmp_path):
    """The default prices a 3.2 ms-only job with the margin; both audits recompute it, refuse a row
    that claims no margin over the same numbers, and audit a version-9 row (priced by a build without
    the margin) under what it records: no margin."""
    archive, c = _archived_job(tmp_path, 5, POINT)
    _, then = _archived_job(tmp_path / "old", 5, replace(POINT, short_margin=0.0))
    assert c.short_margin_applied == 0.03 and c.price < then.price
    v9 = as_version(then, 9)
    assert policy_of(decode_model(Charge, v9)).short_margin == 0.0 and policy_of(c) == POINT
    for name, row, raw in (("good", c, encode(c)), ("claimed", c.model_copy(update={"short_margin": 0.0}), None),
                           ("v9", decode_model(Charge, v9), v9)):
        path = tmp_path / f"{name}.duckdb"
        with Ledger(path) as ledger:
            ledger.append([(row, raw if raw is not None else encode(row), 0, 0)])
        for fast in (True, False):
            assert audit(archive, path, POINT, fast=fast).ok is (name != "claimed"), (name, fast)


def test_a_job_whose_long_samples_were_rejected_has_a_wider_interval_and_no_margin_in_its_price():
    """Twelve 3.2 ms blocks and four 51.2 ms blocks of which Alg. 4 rejects two (the job's solo IPC
    during the window below the IPC around it): the long S was probed, so the price is the point
    estimate's, the same as with no short-sample margin at all; the estimate is still unchecked (two
    accepted long blocks), so its interval is wider by the margin at both ends. With all four
    accepted, it is checked: neither."""
    from factories import batch as batch_of

    from nodeshare.schemas import CounterSource

    rng = np.random.default_rng(41)
    short = _blocks(rng, 12, 0.1, 0.02)
    good = [b.model_copy(update={"cycle": 100 + i, "sample_us": 51200, "counter": CounterSource.SIMULATED})
            for i, b in enumerate(_blocks(rng, 4, 0.1, 0.02))]
    low = [block(1.1, 1.0, 1.1, cycle=200 + i).model_copy(update={"sample_us": 51200,
                                                                  "counter": CounterSource.SIMULATED})
           for i in range(2)]
    end = job_event("j1", JobState.ENDED, cores=4)

    def charge(longs: list, policy: PricingPolicy) -> Charge:
        ipc = [batch_of(*short), batch_of(*longs, seq=1), left("j1", "n1", 12 + len(longs), 201)]
        [c] = fold_messages(as_messages(ipc, IPC) + as_messages([end], LIFE), policy)
        return c

    none = replace(POINT, short_margin=0.0)
    rejected, bare = charge([*good[:2], *low], POINT), charge([*good[:2], *low], none)
    assert (rejected.blocks_used, rejected.blocks_rejected) == (14, 2) and rejected.short_margin_applied == 0.0
    assert (rejected.degradation, rejected.price) == (bare.degradation, bare.price)
    assert rejected.degradation == rejected.degradation_point
    assert rejected.degradation_high - bare.degradation_high == pytest.approx(DEFAULT_SHORT_MARGIN, abs=1e-12)
    assert bare.degradation_low - rejected.degradation_low == pytest.approx(DEFAULT_SHORT_MARGIN, abs=1e-12)
    checked, plain = charge(good, POINT), charge(good, none)
    assert checked.short_margin_applied == 0.0
    assert (checked.price, checked.degradation_low, checked.degradation_high) == (
        plain.price, plain.degradation_low, plain.degradation_high)


def test_missing_evidence_never_buys_the_short_sample_margin():
    """A job whose fourth long block never arrived is priced without the margin: every rule fails
    toward the higher price (with the block it was checked, no margin). One that arrived with a bad
    value is a bad record, which changes no charge."""
    from factories import batch as batch_of

    from nodeshare.schemas import CounterSource, ShutterBlock

    def at(b: ShutterBlock, s_us: int) -> ShutterBlock:
        return b.model_copy(update={"sample_us": s_us, "counter": CounterSource.SIMULATED})

    rng = np.random.default_rng(31)
    short = _blocks(rng, 12, 0.1, 0.02)
    long = [at(b.model_copy(update={"cycle": 100 + i}), 51200) for i, b in enumerate(_blocks(rng, 4, 0.1, 0.02))]
    end = job_event("j1", JobState.ENDED, cores=4)

    def charge(longs: list, sent: int, policy: PricingPolicy = POINT) -> Charge:
        ipc = [batch_of(*short), batch_of(*longs, seq=1), left("j1", "n1", sent, 103)]
        [c] = fold_messages(as_messages(ipc, IPC) + as_messages([end], LIFE), policy)
        return c

    assert charge(long, 16).short_margin_applied == 0.0  # checked by its 4 long blocks
    assert charge(long[:3], 15).short_margin_applied == 0.03  # three long blocks, all it sent: unchecked
    lost = charge(long[:3], 16)  # the fourth was sent and never arrived
    assert lost.evidence_problems and lost.short_margin_applied == 0.0
    assert lost.degradation == lost.degradation_point
    # nor a wider interval (priced at the bound, its upper end would lower the price)
    bare = charge(long[:3], 16, replace(POINT, short_margin=0.0))
    assert (lost.degradation_low, lost.degradation_high) == (bare.degradation_low, bare.degradation_high)
    assert charge(long[:3], 16, BOUND).price == charge(long[:3], 16, replace(BOUND, short_margin=0.0)).price
    bad = long[3].model_copy(update={"during": tuple(x.model_copy(update={"cycles": 0}) for x in long[3].during)})
    # the fourth arrived with a bad value: dead-lettered and, like every bad record, changing no charge
    # (test_bad_input): priced as if it had never been sent, three long blocks, the margin
    refused, three = charge([*long[:3], bad], 16), charge(long[:3], 15)
    assert refused.blocks_used == 15 and (refused.degradation, refused.price) == (three.degradation, three.price)
    assert refused.short_margin_applied == 0.03


def _two_levels(d_short: float, se_short: float, n_short: int, d_long: float, se_long: float | None,
                n_long: int) -> DegradationResult:
    """A mixed_s estimate of 3.2 ms and 51.2 ms levels, combined as the fold combines them."""
    from nodeshare.streams.core.shutter_policy import combine_levels

    levels = {3200: (n_short, d_short, se_short), 51200: (n_long, d_long, math.inf if se_long is None else se_long)}
    d, se, used = combine_levels(levels)
    return DegradationResult(EstimateStatus.OK, d, d, d, n_short + n_long, 0, corrected=d, estimator=MIXED_S,
                             standard_error=se, interval_blocks=sum(levels[s][0] for s in used),
                             levels=(LevelResult(3200, n_short, 0, d_short, se_short, 3200 in used),
                                     LevelResult(51200, n_long, 0, d_long, se_long, True)))


def test_kept_short_samples_that_read_higher_than_the_trusted_level_lower_the_interval_by_hand():
    """36 blocks at 3.2 ms read D = 0.10 (SE 0.004), 4 at 51.2 ms read 0.06 (SE 0.006). The short level
    is higher, so combine_levels keeps it: weights 62,500 and 27,777.8 give D = 0.087692, SE 0.0033282.
    It is higher than the trusted level by 0.04, more than 1 x hypot(0.006, 0.004) + 0.002 = 0.009211,
    so the interval's lower end reaches the 51.2 ms level's own: 0.06 - (t(0.975, 3) = 3.182446 x 0.006
    + 0.01 + 0.05 x 0.06) = 0.027905, not the combined 0.087692 - (t(0.975, 39) = 2.0227 x 0.0033282
    + 0.01 + 0.05 x 0.087692) = 0.066575. The upper end, the point and so the price are unchanged."""
    r = _two_levels(0.10, 0.004, 36, 0.06, 0.006, 4)
    assert r.degradation == pytest.approx(0.087692, abs=1e-6) and r.standard_error == pytest.approx(0.0033282, abs=1e-7)
    assert trusted_level_below({3200: (36, 0.10, 0.004), 51200: (4, 0.06, 0.006)}) == (0.06, 0.006, 4)
    got = degradation_interval(r)
    assert got.low == pytest.approx(0.027905, abs=1e-6)
    assert trusted_level_low(r, 0.975) == pytest.approx(got.low, abs=1e-15)
    plain = 0.087692 - (2.0227 * 0.0033282 + 0.01 + 0.05 * 0.087692)
    assert plain == pytest.approx(0.066575, abs=1e-6)
    assert got.high == pytest.approx(0.087692 + (0.087692 - 0.066575), abs=1e-5)


@pytest.mark.parametrize(("d_long", "se_long", "n_long", "why"), [
    (0.095, 0.006, 4, "within noise: 0.005 < 0.009211"),
    (0.0915, 0.006, 4, "within noise and tol: 0.0085 < 1 x 0.007211 + 0.002"),
    (0.06, None, 1, "one long block is tested at z_few: 0.04 < 2 x hypot(0.024, 0.004) + 0.002 = 0.0507"),
    (0.14, 0.006, 10, "the short level is lower: left out, the estimate is the trusted level's alone"),
])
def test_the_interval_is_symmetric_where_the_levels_agree_or_the_short_one_was_left_out(d_long, se_long, n_long, why):
    r = _two_levels(0.10, 0.004, 36, d_long, se_long, n_long)
    assert trusted_level_low(r, 0.975) is None, why
    got = degradation_interval(r)
    assert got.high - r.degradation == pytest.approx(r.degradation - got.low, abs=1e-12), why


def test_a_single_long_block_below_the_short_ones_takes_the_lower_end_to_zero():
    """One 51.2 ms block (its error borrowed: 0.004 x sqrt(36) = 0.024) at 0.02 against 36 short
    blocks at 0.10: the test is at z_few = 2 (0.08 > 2 x hypot(0.024, 0.004) + 0.002 = 0.0507),
    and one degree of freedom reaches below zero: the interval starts at 0."""
    r = _two_levels(0.10, 0.004, 36, 0.02, None, 1)
    d_top, se_top, n_top = trusted_level_below({3200: (36, 0.10, 0.004), 51200: (1, 0.02, math.inf)})
    assert (d_top, n_top) == (0.02, 1) and se_top == pytest.approx(0.024, abs=1e-15)
    assert degradation_interval(r).low == 0.0
    assert degradation_interval(r).high < 0.25


def test_the_lower_end_is_the_lower_of_the_two():
    """Where the trusted level's own lower end is above the combined interval's, the combined one
    stands: 100 short blocks at 0.10 (SE 0.0005) and 3 long ones at 0.09 (too few for a spread of
    their own: 0.005 / sqrt(3) = 0.002887, tested at z_few = 2: 0.01 > 0.007865), an unchecked
    estimate whose interval is 3 points wider: its lower end 0.0537 is below the trusted level's
    0.09 - (4.3027 x 0.002887 + 0.01 + 0.0045) = 0.0631."""
    r = _two_levels(0.10, 0.0005, 100, 0.09, 0.004, 3)
    below = trusted_level_low(r, 0.975)
    assert below == pytest.approx(0.09 - (4.302653 * 0.005 / math.sqrt(3) + 0.0145), abs=1e-6)
    got = degradation_interval(r, short=DEFAULT_SHORT_MARGIN)
    half = t_quantile(0.975, r.interval_blocks - 1) * r.standard_error + 0.01 + 0.05 * r.degradation + 0.03
    assert got.low == pytest.approx(r.degradation - half, abs=1e-15) and got.low < below - 0.009


def test_a_charge_whose_short_blocks_read_high_carries_the_trusted_levels_lower_end_and_both_audits_agree(tmp_path):
    """Through the fold: 30 short blocks of D 0.15 and 6 long blocks of D 0.05 (the long blocks left
    to Alg. 4 as they are). The charge's lower end is the long level's own, the price the point's;
    the archive audits clean, and a charge whose lower end is edited back up is refused."""
    from factories import batch as batch_of

    rng = np.random.default_rng(5)
    short = _blocks(rng, 30, 0.15, 0.01)
    longs = [b.model_copy(update={"cycle": 100 + i, "sample_us": 51200})
             for i, b in enumerate(_blocks(rng, 6, 0.05, 0.01))]
    ipc = [batch_of(*short), batch_of(*longs, seq=1), left("j1", "n1", 36, 201)]
    end = job_event("j1", JobState.ENDED, cores=4)
    [c] = fold_messages(as_messages(ipc, IPC) + as_messages([end], LIFE), POINT)
    levels = {lv.sample_us: lv for lv in c.levels}
    assert levels[3200].used and levels[3200].degradation > levels[51200].degradation + 0.05
    lo_long = levels[51200].degradation - (t_quantile(0.975, levels[51200].blocks_used - 1)
                                           * levels[51200].standard_error + 0.01 + 0.05 * levels[51200].degradation)
    assert c.degradation_low == pytest.approx(max(0.0, lo_long), abs=1e-12)
    assert c.degradation_point - c.degradation_low > c.degradation_high - c.degradation_point + 0.02
    assert c.degradation == c.degradation_point
    (archive, _, _), path = archive_records(tmp_path, [*ipc, end]), tmp_path / "ledger.duckdb"
    with Ledger(path) as ledger:
        ledger.append([(c, encode(c), 0, 0)])
    for fast in (True, False):
        assert audit(archive, path, POINT, fast=fast).ok, fast
    symmetric = c.degradation_point - (c.degradation_high - c.degradation_point)
    edited = c.model_copy(update={"degradation_low": symmetric})
    with Ledger(tmp_path / "edited.duckdb") as ledger:
        ledger.append([(edited, encode(edited), 0, 0)])
    for fast in (True, False):
        assert not audit(archive, tmp_path / "edited.duckdb", POINT, fast=fast).ok, fast
    # a version-9 row, priced by a build without the rule: its symmetric end is what it records, and
    # what both audits recompute for it (the rule is selected by the schema-10 fields it lacks)
    [then] = fold_messages(as_messages(ipc, IPC) + as_messages([end], LIFE),
                           replace(POINT, short_margin=0.0, trusted_level_low=False))
    assert then.degradation_low == pytest.approx(symmetric, abs=1e-12) and then.price == c.price
    v9 = as_version(then, 9)
    assert not policy_of(decode_model(Charge, v9)).trusted_level_low and policy_of(c) == POINT
    with Ledger(tmp_path / "v9.duckdb") as ledger:
        ledger.append([(decode_model(Charge, v9), v9, 0, 0)])
    for fast in (True, False):
        assert audit(archive, tmp_path / "v9.duckdb", POINT, fast=fast).ok, fast
