"""How sure a charge is: an interval around each job's degradation, and the bound it is priced at.

A job's degradation D = 1 - R is a ratio estimate over its blocks (``degradation``); its standard
error comes from the blocks' second moments (``ipc.ratio_standard_error``). Its interval
at confidence c is Student's t interval widened by a stated margin for the estimator's own bias

    D +- (t_{(1 + c) / 2, n - 1} * SE + m),   m = margin_abs + margin_rel * D   (n blocks, clamped to [0, 1])

The t term covers sampling noise only. A bias shared by every block (a shutter too short for a
program's cache to refill, a phase shorter than a block, the estimator's model of refill) is
outside it: with m = 0 the 95% interval held the truth (clamped to [0, 1]) for 51.5% of 19,257
simulated SPEC jobs and 73.4% of 3,410 built-in-library jobs, and the truth lay above the upper
end for 7.6% and 7.8% (where at most 2.5% is claimed). The margin is the smallest (margin_abs, margin_rel) on the grid
{0, 0.25, 0.5, 0.75, 1, 1.5 points} x {0, 5, 10, 20%} whose interval held the truth for at least
95% of the built-in library's jobs (every mix of ``experiment pricing --mix all-mixes``, adaptive
schedule, ``mixed_s``, seed 7): 1 point + 5% of D, 95.1% there and, never fitted to them, 95.1%
of the SPEC jobs with 1.0% above the upper end. It is calibrated on the project's simulator, so it
is a stated policy value like ``prior_high``, recorded in every charge: a site that measures its
own programs alone and shared sets its own (docs/charges.md, "The bias margin"). A charge priced
at the upper end then pays at or below its solo baseline unless the truth is above the interval.

With fewer than ``MIN_INTERVAL_BLOCKS`` blocks the sample's own spread is too unsure to scale an
interval (its relative error is about 1 / sqrt(2 (n - 1)), 27% at n = 8): such a job gets the
*prior* interval [0, max(min(1, D + m), prior_high)]; a job that shared a node without any usable
block has no estimate at all, and gets [0, max(D, prior_high)] with D = 0; ``prior_high`` is a
stated policy value (the degradation few jobs
exceed at the site), never the standard price in silence. A job whose blocks show it made no
progress alone (sleeping, blocked on I/O) has nothing a co-runner could slow: [0, 0].

**The short-sample margin** (schema 10). A sample of the adaptive ladder's shortest S (3.2 ms)
can end before a cache-hungry job has refilled its share of the cache, so its D is biased low. A
``mixed_s`` estimate keeps a short sample's D only where its longest S does not show it lower,
and checks with full strength only where that S has ``MIXED_N_MIN`` accepted blocks; an estimate
whose longest S has fewer rests on short samples that nothing checked
(``short_samples_unchecked``), and its interval's margin grows by ``short_margin``. Its price
grows by it too (``short_sample_margin``) only where the job took fewer than ``MIXED_N_MIN``
blocks at any longer S, accepted or not (``long_samples_untaken``: too short to afford them within
the overhead budget): a job whose long samples Alg. 4 rejected was measured there, and Alg. 4's
selection of its short blocks biases it high, not low (on the built-in library's jobs of every
mix, seed 7, the 988 such jobs were at or below their point estimate in 75% of cases and needed
1.5 points for 95%; the 4,565 such SPEC jobs, 95% at the point estimate itself). Missing or set
aside evidence (a lost node, blocks that never arrived, a refused marker:
``accounting.build_charge``) gets neither, and never buys a discount. The margin is calibrated
like the interval's: the smallest on a grid of half points for which D + margin held the truth for
at least 95% of the built-in library's jobs it prices, seed 7 (every mix of ``experiment pricing
--mix all-mixes`` and the 600 jobs of ``experiment adaptive-shutter --scenario short``: 442 jobs;
90.3% at 2 points, 93.4% at 2.5, 95.9% at 3): 3 points. The SPEC programs and the other seeds were
never used to choose it (docs/charges.md, "The short-sample margin").

**The trusted level's lower end** (schema 10). ``mixed_s`` trusts its longest S and keeps a shorter
S unless that reads *lower* beyond noise (the refill biases short samples low, and a low D
overcharges). A shorter S that reads *higher* is kept, and where phases are shorter than a long
sample it does: Alg. 4 keeps the short blocks whose solo IPC beats the IPC around them. The
combined D then sits above what the trusted level measured, and the truth below the interval:
with the symmetric interval alone, 83-91% of the built-in library's short-phases jobs (seeds 7, 11,
23) and 86-89% of the SPEC ones were covered. So where a kept shorter level reads higher than the
longest by more than the noise for which a lower one is left out
(``shutter_policy.trusted_level_below``), the lower end reaches down to the trusted level's own
t interval's (its accepted blocks' degrees of freedom, its standard error as the rule takes it,
the same bias margin). No parameter is fitted: it is the estimator's own test, read both ways.
The price is not moved: the point and the upper end are unchanged.

Every number here is plain float arithmetic on the charge's own inputs, so both audits recompute
it bit for bit.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from statistics import NormalDist
from typing import Protocol

from nodeshare.schemas.events import EstimateStatus

from .degradation import MIXED_S, DegradationResult
from .shutter_policy import MIXED_N_MIN, has_own_spread, trusted_level_below


class LevelLike(Protocol):
    """One sample length's evidence, as the fold keeps it and a charge carries it."""

    @property
    def sample_us(self) -> int: ...
    @property
    def blocks_used(self) -> int: ...
    @property
    def degradation(self) -> float | None: ...
    @property
    def standard_error(self) -> float | None: ...


