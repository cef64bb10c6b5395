"""POPPA Alg. 4, Eq. 7-8 and the refill-corrected estimate on hand-computed examples."""

import math
import random

import pytest
from factories import block

from nodeshare.schemas import EstimateStatus
from nodeshare.streams.core.degradation import (
    DEFAULT_DELTA,
    POPPA_ALG4,
    REFILL_CORRECTED,
    UNFILTERED,
    BlockMeans,
    ExactSum,
    block_means,
    estimate_from_totals,
    filtered_degradation,
    passes_filter,
)


def test_delta_default_is_the_papers():
    assert DEFAULT_DELTA == 0.05  # Seed 002, Section 6.3


def test_block_means_average_the_k_samples():
    m = block_means(block((1.0, 1.5), (2.0, 2.5), (0.5, 0.75)))
    assert (m.before, m.during, m.after) == (1.25, 2.25, 0.625)


@pytest.mark.parametrize(
    ("before", "during", "after", "accepted"),
    [
        (1.0, 2.0, 1.0, True),  # textbook: shutter lifted IPC, same phase around it
        (1.0, 2.0, 1.04, True),  # |before - after| = 0.04 < delta
        (1.0, 2.0, 1.05, False),  # |before - after| = 0.05: not strictly below delta (boundary)
        (1.0, 2.0, 1.06, False),  # crosses a phase boundary
        (1.0, 1.0, 0.98, False),  # during == before: not strictly greater
        (1.0, 0.9, 1.0, False),  # shutter lowered IPC: noise
        (0.8, 0.81, 0.79, True),
    ],
)
def test_filter_condition_of_alg4_line3(before, during, after, accepted):
    assert passes_filter(BlockMeans(before, during, after), 0.05) is accepted


def test_filtered_and_unfiltered_estimates_by_hand():
    blocks = [
        block(1.0, 2.0, 1.0, cycle=0),  # accepted: co 1.0, solo 2.0
        block(0.8, 1.0, 0.82, cycle=1),  # accepted: co 0.81, solo 1.0
        block(1.0, 0.9, 1.0, cycle=2),  # rejected: during below before/after
        block(1.0, 2.0, 1.2, cycle=3),  # rejected: |before - after| = 0.2
    ]
    r = filtered_degradation(blocks)
    # Alg. 4: IPC_co = 1.0 + 0.81 = 1.81, IPC_solo = 2.0 + 1.0 = 3.0, D = (3.0 - 1.81) / 3.0
    assert r.filtered == pytest.approx(1.19 / 3.0, rel=1e-12)
    assert r.degradation == r.filtered
    # Unfiltered: co = 1.0 + 0.81 + 1.0 + 1.1 = 3.91, solo = 2.0 + 1.0 + 0.9 + 2.0 = 5.9
    assert r.unfiltered == pytest.approx(1.99 / 5.9, rel=1e-12)
    assert (r.blocks_used, r.blocks_rejected, r.status) == (2, 2, EstimateStatus.OK)
    # Refill-corrected, same accepted blocks: co = before = 1.0 + 0.8 = 1.8;
    # solo = during + after - before = 3.0 + 1.82 - 1.8 = 3.02; D = 1.22 / 3.02
    assert r.corrected == pytest.approx(1.22 / 3.02, rel=1e-12)
    c = filtered_degradation(blocks, estimator=REFILL_CORRECTED)
    assert c.degradation == c.corrected == r.corrected and c.filtered == r.filtered and c.estimator == REFILL_CORRECTED


def test_refill_correction_recovers_a_transient_that_alg4_underestimates():
    # Truth: solo IPC 2.0, co-located IPC 1.0, D = 0.5. The during window misses 0.04 of the
    # solo IPC while the cache refills; the after window keeps 0.04 extra while it drains
    # (|before - after| = 0.04 < delta, so Alg. 4 accepts every block).
    blocks = [block(1.0, 1.96, 1.04, cycle=i) for i in range(4)]
    alg4 = filtered_degradation(blocks, estimator=POPPA_ALG4)
    assert alg4.degradation == pytest.approx(1 - 1.02 / 1.96, rel=1e-12)  # 0.480: two points under
    assert filtered_degradation(blocks, estimator=REFILL_CORRECTED).degradation == pytest.approx(0.5, rel=1e-12)


def test_unknown_estimator_is_an_error():
    with pytest.raises(ValueError, match="unknown estimator 'magic'"):
        estimate_from_totals(2.0, 1.0, 2.0, 1.0, 1, 0, 1.0, 1.0, "magic")


def test_all_blocks_rejected_charges_no_discount_and_says_why():
    r = filtered_degradation([block(1.0, 0.9, 1.0, cycle=0), block(1.0, 2.0, 1.5, cycle=1)])
    assert r.status is EstimateStatus.NO_ACCEPTED_BLOCKS
    assert r.degradation == 0.0 and r.filtered is None
    assert r.unfiltered == pytest.approx((2.9 - 2.25) / 2.9)  # still recorded for the auditor
    assert (r.blocks_used, r.blocks_rejected) == (0, 2)


