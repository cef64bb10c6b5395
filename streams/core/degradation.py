"""Degradation from shutter blocks: POPPA's filtered prediction (Seed 002, Alg. 4), the
unfiltered estimate (Eq. 7-8), nodeshare's refill-corrected estimate, and its combination over
sample lengths (``mixed_s``, issue 36).

Longer than 500 lines because the estimators, the exact sums they are computed from and their
standard errors are one contract that the worker and both audits must meet bit for bit; split,
a change to one would not be seen next to the others.

The refill-corrected estimate accepts the same blocks as Alg. 4 but reads them differently.
When the co-runners pause, the lone job's share of the last-level cache grows towards its
solo share only as fast as its misses refill it, so a short *during* window sees less than
the solo IPC; right after the shutter the lone job still holds the extra cache, so its *after*
window sees more than the co-located IPC. Both transients are the same cache moving in and
out, of about the same size, so

    IPC_co   = before                       (settled: P has passed since the last shutter)
    IPC_solo = during + (after - before)    (the refill the during window missed)

Both are sums over accepted blocks, so the estimate is again a function of the set of blocks.
On the calibrated simulator's 144 pairs it halves Alg. 4's error (see the README).

A block's contribution is added to exact sums (Shewchuk's algorithm, the one ``math.fsum``
uses), so an estimate is a function of the *set* of blocks: the stream worker, the audit
and any vectorized twin get bit-identical numbers whatever order they add blocks in.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from nodeshare.schemas.events import (
    EstimateStatus,
    FeatureSummary,
    SampleMoments,
    ShutterBatch,
    ShutterBlock,
)

from .blocks import BlockRows, block_rows
from .ipc import mean_ipc, ratio_standard_error
from .shutter_policy import MIXED_N_MIN, MIXED_TOL, MIXED_Z, MIXED_Z_FEW, combine_levels

#: Seed 002, Section 6.3: "We empirically determined delta = 0.05 to be a reasonable value."
DEFAULT_DELTA = 0.05

#: The estimators a charge can apply, by the name written into every charge.
POPPA_ALG4 = "poppa_alg4"
REFILL_CORRECTED = "refill_corrected"
#: Eq. 7-8 over every block, Alg. 4's filter left out: with shutters long enough for the cache to
#: refill, the filter's "during above before and after" keeps noise that lifts ``during`` and so
#: overstates small degradations (README, Measured).
UNFILTERED = "unfiltered"
#: Issue 36: the refill-corrected estimate per sample length S, combined by
#: ``shutter_policy.mixed_estimate``'s rule (``estimate_levels``): the longest S is trusted, a
#: shorter S lower beyond noise is left out (its window ends before the cache refilled), the rest
#: pooled by inverse variance. With blocks at one S it is ``refill_corrected``, bit for bit.
MIXED_S = "mixed_s"
ESTIMATORS = (REFILL_CORRECTED, POPPA_ALG4, UNFILTERED, MIXED_S)
#: ``mixed_s``: under the fixed schedule it is ``refill_corrected``; under the adaptive one it is
#: the estimate that schedule needs (docs/charges.md, "Defaults").
DEFAULT_ESTIMATOR = MIXED_S


@dataclass(frozen=True)
class BlockMeans:
    """Mean IPC of a block's K samples before, during and after its shutter."""

    before: float
    during: float
    after: float


def block_means(block: ShutterBlock) -> BlockMeans:
    return BlockMeans(mean_ipc(block.before), mean_ipc(block.during), mean_ipc(block.after))


def passes_filter(m: BlockMeans, delta: float = DEFAULT_DELTA) -> bool:
    """Alg. 4, line 3: the IPC before and after agree within delta (same phase), and the shutter
    raised IPC above both (a shutter can only relieve contention)."""
    return abs(m.before - m.after) < delta and m.before < m.during and m.after < m.during


def co_located_ipc(m: BlockMeans) -> float:
    """Alg. 4, line 4: the block's co-located IPC, the mean of before and after."""
    return 0.5 * (m.before + m.after)


def refill_corrected_solo(before: float, during: float, after: float) -> float:
    """The solo IPC of a block (or of sums over blocks) corrected for the cache refill: during + (after - before)."""
    return math.fsum((during, after, -before))