#: The interval methods a charge names.
T_RATIO = "t_ratio"  # Student's t interval of the ratio estimate
PRIOR = "prior"  # too few blocks, or none: [0, max(D (+ m with some blocks), prior_high)]
NO_INTERVAL = "none"  # no progress alone: nothing to slow, [0, 0]
INTERVAL_METHODS = (T_RATIO, PRIOR, NO_INTERVAL)

#: The fewest blocks whose spread scales an interval (see the module's docstring).
MIN_INTERVAL_BLOCKS = 8
DEFAULT_CONFIDENCE = 0.95
#: The highest confidence an interval is given at: beyond it the four-term expansion falls short
#: (a review measured 5.4019 for the exact 5.4079 at p = 0.9995, dof 7), so the interval would be
#: narrower than claimed.
MAX_CONFIDENCE = 0.99
#: The prior's upper end: the degradation few co-located jobs exceed (on the calibrated simulator's
#: 40 SPEC programs in every pair, the largest true D is 17%; POPPA's Fig. 11 shows pairs near 40%).
DEFAULT_PRIOR_HIGH = 0.25
#: The margin for the estimator's bias (see the module's docstring): an absolute part, in units of
#: D, and a part relative to D. Schema 7; a charge of an earlier version had none.
DEFAULT_MARGIN_ABS = 0.01
DEFAULT_MARGIN_REL = 0.05

#: The short-sample margin (see the module's docstring; schema 10): the longest sample length S
#: whose estimate it covers (the adaptive ladder's shortest at the defaults, where it was
#: calibrated) and the margin, in units of D. A charge of an earlier version had none.
DEFAULT_SHORT_SAMPLE_US = 3200
DEFAULT_SHORT_MARGIN = 0.03

_NORMAL = NormalDist()


#: Below this many degrees of freedom ``t_quantile`` inverts the exact distribution instead of the
#: expansion (11% short at 1 degree of freedom and p = 0.975, 36% at p = 0.995).
EXACT_T_BELOW = 7


def t_central(t: float, dof: int) -> float:
    """P(|T| <= t) for Student's t with ``dof`` >= 1 degrees of freedom, t >= 0, exactly: the finite
    series of Abramowitz and Stegun 26.7.3 (odd dof) and 26.7.4 (even dof) in theta = atan(t / sqrt(dof))."""
    theta = math.atan(t / math.sqrt(dof))
    c2, s = math.cos(theta) ** 2, math.sin(theta)
    if dof % 2 == 0:
        term, total = 1.0, 1.0
        for k in range(2, dof, 2):  # (1 3 ... (k - 1)) / (2 4 ... k) cos^k
            term *= (k - 1) / k * c2
            total += term
        return s * total
    if dof == 1:
        return 2.0 / math.pi * theta
    term = math.cos(theta)
    total = term
    for k in range(3, dof, 2):  # (2 4 ... (k - 1)) / (3 5 ... k) cos^k
        term *= (k - 1) / k * c2
        total += term
    return 2.0 / math.pi * (theta + s * total)