def test_unfiltered_applies_eq_7_8_over_every_block_even_when_alg4_refuses_them_all():
    blocks = [block(1.0, 0.9, 1.0, cycle=0), block(1.0, 2.0, 1.5, cycle=1)]
    r = filtered_degradation(blocks, estimator=UNFILTERED)
    # co = 1.0 + 1.25 = 2.25, solo = 0.9 + 2.0 = 2.9: D = 0.65 / 2.9, applied although Alg. 4 refused both
    assert (r.status, r.estimator) == (EstimateStatus.OK, UNFILTERED)
    assert r.degradation == r.unfiltered == pytest.approx(0.65 / 2.9, rel=1e-12)
    assert (r.filtered, r.corrected, r.blocks_used, r.blocks_rejected) == (None, None, 0, 2)  # Alg. 4's counts


def test_unfiltered_is_clamped_at_zero_and_needs_a_block():
    # the shutter lowered IPC (noise): Eq. 7-8 gives 1 - 1.0 / 0.9 < 0, a job is never charged above SOP
    r = filtered_degradation([block(1.0, 0.9, 1.0)], estimator=UNFILTERED)
    assert r.unfiltered == pytest.approx(1 - 1.0 / 0.9) and r.degradation == 0.0
    assert filtered_degradation([], estimator=UNFILTERED).status is EstimateStatus.NO_BLOCKS


def test_no_blocks_at_all():
    r = filtered_degradation([])
    assert (r.status, r.degradation, r.filtered, r.unfiltered) == (EstimateStatus.NO_BLOCKS, 0.0, None, None)


def test_delta_is_a_parameter():
    b = [block(1.0, 2.0, 1.1)]
    assert filtered_degradation(b, delta=0.05).status is EstimateStatus.NO_ACCEPTED_BLOCKS
    assert filtered_degradation(b, delta=0.2).filtered == pytest.approx(1 - 1.05 / 2.0)


def test_exact_sum_is_independent_of_order():
    rng = random.Random(3)
    xs = [rng.uniform(-1, 1) * 10 ** rng.randint(-8, 8) for _ in range(2000)]
    expected = math.fsum(xs)
    for _ in range(5):
        rng.shuffle(xs)
        s = ExactSum()
        for x in xs:
            s.add(x)
        assert s.value == expected


def test_estimate_is_a_function_of_the_block_set():
    blocks = [block(0.5 + i / 1000, 1.0 + i / 997, 0.5 + i / 1003, cycle=i) for i in range(200)]
    forward = filtered_degradation(blocks)
    backward = filtered_degradation(list(reversed(blocks)))
    assert forward == backward


def test_adding_a_matrix_of_rows_is_exact_at_every_magnitude_and_at_the_chunk_edges():
    """add_rows (one numpy pass in three 40-bit chunks) gives each row's math.fsum, bit for bit, for
    values inside the fixed-point window, at its edges (2**-30 in it, 2**30 out of it), beyond it,
    and negative (added one by one). (Mutations caught: the chunk scalings, the top chunk's
    weight. `<` -> `<=` at the window's top is equivalent: 2**30 is still exact in three chunks.)"""
    import numpy as np

    from nodeshare.streams.core.degradation import add_rows

    rng = np.random.default_rng(5)
    edges = [2.0**-30, 2.0**30, 2.0**30 - 2.0**-22, 2.0**-31, 3.0 * 2.0**29, -0.75, 0.0, 1.0 - 2.0**-53]
    rows = [rng.uniform(0.0, 4.0, 50), rng.uniform(0.0, 1.0, 50) * 10.0 ** rng.integers(-9, 9, 50),
            np.array(edges + [0.0] * 42), rng.uniform(-2.0, 2.0, 50)]
    matrix = np.array(rows)
    sums = [ExactSum() for _ in rows]
    add_rows(sums, matrix)
    assert [s.value for s in sums] == [math.fsum(r) for r in rows]
    again = [ExactSum() for _ in rows]
    add_rows(again, matrix)
    add_rows(again, matrix)  # twice: each row's sum doubled, exactly
    assert [s.value for s in again] == [math.fsum(list(r) * 2) for r in rows]


def test_moments_by_hand():
    """Count, sums, mean and standard deviation of 1, 2, 3, 4; merged and withdrawn exactly.
    (Mutations: x * x -> x + x, mean * mean -> mean / mean, s1 / n -> s1 ** n, sign * sum -> sign - sum.)"""
    from nodeshare.streams.core.degradation import Moments

    m = Moments()
    assert m.summary() is None
    for x in (1.0, 2.0, 3.0, 4.0):
        m.add(x)
    s = m.summary()
    assert s is not None and (s.n, s.sum, s.sum_sq, s.min, s.max) == (4, 10.0, 30.0, 1.0, 4.0)
    f = m.feature()
    assert f.mean == 2.5 and f.sd == pytest.approx(math.sqrt(30 / 4 - 2.5**2), rel=1e-15)
    assert (f.min, f.max) == (1.0, 4.0)
    other = Moments()
    other.add(10.0)
    m.merge(other)
    assert m.summary() is not None and (m.n, m.s1.value, m.s2.value, m.hi) == (5, 20.0, 130.0, 10.0)
    total = Moments()
    total.add_summary(m.summary())
    total.add_summary(other.summary(), sign=-1)  # withdrawn: back to 1, 2, 3, 4
    assert (total.n, total.s1.value, total.s2.value) == (4, 10.0, 30.0)
