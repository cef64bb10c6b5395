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
