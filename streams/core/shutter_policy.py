"""An adaptive shutter schedule (issue 36, part 2): which sample length S the next shutter of a
job uses, and the degradation estimate over blocks taken at several S.

Why: at a fixed S = 3.2 ms a cache-hungry program's share of the LLC has not refilled by the end
of the window it runs alone, so the IPC measured "alone" is too low and D is underestimated
(twolf: true 6.9%, measured 0.9%); at a fixed S = 51.2 ms every P = 3.2 s the refill fits, but a
short job gets one or two blocks. The policy spends each job's overhead budget where it is needed:

* **Dense start**: the shortest S on every turn until the job has ``n_start`` accepted blocks
  (or has taken ``start_tries`` times as many there: a job whose IPC is still climbing after a
  short window has every short block rejected by Alg. 4, and a longer S is its only measurement).
* **Probe the ladder** (3.2, 12.8, 51.2 ms): take ``n_level`` blocks at the longest S. A shorter
  S whose estimate is lower than the longest's beyond noise is biased by the refill (the cache
  has not refilled within its window). The job settles at the shortest S that agrees with the
  longest, probing the S in between when the shortest disagrees, and keeps ``check_share`` of
  its sampling time at the longest S, so a disagreement that needs more blocks is still seen.
* **Fill while waiting**: while a longer S waits for budget, a shortest sample is taken as long
  as the time at the shortest S (beyond the dense start's ``n_start`` blocks) stays under
  ``fill_share`` of the time at longer S: short samples keep coming (phases, noise) without
  starving the long ones. Time counts every block taken, accepted or rejected: a rejected block
  paused its co-runners too.
* **Tried out**: a level that has taken ``start_tries`` times the accepted blocks it needs
  without getting them (Alg. 4 rejects this job's blocks at that S) is neither probed nor used
  to fill again; the job goes on at the S above it.
* **Sparser once tight**: when the estimate's standard error is below ``tight_se`` the job is
  shuttered every ``sparse_factor``-th turn only.
* **Overhead budget (Eq. 9-10)**: a shutter of S pauses every co-runner for K*S. It is taken only
  if each paused co-runner's pause so far plus K*S stays within ``budget_share`` of the time it
  has run (plus an allowance of one shortest sample); otherwise the job waits for a later turn.
  So no job is ever paused more than ``budget_share`` of its run (plus one shortest sample).

:func:`mixed_estimate` is the estimator for a job whose blocks were taken at several S: the
refill-corrected estimate (IPC_solo = during + (after - before), IPC_co = before, over the blocks
Alg. 4 accepts) per S level; the longest level with an accepted block is trusted (a level with
few blocks borrows the per-block spread of the others), and the shorter levels that agree with it
within noise are combined with it by inverse variance (they measure the same D more often). A
shorter level that is lower beyond noise is biased by the refill and left out. With blocks at one
S only it is exactly the refill-corrected estimate.

Pure: no clock, no I/O. The node agent and the simulator keep the per-job state and call
:meth:`ShutterPolicy.choose` on each turn of a job.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .ipc import ratio_standard_error

if TYPE_CHECKING:  # numpy only where arrays are passed: the agent's slim install has none
    import numpy as np

#: Alg. 4's delta (Seed 002, Section 6.3).
DELTA = 0.05
LADDER_US: tuple[int, ...] = (3200, 12800, 51200)


@dataclass
class LevelStats:
    """Moments of the accepted blocks of one job at one S: x = during + after - before (the
    refill-corrected solo IPC), y = before (the co-located IPC); D = 1 - sum(y) / sum(x)."""

    n: int = 0
    sx: float = 0.0
    sy: float = 0.0
    sxx: float = 0.0
    syy: float = 0.0
    sxy: float = 0.0
    rejected: int = 0

    def add(self, before: float, during: float, after: float, delta: float = DELTA) -> bool:
        """One block's mean IPCs; False (and counted as rejected) when Alg. 4 rejects it."""
        if not (abs(before - after) < delta and before < during and after < during):
            self.rejected += 1
            return False
        x, y = during + after - before, before
        self.n += 1
        self.sx += x
        self.sy += y
        self.sxx += x * x
        self.syy += y * y
        self.sxy += x * y
        return True

    def add_many(self, before: np.ndarray, during: np.ndarray, after: np.ndarray, delta: float = DELTA) -> None:
        import numpy as np

        keep = (np.abs(before - after) < delta) & (before < during) & (after < during)
        self.rejected += int((~keep).sum())
        self.add_xy((during + after - before)[keep], before[keep])

    def add_xy(self, x: np.ndarray, y: np.ndarray) -> None:
        """Blocks already chosen, as their refill-corrected solo IPCs ``x`` and co-located IPCs ``y``."""
        self.n += len(x)
        self.sx += float(x.sum())
        self.sy += float(y.sum())
        self.sxx += float(x @ x)
        self.syy += float(y @ y)
        self.sxy += float(x @ y)

    @property
    def taken(self) -> int:
        """Blocks taken at this S, accepted or not: what they cost in pauses."""
        return self.n + self.rejected

    def merged(self, other: LevelStats) -> LevelStats:
        return LevelStats(self.n + other.n, self.sx + other.sx, self.sy + other.sy, self.sxx + other.sxx,
                          self.syy + other.syy, self.sxy + other.sxy, self.rejected + other.rejected)

    @property
    def degradation(self) -> float | None:
        return None if not self.sx > 0.0 else 1.0 - self.sy / self.sx

    @property
    def se(self) -> float:
        """Standard error of D (the ratio estimator's linearisation); inf below two blocks."""
        se = ratio_standard_error(self.n, self.sx, self.sy, self.sxx, self.sxy, self.syy)
        return math.inf if se is None else se