def t_quantile(p: float, dof: int) -> float:
    """Student's t quantile. From ``EXACT_T_BELOW`` degrees of freedom on, by the Cornish-Fisher
    expansion in 1 / dof (Abramowitz and Stegun 26.7.5), four terms: within 2e-3 of the exact quantile
    for dof >= 7 and p <= 0.995, and exact as dof grows. Below, by bisecting the exact distribution
    (``t_central``) to the last bit. Plain arithmetic in a fixed order, so every machine and both
    audits get the same bits."""
    if not 0.5 <= p < 1.0:
        raise ValueError(f"a one-sided quantile needs 0.5 <= p < 1, got {p}")
    if dof < 1:
        raise ValueError(f"degrees of freedom must be >= 1, got {dof}")
    if dof < EXACT_T_BELOW:
        target, lo, hi = 2.0 * p - 1.0, 0.0, 1.0
        if target <= 0.0:
            return 0.0
        while t_central(hi, dof) < target:
            hi *= 2.0
        for _ in range(200):  # halves [lo, hi] until it cannot (about 60 steps)
            mid = 0.5 * (lo + hi)
            if mid in (lo, hi):
                break
            lo, hi = (mid, hi) if t_central(mid, dof) < target else (lo, mid)
        return hi
    z = _NORMAL.inv_cdf(p)
    z2 = z * z
    g1 = (z2 + 1.0) * z / 4.0
    g2 = ((5.0 * z2 + 16.0) * z2 + 3.0) * z / 96.0
    g3 = (((3.0 * z2 + 19.0) * z2 + 17.0) * z2 - 15.0) * z / 384.0
    g4 = ((((79.0 * z2 + 776.0) * z2 + 1482.0) * z2 - 1920.0) * z2 - 945.0) * z / 92160.0
    v = float(dof)
    return z + g1 / v + g2 / v**2 + g3 / v**3 + g4 / v**4


@dataclass(frozen=True)
class Interval:
    """An interval of the degradation over the time the job shared its nodes."""

    low: float
    high: float
    method: str
    blocks: int


def check_margin(margin_abs: float, margin_rel: float) -> None:
    """Raises ValueError for a margin outside [0, 1] (either part)."""
    for name, v in (("margin_abs", margin_abs), ("margin_rel", margin_rel)):
        if not 0.0 <= v <= 1.0:
            raise ValueError(f"the interval's {name} must be in [0, 1], got {v}")


def check_short_margin(short_margin: float, short_sample_us: int) -> None:
    """Raises ValueError for a short-sample margin outside [0, 1] or a sample length below 1 us."""
    if not 0.0 <= short_margin <= 1.0:
        raise ValueError(f"the short-sample margin must be in [0, 1], got {short_margin}")
    if short_sample_us < 1:
        raise ValueError(f"short_sample_us must be >= 1, got {short_sample_us}")


def short_samples_unchecked(result: DegradationResult, short_sample_us: int) -> bool:
    """Whether a ``mixed_s`` estimate pooled accepted blocks taken at 0 < S <= ``short_sample_us``
    that nothing checked: ``combine_levels`` checks each shorter S against the longest S with an
    accepted block, and with full strength only where that level has a spread of its own
    (``has_own_spread``: ``MIXED_N_MIN`` of them; else at ``MIXED_Z_FEW``, or not at all when no
    level has one and every block is pooled). So they are checked only when the longest S is longer
    than ``short_sample_us`` and has a spread of its own. False for another estimator, without an
    estimate, and for blocks folded before the fold kept S (S = 0: unknown)."""
    if result.estimator != MIXED_S or result.status is not EstimateStatus.OK:
        return False
    if not any(lv.used and lv.blocks_used and 0 < lv.sample_us <= short_sample_us for lv in result.levels):
        return False
    top = max((lv for lv in result.levels if lv.blocks_used), key=lambda lv: lv.sample_us)
    se = math.inf if top.standard_error is None else top.standard_error
    return not (top.sample_us > short_sample_us and has_own_spread(top.blocks_used, se))


def long_samples_untaken(result: DegradationResult, short_sample_us: int) -> bool:
    """Whether the job took fewer than ``MIXED_N_MIN`` blocks at S longer than ``short_sample_us``,
    counting those Alg. 4 rejected: its long samples were never taken in full, as happens to a job
    too short to afford them within the overhead budget. A job that took them and had them rejected
    (its IPC moves within a long window: bursts, co-runners arriving and leaving) was measured at
    the long S, and there Alg. 4's selection of its short blocks (each kept only when its solo IPC
    beats the IPC around it) biases D high, not low (docs/charges.md, "The short-sample margin")."""
    taken = sum(lv.blocks_used + lv.blocks_rejected for lv in result.levels if lv.sample_us > short_sample_us)
    return taken < MIXED_N_MIN


def short_sample_margin(result: DegradationResult, short_margin: float, short_sample_us: int) -> float:
    """What a charge adds to its shared-time D for the short samples behind it: ``short_margin`` where
    they are unchecked (``short_samples_unchecked``) because its long samples were never taken
    (``long_samples_untaken``), else 0: the interval's widening, where the long samples are missing."""
    widen = short_sample_widening(result, short_margin, short_sample_us)
    return widen if widen and long_samples_untaken(result, short_sample_us) else 0.0