def degradation_from_sums(ipc_solo: float, ipc_co: float) -> float | None:
    """Alg. 4, line 8: (IPC_solo - IPC_co) / IPC_solo, i.e. 1 - Perf_norm of Eq. 6; None when the job
    retired no instructions while it ran alone (sleeping, blocked on I/O or MPI): its solo speed is
    0, so no slowdown can be measured against it."""
    if not ipc_solo > 0.0:
        return None
    return (ipc_solo - ipc_co) / ipc_solo


class ExactSum:
    """A running float sum without rounding error: ``value`` is the correctly rounded sum of
    everything added, independent of the order of addition.

    Two exact parts: Shewchuk's partials (1997; what ``math.fsum`` uses) for any float, and an
    integer count of 2**-FIXED_BITS units for the bulk of a stream's values, which ``add_rows``
    adds in one numpy pass and which then costs one integer addition. ``parts()`` is both as one
    list of floats whose exact sum is the total: what persisted state holds (as before)."""

    __slots__ = ("partials", "units")

    def __init__(self, partials: Iterable[float] = ()) -> None:
        self.partials: list[float] = list(partials)
        self.units = 0  # exact integer multiple of 2**-FIXED_BITS

    def add(self, x: float) -> None:
        i = 0
        partials = self.partials
        for y in partials:
            if abs(x) < abs(y):
                x, y = y, x
            hi = x + y
            lo = y - (hi - x)
            if lo:
                partials[i] = lo
                i += 1
            x = hi
        partials[i:] = [x]

    def merge(self, other: ExactSum) -> None:
        for p in other.partials:
            self.add(p)
        self.units += other.units

    def add_many(self, values: np.ndarray) -> None:
        """Add every value of a float64 array, exactly (see ``add_rows``)."""
        add_rows([self], values.reshape(1, -1))

    def add_fixed(self, units: int) -> None:
        """Add ``units`` * 2**-FIXED_BITS, exactly."""
        self.units += units

    def parts(self) -> list[float]:
        """Floats whose exact sum is the total (the partials, then the units as a few exact floats)."""
        if not self.units:
            return list(self.partials)
        return self.partials + [math.ldexp(p, -FIXED_BITS) for p in _float_parts(self.units)]

    @property
    def value(self) -> float:
        if not self.partials:  # int -> float rounds correctly, and the power-of-two scaling is exact
            return math.ldexp(float(self.units), -FIXED_BITS)
        return math.fsum(self.parts()) if self.units else math.fsum(self.partials)

    def __eq__(self, other: object) -> bool:
        """Equal when the exact totals are (however they are split between partials and units)."""
        if not isinstance(other, ExactSum):
            return NotImplemented
        return math.fsum(self.parts() + [-p for p in other.parts()]) == 0.0

    __hash__ = None  # type: ignore[assignment]  # mutable

    def __repr__(self) -> str:
        return f"ExactSum({self.value!r})"


#: ``ExactSum.add_many``'s fixed point: IPCs in [2**-30, 2**30) are integers in units of 2**-82.
FIXED_BITS = 82
_FIXED_MIN, _FIXED_MAX = 2.0**-30, 2.0**30
_CHUNK_BITS = 40
_CHUNK, _CHUNK2 = 2.0**_CHUNK_BITS, 2.0**(2 * _CHUNK_BITS)


def add_rows(sums: Sequence[ExactSum], matrix: np.ndarray) -> None:
    """Add row i of a float64 matrix to ``sums[i]``, exactly: the same value as adding them one by
    one (a sum may be named by several rows). Values in [2**-30, 2**30) (and zeros) are multiples of
    2**-82 below 2**112, so each row's sum is an exact integer in three 40-bit chunks of int64 sums
    (one numpy pass over the whole matrix); the rest are added one by one."""
    if matrix.size == 0:
        return
    fits = (matrix == 0) | ((matrix >= _FIXED_MIN) & (matrix < _FIXED_MAX))  # non-negative: exact chunks
    if not fits.all():
        for i, j in zip(*np.nonzero(~fits), strict=True):
            sums[int(i)].add(float(matrix[i, j]))
        matrix = np.where(fits, matrix, 0.0)
    # The three chunks of each value's units (x * 2**82), each step exact: scalings by powers of
    # two, floors, and a float minus its own floor.
    chunks = np.empty((3, *matrix.shape))
    top = np.multiply(matrix, 2.0**(FIXED_BITS - 2 * _CHUNK_BITS), out=chunks[2])  # x * 2**(82 - 80) < 2**32
    np.floor(top, out=chunks[0])
    rest = np.subtract(top, chunks[0], out=chunks[2])
    rest *= _CHUNK
    np.floor(rest, out=chunks[1])
    rest -= chunks[1]
    rest *= _CHUNK
    totals = chunks.astype(np.int64).sum(axis=2).tolist()  # (3, rows): each far below 2**63
    for s, hi_i, mid_i, lo_i in zip(sums, *totals, strict=True):
        s.units += (hi_i << (2 * _CHUNK_BITS)) + (mid_i << _CHUNK_BITS) + lo_i