@dataclass(frozen=True)
class MixedEstimate:
    degradation: float | None  # None: no accepted block at any S (charged as undisturbed, as today)
    se: float
    level_us: int | None  # the longest level trusted
    levels_used: tuple[int, ...]  # the S levels pooled
    blocks: int  # accepted blocks behind the estimate


def _higher(a: LevelStats, b: LevelStats, z: float, tol: float) -> bool:
    """True when a's estimate exceeds b's beyond noise (z standard errors plus ``tol``)."""
    da, db = a.degradation, b.degradation
    if da is None or db is None:
        return False
    return da - db > z * math.hypot(a.se, b.se) + tol


#: ``mixed_estimate``'s parameters, which the fold's ``mixed_s`` estimator applies too
#: (streams.core.degradation.MIXED_S): blocks a level needs for its own spread, standard errors of
#: the difference that leave a shorter level out (with the longest level's own spread, and with a
#: borrowed one), and the difference in D (0.2 pp) below which a level is never left out.
MIXED_N_MIN, MIXED_Z, MIXED_Z_FEW, MIXED_TOL = 4, 1.0, 2.0, 0.002


def has_own_spread(n: int, se: float, n_min: int = MIXED_N_MIN) -> bool:
    """Whether a level of ``n`` accepted blocks and standard error ``se`` (inf below two blocks) has
    a spread of its own: ``combine_levels`` checks shorter levels against the longest at full
    strength (``MIXED_Z``) only when it has."""
    return n >= n_min and math.isfinite(se)


def _level_errors(levels: Mapping[int, tuple[int, float, float]], n_min: int, z: float,
                  z_few: float) -> tuple[dict[int, float], float] | None:
    """``combine_levels``' standard error of each level (its own, or the largest per-block spread
    of the levels with one of their own, over sqrt(n)) and the z its shorter levels are tested at;
    None when no level has a spread of its own."""
    full = [s for s, (n, _, se) in levels.items() if has_own_spread(n, se, n_min)]
    if not full:
        return None
    spread = max(levels[s][2] * math.sqrt(levels[s][0]) for s in full)
    se = {s: e if s in full else spread / math.sqrt(n) for s, (n, _, e) in levels.items()}
    return se, z if max(levels) in full else z_few


def combine_levels(levels: Mapping[int, tuple[int, float, float]], n_min: int = MIXED_N_MIN, z: float = MIXED_Z,
                   z_few: float = MIXED_Z_FEW, tol: float = MIXED_TOL) -> tuple[float, float, tuple[int, ...]] | None:
    """``mixed_estimate``'s rule on per-S (accepted blocks n >= 1, D, standard error; inf below two
    blocks): (D, its standard error, the levels used), or None when no level has ``n_min`` blocks and
    a finite error (the caller then pools every block). Plain float arithmetic in a fixed order, so
    the same inputs give the same bits everywhere. One level used: its own D and error, unchanged."""
    errors = _level_errors(levels, n_min, z, z_few)
    if errors is None:
        return None
    se, zz = errors
    d = {s: v[1] for s, v in levels.items()}
    top = max(levels)
    used = [s for s in sorted(levels) if s == top or not d[top] - d[s] > zz * math.hypot(se[top], se[s]) + tol]
    if len(used) == 1:
        return d[top], se[top], (top,)
    w = [1.0 / max(se[s], 1e-6) ** 2 for s in used]
    est = math.fsum(wi * d[s] for wi, s in zip(w, used, strict=True)) / math.fsum(w)
    return est, 1.0 / math.sqrt(math.fsum(w)), tuple(used)


