"""POPPA Eq. 1-4 and Eq. 9-10 on hand-computed numbers."""

import pytest

from nodeshare.streams.core.pricing import (
    alone_time,
    fair_charge,
    job_degradation,
    poppa_price,
    solo_time,
    standard_price,
)
from nodeshare.streams.core.shutter_overhead import dilated_run_time, sleep_fraction


def test_eq1_standard_price():
    # L = 2 SU per core-hour, C = 16 cores, T = 3 h
    assert standard_price(2.0, 16, 3 * 3600) == 96.0


def test_eq3_solo_time():
    assert solo_time(10_800, 0.25) == 8_100


def test_eq4_by_hand():
    # T_solo = 0.75 * 3 h = 2.25 h; P_solo = 2 * 16 * 2.25 = 72; P = (T_solo / T_co) * P_solo = 0.75 * 72 = 54
    assert poppa_price(2.0, 16, 10_800, 0.25) == 54.0
    c = fair_charge(2.0, 16, 10_800, 0.25)
    assert (c.standard_price, c.solo_time_s, c.solo_price, c.price, c.dividend) == (96.0, 8100.0, 72.0, 54.0, 42.0)


def test_eq4_equals_its_expanded_form():
    # L * (T_solo / T_co) * C * T_solo with T_solo = (1 - D) T_co, i.e. L C T_co (1 - D)^2
    L, C, T, D = 1.7, 24, 5000.0, 0.137
    t_solo = (1 - D) * T
    assert poppa_price(L, C, T, D) == pytest.approx(L * (t_solo / T) * C * t_solo / 3600, rel=1e-14)


def test_no_degradation_means_the_standard_price():
    c = fair_charge(1.0, 8, 7200, 0.0)
    assert c.price == c.standard_price == 16.0 and c.dividend == 0.0


def test_price_stays_between_zero_and_the_standard_price():
    for d in (0.0, 0.01, 0.5, 0.99, 1.0):
        c = fair_charge(3.0, 4, 1000, d)
        assert 0.0 <= c.price <= c.standard_price
        assert c.price + c.dividend == pytest.approx(c.standard_price)


@pytest.mark.parametrize("d", [-0.01, 1.01, float("nan")])
def test_degradation_outside_0_1_is_refused(d):
    with pytest.raises(ValueError, match="degradation"):
        fair_charge(1.0, 1, 1.0, d)


def test_eq9_sleep_fraction_by_hand():
    # n = 2, S = 3.2 ms, P = 200 ms: Z = 1 * 0.0032 / (2 * (0.0096 + 0.2)) = 0.0032 / 0.4192
    assert sleep_fraction(2, 0.0032, 0.2) == pytest.approx(0.0032 / 0.4192, rel=1e-12)
    assert sleep_fraction(1, 0.0032, 0.2) == 0.0  # a lone job is never paused
    with pytest.raises(ValueError, match="at least 1"):  # no job: refused, not a division by zero
        sleep_fraction(0, 0.0032, 0.2)


def test_eq10_dilation_matches_the_papers_closed_form():
    n, S, P, T = 4, 0.0256, 0.2, 100.0
    closed = T * n * (3 * S + P) / (2 * n * S + n * P + S)
    assert dilated_run_time(T, n, S, P) == pytest.approx(closed, rel=1e-12)
    assert dilated_run_time(100.0, 2, 0.0032, 0.2) == pytest.approx(100 * 0.4192 / 0.416, rel=1e-12)


def test_rate_functions_by_hand():
    # L = 2, C = 16, T_co = 3 h, D = 0.25: SOP 96, P_solo 72, POPPA 54
    from nodeshare.streams.core.pricing import POPPA_EQ4, SOLO_BASELINE, STANDARD

    assert fair_charge(2.0, 16, 10_800, 0.25, POPPA_EQ4).price == 54.0
    assert fair_charge(2.0, 16, 10_800, 0.25, SOLO_BASELINE).price == 72.0
    sop = fair_charge(2.0, 16, 10_800, 0.25, STANDARD)
    assert sop.price == sop.standard_price == 96.0 and sop.dividend == 0.0


def test_unknown_rate_function_is_refused():
    with pytest.raises(ValueError, match="unknown rate function"):
        fair_charge(1.0, 1, 1.0, 0.1, "free_lunch")


def test_pause_credit_by_hand():
    # L = 2, C = 16, T_co = 3 h, 0.5 h paused by shutters, D = 0.25:
    # billed 2.5 h; T_solo = 0.75 * 2.5 = 1.875 h; P_solo = 2 * 16 * 1.875 = 60;
    # Eq. 4 keeps the real T_co in its ratio: price = 2 * (1.875 / 3) * 16 * 1.875 = 37.5
    c = fair_charge(2.0, 16, 10_800, 0.25, pause_credit_s=1_800)
    assert (c.standard_price, c.billed_time_s, c.solo_time_s, c.solo_price, c.price, c.dividend) == (
        96.0, 9_000.0, 6_750.0, 60.0, 37.5, 58.5)
    # the other rate functions: solo_baseline charges P_solo, sop the whole run
    assert fair_charge(2.0, 16, 10_800, 0.25, "solo_baseline", pause_credit_s=1_800).price == 60.0
    assert fair_charge(2.0, 16, 10_800, 0.25, "sop", pause_credit_s=1_800).price == 96.0