def _float_parts(total: int) -> list[float]:
    """An integer as floats whose exact sum it is (each the rounding of what remains)."""
    parts = []
    while total:
        f = float(total)
        parts.append(f)
        total -= int(f)
    return parts


#: The products ``DegradationSums.second`` sums, in order: six over the blocks Alg. 4 accepts (their
#: before b, during d and after a), three over every block (d and the co-located c = (b + a) / 2).
#: Every estimate is a ratio R = sum(y) / sum(x) over its blocks, D = 1 - R, with x and y linear
#: in b, d, a (or d, c), so these nine sums give each estimate's sum(x^2), sum(xy) and sum(y^2).
SECOND_MOMENTS = ("bb", "dd", "aa", "bd", "ba", "da", "dd_all", "cc_all", "dc_all")


@dataclass
class DegradationSums:
    """The accumulated evidence of one job (or one job on one node)."""

    solo_filtered: ExactSum = field(default_factory=ExactSum)
    co_filtered: ExactSum = field(default_factory=ExactSum)
    solo_all: ExactSum = field(default_factory=ExactSum)
    co_all: ExactSum = field(default_factory=ExactSum)
    accepted: int = 0
    rejected: int = 0
    before_filtered: ExactSum = field(default_factory=ExactSum)  # the accepted blocks' before and after means
    after_filtered: ExactSum = field(default_factory=ExactSum)
    #: Exact sums of products, for each estimate's standard error (``SECOND_MOMENTS``, version 6):
    #: of the accepted blocks' before b, during d and after a, and of every block's d and co-located c.
    second: tuple[ExactSum, ...] = field(default_factory=lambda: tuple(ExactSum() for _ in SECOND_MOMENTS))

    def add(self, block: ShutterBlock, delta: float = DEFAULT_DELTA) -> bool:
        """Add one block; returns whether Alg. 4 accepted it."""
        m = block_means(block)
        co = co_located_ipc(m)
        b, d, a = m.before, m.during, m.after
        self.solo_all.add(d)
        self.co_all.add(co)
        second = self.second
        for s, x in zip(second[6:], (d * d, co * co, d * co), strict=True):
            s.add(x)
        if passes_filter(m, delta):
            self.solo_filtered.add(d)
            self.co_filtered.add(co)
            self.before_filtered.add(b)
            self.after_filtered.add(a)
            for s, x in zip(second[:6], (b * b, d * d, a * a, b * d, b * a, d * a), strict=True):
                s.add(x)
            self.accepted += 1
            return True
        self.rejected += 1
        return False

    def add_rows(self, rows: BlockRows, counted: np.ndarray, delta: float = DEFAULT_DELTA,
                 features: tuple[Moments, Moments] | None = None) -> int:
        """Add the ``counted`` blocks of a batch at once, with the same float operations as ``add``
        (so the same bits); returns how many Alg. 4 accepted. ``features`` (alone, shared): also add
        the blocks' sample IPCs, during to the first and before and after to the second, in the
        same exact pass."""
        b, d, a = rows.before[counted], rows.during[counted], rows.after[counted]
        n = len(b)
        keep = (np.abs(b - a) < delta) & (b < d) & (a < d)
        width = n if features is None else n * rows.sample_ipc.shape[2]
        matrix = np.zeros((15 if features is None else 21, width))  # a zero adds nothing, exactly
        co = 0.5 * (b + a)
        matrix[0, :n], matrix[1, :n] = d, co
        matrix[2:6, :n] = np.where(keep, (d, co, b, a), 0.0)  # Alg. 4's sums, and before and after of its blocks
        matrix[6:12, :n] = np.where(keep, (b * b, d * d, a * a, b * d, b * a, d * a), 0.0)  # SECOND_MOMENTS
        matrix[12:15, :n] = d * d, co * co, d * co
        targets = [self.solo_all, self.co_all, self.solo_filtered, self.co_filtered, self.before_filtered,
                   self.after_filtered, *self.second]
        if features is not None:
            alone, shared = features
            samples = rows.sample_ipc[:, counted].reshape(3, -1)  # before, during, after: every sample
            matrix[15:18] = samples
            np.multiply(samples, samples, out=matrix[18:21])
            targets += [shared.s1, alone.s1, shared.s1, shared.s2, alone.s2, shared.s2]
            lows, highs = samples.min(axis=1).tolist(), samples.max(axis=1).tolist()
            for m, lo, hi, count in ((alone, lows[1], highs[1], width), (shared, min(lows[0], lows[2]),
                                                                         max(highs[0], highs[2]), 2 * width)):
                m.n += count
                m.lo, m.hi = min(m.lo, lo), max(m.hi, hi)
        add_rows(targets, matrix)
        accepted = int(keep.sum())
        self.accepted += accepted
        self.rejected += n - accepted
        return accepted

    def merge(self, other: DegradationSums) -> None:
        self.solo_filtered.merge(other.solo_filtered)
        self.co_filtered.merge(other.co_filtered)
        self.solo_all.merge(other.solo_all)
        self.co_all.merge(other.co_all)
        self.before_filtered.merge(other.before_filtered)
        self.after_filtered.merge(other.after_filtered)
        for mine, theirs in zip(self.second, other.second, strict=True):
            mine.merge(theirs)
        self.accepted += other.accepted
        self.rejected += other.rejected