def short_sample_widening(result: DegradationResult, short_margin: float, short_sample_us: int) -> float:
    """What a charge adds to its interval's margin for the short samples behind it: ``short_margin``
    wherever they are unchecked (``short_samples_unchecked``), taken long samples or not: such an
    estimate is no surer either way, biased low by the refill or high by Alg. 4's selection."""
    check_short_margin(short_margin, short_sample_us)
    return short_margin if short_samples_unchecked(result, short_sample_us) else 0.0


def degradation_interval(result: DegradationResult, confidence: float = DEFAULT_CONFIDENCE,
                         prior_high: float = DEFAULT_PRIOR_HIGH, margin_abs: float = DEFAULT_MARGIN_ABS,
                         margin_rel: float = DEFAULT_MARGIN_REL, short: float = 0.0,
                         trusted_low: bool = True) -> Interval:
    """The interval at ``confidence`` of ``result.degradation`` (see the module's docstring), its
    margin m raised by ``short`` (``short_sample_widening``'s), its lower end reaching the trusted
    level's (``trusted_level_low``) unless ``trusted_low`` is False (a charge from before schema
    10). The prior interval of an estimate from too few blocks reaches at least D + m as well; a job
    with no estimate gets the prior alone (no estimator, so no estimator bias)."""
    if not 0.0 < confidence <= MAX_CONFIDENCE:
        raise ValueError(f"confidence must be in (0, {MAX_CONFIDENCE}], got {confidence} (t_quantile's expansion "
                         "is accurate up to p = 0.995)")
    if not 0.0 <= prior_high <= 1.0:
        raise ValueError(f"the prior's upper end must be in [0, 1], got {prior_high}")
    check_margin(margin_abs, margin_rel)
    if not 0.0 <= short <= 1.0:
        raise ValueError(f"the short-sample margin added must be in [0, 1], got {short}")
    d, n, se = result.degradation, result.interval_blocks, result.standard_error
    if result.status is EstimateStatus.NO_PROGRESS_ALONE or (
            result.unfiltered is None and result.blocks_used + result.blocks_rejected > 0):
        return Interval(0.0, 0.0, NO_INTERVAL, n)  # blocks, and not one instruction retired alone in any
    margin = margin_abs + margin_rel * d + short
    if result.status is not EstimateStatus.OK:  # no estimate: no estimator bias to allow for
        return Interval(0.0, max(d, prior_high), PRIOR, n)
    if se is None or n < MIN_INTERVAL_BLOCKS:
        return Interval(0.0, max(min(1.0, d + margin), prior_high), PRIOR, n)
    p = 0.5 * (1.0 + confidence)
    half = t_quantile(p, n - 1) * se + margin
    low = d - half
    if trusted_low and (below := trusted_level_low(result, p, margin_abs, margin_rel)) is not None:
        low = min(low, below)
    return Interval(max(0.0, low), min(1.0, d + half), T_RATIO, n)


def trusted_level_low(result: DegradationResult, p: float, margin_abs: float = DEFAULT_MARGIN_ABS,
                      margin_rel: float = DEFAULT_MARGIN_REL) -> float | None:
    """The lower end (unclamped) of the trusted level's own interval, where a ``mixed_s`` estimate
    kept shorter samples that read higher than its longest S beyond noise; None otherwise (another
    estimator, no estimate). See ``levels_low``."""
    if result.estimator != MIXED_S or result.status is not EstimateStatus.OK:
        return None
    return levels_low(result.levels, p, margin_abs, margin_rel)


def levels_low(levels: Iterable[LevelLike], p: float, margin_abs: float, margin_rel: float) -> float | None:
    """Over a ``mixed_s`` estimate's per-S evidence (the fold's ``LevelResult`` or a charge's
    ``LevelEvidence``): where ``shutter_policy.trusted_level_below`` finds a kept shorter level higher
    than the longest beyond noise, D_top - (t_{p, n_top - 1} SE_top + margin_abs + margin_rel
    max(0, D_top)), with n_top the level's accepted blocks (one degree of freedom at least: a single
    long block, whose error is borrowed, reaches far down; ``t_quantile`` is exact there) and SE_top
    as ``combine_levels`` takes it. None otherwise. A charge carries at most ``MAX_CHARGE_LEVELS``
    levels (the used ones first): over more sample lengths than that (the default ladder has 3) the
    ledger's reading of a charge's own levels may differ from the fold's; the audits recompute from
    the archive, never from the charge's levels."""
    got = trusted_level_below({lv.sample_us: (lv.blocks_used, lv.degradation,
                                              math.inf if lv.standard_error is None else lv.standard_error)
                               for lv in levels if lv.blocks_used and lv.degradation is not None})
    if got is None:
        return None
    d_top, se_top, n_top = got
    return d_top - (t_quantile(p, max(1, n_top - 1)) * se_top + margin_abs + margin_rel * max(0.0, d_top))