def trusted_level_below(levels: Mapping[int, tuple[int, float, float]], n_min: int = MIXED_N_MIN,
                        z: float = MIXED_Z, z_few: float = MIXED_Z_FEW,
                        tol: float = MIXED_TOL) -> tuple[float, float, int] | None:
    """The longest level's (D, standard error as ``combine_levels`` takes it, accepted blocks) when
    ``combine_levels`` kept a shorter level that reads *higher* than it by more than the noise for
    which it would have left a lower one out; else None (one level, nothing kept, or all agree).
    The rule keeps such a level (a shorter S is only ever biased low by the refill, and a high D
    undercharges), so the combined D sits above what the trusted level measured: where phases are
    shorter than a long sample, Alg. 4 keeps the short blocks whose solo IPC beats the IPC around
    them, and those read high. The interval then reaches down to the trusted level's own
    (``confidence.degradation_interval``)."""
    errors = _level_errors(levels, n_min, z, z_few)
    if errors is None or len(levels) < 2:
        return None
    se, zz = errors
    top = max(levels)
    n_top, d_top, _ = levels[top]
    for s, (_, d_s, _) in levels.items():
        if s != top and d_s - d_top > zz * math.hypot(se[top], se[s]) + tol:
            return d_top, se[top], n_top
    return None


def mixed_estimate(levels: Mapping[int, LevelStats], n_min: int = MIXED_N_MIN, z: float = MIXED_Z,
                   z_few: float = MIXED_Z_FEW, tol: float = MIXED_TOL) -> MixedEstimate:
    """The estimate over blocks grouped by S (see the module doc).

    The longest S with an accepted block is trusted. A level with fewer than ``n_min`` blocks
    has no spread of its own worth the name: it borrows the largest per-block spread of the
    levels that have ``n_min`` (se = spread / sqrt(n)), so a short job's one or two long blocks
    still count. A shorter S is left out when it is lower than the trusted one by more than ``z``
    standard errors of the difference (``z_few`` when the trusted level borrowed its spread)
    plus ``tol``: the test is one-sided because a shorter S can only be biased low (its window
    ends before the cache has refilled), and a bias as large as the noise is already worth
    leaving out, since a low D overcharges. The levels kept are combined by inverse variance.
    Without any level of ``n_min`` blocks, all blocks are pooled (refill-corrected).

    From float running sums (the policy's and the prototype's); the fold's ``mixed_s`` applies
    :func:`combine_levels` to correctly rounded exact sums instead."""
    have = {s: st for s, st in levels.items() if st.n and st.degradation is not None}
    got = combine_levels({s: (st.n, float(st.degradation), st.se) for s, st in have.items()},  # type: ignore[arg-type]
                         n_min, z, z_few, tol)
    if got is None:
        pooled = LevelStats()
        for st in levels.values():
            pooled = pooled.merged(st)
        seen = tuple(sorted(s for s, st in levels.items() if st.n))
        return MixedEstimate(pooled.degradation, pooled.se, max(seen) if seen else None, seen, pooled.n)
    est, se, used = got
    return MixedEstimate(est, se, max(have), used, sum(have[s].n for s in used))


@dataclass(frozen=True)
class Shutter:
    sample_us: int  # S of this shutter
    k: int  # samples per window
    period_ms: int  # P: the pause before this job's next turn may come