@dataclass(frozen=True)
class LevelResult:
    """One sample length's evidence in a ``mixed_s`` estimate: its blocks (Alg. 4's counts), its
    refill-corrected D and standard error (None: no accepted block, or fewer than two), and whether
    the estimate used it."""

    sample_us: int
    blocks_used: int
    blocks_rejected: int
    degradation: float | None
    standard_error: float | None
    used: bool


@dataclass(frozen=True)
class DegradationResult:
    status: EstimateStatus
    degradation: float  # what pricing applies: the filtered estimate, clamped to [0, 1]; 0 without one
    filtered: float | None  # Alg. 4
    unfiltered: float | None
    blocks_used: int
    blocks_rejected: int
    corrected: float | None = None  # refill-corrected, over the blocks Alg. 4 accepts
    estimator: str = POPPA_ALG4  # which of the two ``degradation`` applies
    #: The applied estimate's standard error (``ratio_standard_error``) and the blocks behind it (the
    #: accepted ones, or every block for ``unfiltered``); None without an estimate or second moments.
    standard_error: float | None = None
    interval_blocks: int = 0
    #: ``mixed_s`` only: each sample length's evidence, by S (empty for the other estimators).
    levels: tuple[LevelResult, ...] = ()


def _moments_of(estimator: str, m: Sequence[float]) -> tuple[float, float, float]:
    """(sum x^2, sum xy, sum y^2) of an estimator's ratio from the ``SECOND_MOMENTS`` totals ``m``."""
    bb, dd, aa, bd, ba, da, dd_all, cc_all, dc_all = m
    if estimator == REFILL_CORRECTED:  # x = d + a - b, y = b
        return (math.fsum((dd, aa, bb, 2.0 * da, -2.0 * bd, -2.0 * ba)), math.fsum((bd, ba, -bb)), bb)
    if estimator == POPPA_ALG4:  # x = d, y = (b + a) / 2
        return dd, 0.5 * (bd + da), 0.25 * math.fsum((bb, 2.0 * ba, aa))
    return dd_all, dc_all, cc_all  # unfiltered: x = d, y = c over every block


def estimate(sums: DegradationSums, estimator: str = DEFAULT_ESTIMATOR,
             levels: Mapping[int, DegradationSums] | None = None) -> DegradationResult:
    """The estimate over ``sums``; for ``mixed_s`` also from ``levels``, the same blocks' sums per
    sample length S (None: every block at one S)."""
    per_s = None if levels is None else {s: totals_of(v) for s, v in levels.items()}
    return from_totals(totals_of(sums), estimator, per_s)