def test_pause_credit_with_the_true_degradation_gives_the_oracle_price():
    # A job of 1000 s of work runs 10% slower next to its co-runner and is paused 20 s by
    # shutters: T_co = 1000 / 0.9 + 20. Measuring D = 0.1 exactly, nodeshare charges the
    # oracle's price L * C * T_solo^2 / T_co (Eq. 4 with the true times).
    t_co = 1000 / 0.9 + 20
    c = fair_charge(3.6, 1, t_co, 0.1, pause_credit_s=20)
    assert c.solo_time_s == pytest.approx(1000.0, rel=1e-12)
    assert c.price == pytest.approx(3.6 * 1000**2 / t_co / 3600, rel=1e-12)


def test_pause_credit_cannot_make_a_price_negative():
    c = fair_charge(1.0, 4, 100.0, 0.1, pause_credit_s=500.0)
    assert c.billed_time_s == 0.0 and c.price == 0.0 and c.dividend == c.standard_price
    with pytest.raises(ValueError, match="pause credit"):
        fair_charge(1.0, 4, 100.0, 0.1, pause_credit_s=-1.0)


def test_time_alone_by_hand():
    # A job of 600 s of work: 200 s alone (undisturbed), then 400 s of work at 80% speed next to a
    # co-runner, i.e. 500 s shared. T = 700 s, T_solo = 600 s, true D = 1/7. The blocks (taken only
    # while shared) measure D_shared = 0.2; weighted by the shared time 500/700: 0.2 * 5/7 = 1/7.
    d = job_degradation(0.2, 200.0, 700.0)
    assert d == pytest.approx(1 / 7, rel=1e-15)
    assert fair_charge(1.0, 1, 700.0, d).solo_time_s == pytest.approx(600.0, rel=1e-12)
    assert job_degradation(0.2, 0.0, 700.0) == 0.2  # never alone: the shared estimate is the job's
    assert job_degradation(0.2, 900.0, 700.0) == 0.0  # alone throughout (capped at the billed time)
    assert job_degradation(0.2, 10.0, 0.0) == 0.2  # nothing billed: nothing to weigh


def test_time_alone_on_every_node_is_bounded_from_below_by_hand():
    assert alone_time([250.0], 1, 700.0) == 250.0  # one node: exact
    assert alone_time([900.0], 1, 700.0) == 700.0  # never more than the billed time
    # two nodes, T = 3600: alone 3000 s on one and 1000 s on the other overlap at least 400 s
    assert alone_time([3000.0, 1000.0], 2, 3600.0) == 400.0
    assert alone_time([1800.0, 1800.0], 2, 3600.0) == 0.0  # could be disjoint halves
    assert alone_time([3600.0], 2, 3600.0) == 0.0  # a node that reported nothing counts as never alone
    with pytest.raises(ValueError, match="at least one node"):
        alone_time([], 0, 10.0)


def test_time_alone_on_three_nodes_and_at_the_edges_by_hand():
    """(Mutations cosmic-ray left alive: (nodes - 1) -> (nodes >> 1), equal for 1 and 2 nodes; the
    clamps at 0 read as 1 or -1.)"""
    # three nodes, T = 1000: alone 900, 800 and 700 s overlap at least 2400 - 2 x 1000 = 400 s
    assert alone_time([900.0, 800.0, 700.0], 3, 1000.0) == 400.0
    assert alone_time([0.5], 1, 0.6) == 0.5  # under a second: no clamp at 1 s
    assert alone_time([0.5], 1, -3.0) == 0.0  # a negative billed time counts as none
    assert alone_time([-0.5, 1000.0], 2, 1000.0) == 0.0  # a negative report counts as never alone, not as -0.5


def test_zero_or_negative_times_price_nothing_and_keep_the_shared_estimate():
    """(Mutations: the guards `run_time_s <= 0` and `billed_time_s <= 0` as `== 0`, `< 0`, `<= 1`,
    `<= -1`, and their `return 0.0` as +-1.)"""
    assert poppa_price(1.0, 4, 0.0, 0.1) == 0.0 and poppa_price(1.0, 4, -0.5, 0.1) == 0.0
    # half a second of 4 cores at 10%: (0.9 x 0.5)^2 / 0.5 x 4 / 3600
    assert poppa_price(1.0, 4, 0.5, 0.1) == pytest.approx(0.9 * 0.9 * 0.5 * 4 / 3600, rel=1e-12)
    assert job_degradation(0.3, 0.2, -0.5) == 0.3 and job_degradation(0.3, 0.2, 0.0) == 0.3
    assert job_degradation(0.3, 0.25, 0.5) == pytest.approx(0.3 * 0.5, rel=1e-12)  # half of half a second alone


def test_charge_amounts_are_immutable():
    import dataclasses

    amounts = fair_charge(1.0, 1, 700.0, 0.1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        amounts.price = 0.0  # type: ignore[misc]