@dataclass(frozen=True)
class ShutterPolicy:
    ladder_us: tuple[int, ...] = LADDER_US
    k: int = 1
    period_ms: int = 200  # P at the shortest S, as the fixed default
    n_start: int = 6  # accepted blocks at the shortest S before probing longer
    #: ... or this many times n_start blocks taken there: a job whose short blocks Alg. 4 rejects
    #: (its IPC still climbing after the window: cactusADM06) is measured at longer S instead
    start_tries: int = 4
    n_level: int = 4  # accepted blocks at a level before it is compared with the one below
    check_share: float = 0.25  # sampling time kept at the longest S once settled, per unit at the settled S
    fill_share: float = 0.25  # while a longer S waits for budget: shortest-S time allowed per unit of longer-S time
    z: float = 2.0
    tol: float = 0.002  # 0.2 pp: a smaller difference between levels is not worth longer samples
    tight_se: float = 0.0025  # 0.25 pp
    sparse_factor: int = 4
    budget_share: float = 0.009  # Eq. 9's paused share allowed per job (1% with a margin for Eq. 10)

    @classmethod
    def from_shortest(cls, sample_us: int, k: int = 1, period_ms: int = 200) -> ShutterPolicy:
        """The schedule a site's shutter settings name: the ladder S, 4 S, 16 S from the shortest S,
        K samples per window, P at the shortest S (the settings' ``sample_us``, ``samples_per_region``
        and ``period_ms``; the default ladder is 3.2, 12.8 and 51.2 ms)."""
        return cls(ladder_us=(sample_us, 4 * sample_us, 16 * sample_us), k=k, period_ms=period_ms)

    def __post_init__(self) -> None:
        if not self.ladder_us or list(self.ladder_us) != sorted(set(self.ladder_us)) or self.ladder_us[0] < 1:
            raise ValueError("the ladder is increasing positive sample lengths")
        if self.k < 1 or self.period_ms < 0 or not 0.0 < self.budget_share < 1.0:
            raise ValueError("K >= 1, P >= 0 and 0 < budget_share < 1")

    def allowance_s(self) -> float:
        return self.k * self.ladder_us[0] / 1e6

    def pause_budget_s(self, run_s: float, paused_s: float) -> float:
        """How much more a co-runner that has run ``run_s`` and been paused ``paused_s`` may be paused now."""
        return self.budget_share * max(0.0, run_s) + self.allowance_s() - paused_s

    def tried_out(self, st: LevelStats | None, need: int) -> bool:
        """A level that has taken ``start_tries`` times the ``need`` accepted blocks it has not got:
        Alg. 4 rejects this job's blocks at this S (its IPC still climbs after the window), so more
        of them would spend the co-runners' budget on nothing."""
        return st is not None and st.n < need and st.taken >= self.start_tries * need

    def fill_us(self, st: LevelStats | None) -> float:
        """Time (us) the job's shortest-S samples have taken beyond the dense start's ``n_start``:
        every block taken counts (each paused the co-runners), so the dense start's rejected blocks
        count too and the fill starts later for a job whose short blocks Alg. 4 often rejects."""
        return 0.0 if st is None else max(0, st.taken - self.n_start) * self.ladder_us[0]

    def target_us(self, levels: Mapping[int, LevelStats]) -> int:
        """The S the job's measurement needs next, ignoring the budget.

        After the dense start, the longest S is probed first (the one a refill fits best); the
        job then settles at the shortest probed S that agrees with it, probing a level in
        between where the shorter one disagrees, and keeps a share of its sampling time at the
        longest S as a check."""
        lad = self.ladder_us

        def n(s: int) -> int:
            st = levels.get(s)
            return st.n if st else 0

        if n(lad[0]) < self.n_start and not self.tried_out(levels.get(lad[0]), self.n_start):
            return lad[0]
        top = lad[-1]
        if n(top) < self.n_level:
            return top
        probed = [s for s in lad if n(s) >= self.n_level]
        settle = min(s for s in probed if s == top or not _higher(levels[top], levels[s], self.z, self.tol))
        lower = [s for s in probed if s < settle]
        between = [s for s in lad if s < settle and (not lower or s > lower[-1]) and n(s) < self.n_level
                   and not self.tried_out(levels.get(s), self.n_level)]
        if between:
            return between[0]
        if settle != top and n(top) * top < self.check_share * n(settle) * settle:
            return top
        return settle

    def choose(self, levels: Mapping[int, LevelStats], co_budget_s: float) -> Shutter | None:
        """This turn's shutter for the job, or None to skip the turn.

        ``levels``: the job's accepted-block moments per S so far; ``co_budget_s``: the smallest
        :meth:`pause_budget_s` over the co-runners the shutter would pause."""
        s = self.target_us(levels)
        if self.k * s / 1e6 > co_budget_s:
            # the longer S waits for budget; meanwhile a few shortest samples, earned by the longer ones
            short = self.ladder_us[0]
            st = levels.get(short)
            t_long = sum(v.taken * u for u, v in levels.items() if u > short)
            if (s == short or self.k * short / 1e6 > co_budget_s or self.fill_us(st) >= self.fill_share * t_long
                    or self.tried_out(st, self.n_start)):
                return None
            s = short
        est = mixed_estimate(levels, self.n_level)
        st = levels.get(s)
        probing = st is None or st.n < max(self.n_level, self.n_start if s == self.ladder_us[0] else 0)
        sparse = not probing and est.se <= self.tight_se
        return Shutter(s, self.k, self.period_ms * (self.sparse_factor if sparse else 1))


def levels_of(groups: Sequence[tuple[int, np.ndarray]], delta: float = DELTA) -> dict[int, LevelStats]:
    """Per-S moments from (sample_us, (n, 3) block means before/during/after) groups."""
    out: dict[int, LevelStats] = {}
    for s, m in groups:
        st = out.setdefault(int(s), LevelStats())
        if len(m):
            st.add_many(m[:, 0], m[:, 1], m[:, 2], delta)
    return out