#: A ``DegradationSums`` correctly rounded: ``estimate_from_totals``'s first eight arguments, in order,
#: then the ``SECOND_MOMENTS`` totals.
Totals = tuple[float, float, float, float, int, int, float, float, tuple[float, ...]]


def from_totals(t: Totals, estimator: str = DEFAULT_ESTIMATOR,
                levels: Mapping[int, Totals] | None = None) -> DegradationResult:
    """``estimate_from_totals`` of ``Totals`` (and, for ``mixed_s``, of each sample length's)."""
    return estimate_from_totals(t[0], t[1], t[2], t[3], t[4], t[5], t[6], t[7], estimator, t[8], levels)


def totals_of(sums: DegradationSums) -> Totals:
    """``sums``' correctly rounded totals: ``estimate_from_totals``'s first eight arguments, in order,
    then the tuple of the ``SECOND_MOMENTS`` totals."""
    return (sums.solo_filtered.value, sums.co_filtered.value, sums.solo_all.value, sums.co_all.value,
            sums.accepted, sums.rejected, sums.before_filtered.value, sums.after_filtered.value,
            tuple(s.value for s in sums.second))


def estimate_from_totals(solo_filtered: float, co_filtered: float, solo_all: float, co_all: float,
                         accepted: int, rejected: int, before_filtered: float = 0.0, after_filtered: float = 0.0,
                         estimator: str = DEFAULT_ESTIMATOR, second: Sequence[float] | None = None,
                         levels: Mapping[int, Totals] | None = None) -> DegradationResult:
    """The applied estimate with its fallback rule, from correctly rounded exact sums; with the
    ``SECOND_MOMENTS`` totals ``second``, also its standard error.

    When the chosen estimate has no evidence (no block at all, or for Alg. 4 and the refill-
    corrected estimate no block that passed the filter), the job is charged as if undisturbed
    (D = 0, i.e. the standard price): a discount is only ever granted on measured evidence. The
    other estimates are still recorded for the auditor. ``blocks_used`` and ``blocks_rejected``
    are Alg. 4's counts whichever estimate applies.

    ``mixed_s`` also takes ``levels``: per sample length S, the same totals (as ``totals_of``
    gives them) over that S's blocks (``estimate_levels``).
    """
    if estimator not in ESTIMATORS:
        raise ValueError(f"unknown estimator {estimator!r}; known: {list(ESTIMATORS)}")
    if estimator == MIXED_S:
        pooled = estimate_from_totals(solo_filtered, co_filtered, solo_all, co_all, accepted, rejected,
                                      before_filtered, after_filtered, REFILL_CORRECTED, second)
        return estimate_levels(pooled, levels or {})
    n = accepted + rejected
    unfiltered = degradation_from_sums(solo_all, co_all) if n else None
    filtered = corrected = None
    if accepted:
        filtered = degradation_from_sums(solo_filtered, co_filtered)
        # accepted blocks have during > before, so the corrected solo IPC exceeds after >= 0
        corrected = degradation_from_sums(refill_corrected_solo(before_filtered, solo_filtered, after_filtered),
                                          before_filtered)
    chosen = {POPPA_ALG4: filtered, REFILL_CORRECTED: corrected, UNFILTERED: unfiltered}[estimator]
    if chosen is None:
        if n == 0:
            status = EstimateStatus.NO_BLOCKS
        elif estimator == UNFILTERED:  # its blocks show no progress alone (the filtered ones cannot: during > before)
            status = EstimateStatus.NO_PROGRESS_ALONE
        else:
            status = EstimateStatus.NO_ACCEPTED_BLOCKS
        return DegradationResult(status, 0.0, filtered, unfiltered, accepted, rejected, corrected, estimator)
    applied = min(1.0, max(0.0, chosen))  # Alg. 4's acceptance keeps the filtered one in (0, 1) already
    se, blocks = None, (n if estimator == UNFILTERED else accepted)
    if second is not None:
        sx, sy = {POPPA_ALG4: (solo_filtered, co_filtered), UNFILTERED: (solo_all, co_all),
                  REFILL_CORRECTED: (refill_corrected_solo(before_filtered, solo_filtered, after_filtered),
                                     before_filtered)}[estimator]
        se = ratio_standard_error(blocks, sx, sy, *_moments_of(estimator, second))
    return DegradationResult(EstimateStatus.OK, applied, filtered, unfiltered, accepted, rejected, corrected,
                             estimator, se, blocks)


def estimate_levels(pooled: DegradationResult, levels: Mapping[int, Totals]) -> DegradationResult:
    """``mixed_s``: ``shutter_policy.combine_levels`` over the refill-corrected estimate of each
    sample length's totals (``levels``: S -> ``totals_of``), with ``pooled``, the refill-corrected
    estimate over every block, as its fallback (no level of ``MIXED_N_MIN`` blocks) and for
    everything but D, its standard error and the blocks behind them. Every input is a correctly
    rounded exact sum, so the worker and both audits get the same bits. Parameters:
    ``shutter_policy.MIXED_N_MIN``, ``MIXED_Z``, ``MIXED_Z_FEW``, ``MIXED_TOL``."""
    per = {s: from_totals(t, REFILL_CORRECTED) for s, t in sorted(levels.items())
           if t[4] + t[5] > 0}  # t[4], t[5]: accepted, rejected
    got = None
    if pooled.status is EstimateStatus.OK:
        got = combine_levels({s: (r.blocks_used, r.corrected, math.inf if r.standard_error is None
                                  else r.standard_error)
                              for s, r in per.items() if r.blocks_used and r.corrected is not None},
                             MIXED_N_MIN, MIXED_Z, MIXED_Z_FEW, MIXED_TOL)
    used = set(got[2]) if got is not None else {s for s, r in per.items() if r.blocks_used}
    evidence = tuple(LevelResult(s, r.blocks_used, r.blocks_rejected, r.corrected, r.standard_error, s in used)
                     for s, r in per.items())
    if got is None:  # no estimate, or pooled: every block, as refill_corrected
        return replace(pooled, estimator=MIXED_S, levels=evidence)
    d, se, _ = got
    return replace(pooled, estimator=MIXED_S, degradation=min(1.0, max(0.0, d)), standard_error=se,
                   interval_blocks=sum(per[s].blocks_used for s in used), levels=evidence)


def filtered_degradation(blocks: Iterable[ShutterBlock | ShutterBatch], delta: float = DEFAULT_DELTA,
                         estimator: str = POPPA_ALG4) -> DegradationResult:
    """Alg. 4 (or the refill-corrected estimate) over blocks or batches (their valid blocks). Single
    blocks go one at a time through ``DegradationSums.add`` in scalar floats: the reference that
    tests hold the stream's vectorized batch fold to, bit for bit."""
    sums = DegradationSums()
    for b in blocks:
        if isinstance(b, ShutterBlock):  # one at a time, in scalar floats: the reference the batch fold must match
            sums.add(b, delta)
        else:
            rows = block_rows(b)
            sums.add_rows(rows, rows.valid, delta)
    return estimate(sums, estimator)


@dataclass
class Moments:
    """Count, exact sums of x and x², min and max of samples: ``SampleMoments`` in any order of arrival."""

    n: int = 0
    s1: ExactSum = field(default_factory=ExactSum)
    s2: ExactSum = field(default_factory=ExactSum)
    lo: float = math.inf
    hi: float = -math.inf

    def add(self, x: float) -> None:
        self.n += 1
        self.s1.add(x)
        self.s2.add(x * x)
        self.lo, self.hi = min(self.lo, x), max(self.hi, x)

    def merge(self, other: Moments) -> None:
        self.n += other.n
        self.s1.merge(other.s1)
        self.s2.merge(other.s2)
        self.lo, self.hi = min(self.lo, other.lo), max(self.hi, other.hi)

    def add_summary(self, m: SampleMoments, sign: int = 1) -> None:
        """Add (or, with sign -1, withdraw exactly) the sums of a ``SampleMoments``; min and max only grow."""
        self.n += sign * m.n
        self.s1.add(sign * m.sum)
        self.s2.add(sign * m.sum_sq)
        self.lo, self.hi = min(self.lo, m.min), max(self.hi, m.max)

    def summary(self) -> SampleMoments | None:
        if not self.n:
            return None
        return SampleMoments(n=self.n, sum=self.s1.value, sum_sq=self.s2.value, min=self.lo, max=self.hi)

    def feature(self) -> FeatureSummary:
        mean = self.s1.value / self.n
        sd = math.sqrt(max(0.0, self.s2.value / self.n - mean * mean))
        return FeatureSummary(mean=mean, min=self.lo, max=self.hi, sd=sd)
