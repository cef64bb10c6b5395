"""PTune (Seed 004, Section 5): a job's processor count, processors and caps under its power budget.

Sort the candidate processors by efficiency (their uncapped draw, Section 5.1); bound the count
between n_lo, the most processors that all fit at max power, and n_hi, the most that fit at min
power (Section 5.2); grow n from n_lo to n_hi, each step stealing min power for the next processor
from the donors that lose the least IPS and then shifting power from donor to receiver while the
receiver gains more than the donor loses (DistributePower, Eq. 4, Section 5.4); keep the n whose
job IPS is highest (Eq. 3), preferring fewer processors on a tie.

Power moves in chunks that end where a donor's or receiver's curve bends: within a linear piece
the paper's repeated delta-power moves choose the same donor and receiver, so one chunk is the
same as many deltas, only faster. On concave curves (which measured power-IPS curves are, see
Table 2) the result for each n is the optimum, which tests check against water-filling.
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass

from .curves import Curve, ProcessorId

#: Relative IPS improvement below which a larger n does not count as better (ties -> fewer processors).
TIE = 1e-12


@dataclass(frozen=True)
class Tuning:
    """PTune's answer for one job."""

    budget_mw: int
    n_lo: int  # n⊥: processors that fit at max power
    n_hi: int  # n⊤: processors that fit at min power
    n_opt: int  # 0 when the budget cannot run even one processor at min power
    processors: tuple[ProcessorId, ...]  # the chosen ones, most efficient first
    caps_mw: tuple[int, ...]
    ips: float  # JobIPS at n_opt, billions of instructions per second
    ips_by_n: tuple[tuple[int, float], ...]  # (n, JobIPS_n) for every n tried
    uniform_fallback: bool = False  # PTune's plan was not enough better than uniform power (see margin)

    @property
    def used_mw(self) -> int:
        return sum(self.caps_mw)


def by_efficiency(curves: Sequence[Curve]) -> list[Curve]:
    """Most efficient first: lowest uncapped draw, then highest uncapped IPS, then processor id."""
    return sorted(curves, key=lambda c: (c.max_mw, -c.ips[-1], c.processor))


class _Distribution:
    """Caps of a growing set of processors, with lazily invalidated heaps of the best receiver
    (highest marginal gain) and the best donor (lowest marginal loss). Each processor's cap is
    tracked with the linear piece it lies on, so a move costs a few list lookups."""

    def __init__(self) -> None:
        self.curves: list[Curve] = []
        self.caps: list[int] = []
        self.piece: list[int] = []  # index of the piece [p[k], p[k+1]) holding the cap (last point: len - 1)
        self.version: list[int] = []
        self.receivers: list[tuple[float, int, int]] = []  # (-gain per mW, index, version)
        self.donors: list[tuple[float, int, int]] = []  # (loss per mW, index, version)
        self.ips = 0.0

    def add(self, curve: Curve, cap_mw: int) -> None:
        self.curves.append(curve)
        self.caps.append(cap_mw)
        self.piece.append(min(bisect.bisect_right(curve.power_mw, cap_mw), len(curve.power_mw)) - 1)
        self.version.append(0)
        self.ips += curve.at(cap_mw)
        self._index(len(self.caps) - 1)

    def _gain(self, i: int) -> tuple[float, int]:
        p, k = self.curves[i].power_mw, self.piece[i]
        if k == len(p) - 1:
            return 0.0, 0
        return self.curves[i].slopes[k], p[k + 1] - self.caps[i]

    def _loss(self, i: int) -> tuple[float, int]:
        p, k, cap = self.curves[i].power_mw, self.piece[i], self.caps[i]
        if cap == p[k]:
            k -= 1
            if k < 0:
                return math.inf, 0
        return self.curves[i].slopes[k], cap - p[k]

    def _index(self, i: int) -> None:
        self.version[i] += 1
        v = self.version[i]
        curve, k, cap = self.curves[i], self.piece[i], self.caps[i]
        p, slopes = curve.power_mw, curve.slopes
        if k < len(p) - 1:  # can receive: the slope of its piece
            heapq.heappush(self.receivers, (-slopes[k], i, v))
        if cap > p[0]:  # can donate: the slope of the piece below the cap
            heapq.heappush(self.donors, (slopes[k - 1] if cap == p[k] else slopes[k], i, v))

    def _top(self, heap: list[tuple[float, int, int]]) -> int | None:
        version = self.version
        while heap:
            _, i, v = heap[0]
            if v == version[i]:
                return i
            heapq.heappop(heap)
        return None

    def _up(self, i: int, amount: int, gain: float) -> None:
        """Raise a cap by at most the room left on its piece."""
        self.caps[i] += amount
        self.ips += gain * amount
        if self.caps[i] == self.curves[i].power_mw[self.piece[i] + 1]:
            self.piece[i] += 1
        self._index(i)

    def _down(self, i: int, amount: int, loss: float) -> None:
        """Lower a cap by at most the room left on the piece below it."""
        if self.caps[i] == self.curves[i].power_mw[self.piece[i]]:
            self.piece[i] -= 1
        self.caps[i] -= amount
        self.ips -= loss * amount
        self._index(i)

    def steal(self, need_mw: int) -> None:
        """Power stealing: take need_mw from the donors that lose the least IPS."""
        while need_mw > 0:
            d = self._top(self.donors)
            if d is None:
                raise ValueError("not enough power above min power to steal from")
            loss, room = self._loss(d)
            take = min(need_mw, room)
            self._down(d, take, loss)
            need_mw -= take

    def shift(self, spare_mw: int) -> int:
        """Give spare power to the best receivers, then shift power from donor to receiver while
        the receiver gains more than the donor loses. Returns the spare power nobody could use.
        The hot loop of PTune: heap tops are read in place."""
        receivers, donors, version = self.receivers, self.donors, self.version
        pop = heapq.heappop
        for _ in range(1_000_000):  # a guard, never reached: every move ends at a bend
            while receivers and receivers[0][2] != version[receivers[0][1]]:
                pop(receivers)
            if not receivers:
                break
            neg_gain, r, _v = receivers[0]
            gain = -neg_gain
            if gain <= 0:
                break
            room_up = self.curves[r].power_mw[self.piece[r] + 1] - self.caps[r]
            if spare_mw > 0:
                give = min(spare_mw, room_up)
                self._up(r, give, gain)
                spare_mw -= give
                continue
            while donors and donors[0][2] != version[donors[0][1]]:
                pop(donors)
            if not donors:
                break
            loss, d, _v = donors[0]
            if d == r or gain <= loss:
                break
            amount = min(room_up, self._loss(d)[1])
            self._down(d, amount, loss)
            self._up(r, amount, gain)
        return spare_mw


def distribute_power(curves: Sequence[Curve], budget_mw: int) -> tuple[tuple[int, ...], float]:
    """DistributePower for a fixed set of processors: caps (same order as ``curves``) and job IPS.
    Used to re-tune a running job whose partition shrinks or grows (same processors, Section 6)."""
    need = sum(c.min_mw for c in curves)
    if budget_mw < need:
        raise ValueError(f"budget {budget_mw} mW below the processors' min power {need} mW")
    dist = _Distribution()
    for c in curves:
        dist.add(c, c.min_mw)
    dist.shift(budget_mw - need)
    return tuple(dist.caps), dist.ips


def bounds(ordered: Sequence[Curve], budget_mw: int, n_req: int) -> tuple[int, int]:
    """(n_lo, n_hi) of Section 5.2 over processors in efficiency order, at most n_req."""
    limit = min(n_req, len(ordered))
    n_lo = n_hi = 0
    at_max = at_min = 0
    for c in ordered[:limit]:
        at_max += c.max_mw
        at_min += c.min_mw
        if at_max <= budget_mw:
            n_lo += 1
        if at_min <= budget_mw:
            n_hi += 1
        else:
            break
    return n_lo, n_hi


def ptune(budget_mw: int, n_req: int, candidates: Sequence[Curve], margin: float = 0.0, n_min: int = 1) -> Tuning:
    """PTune(P_Ji, n): at most n_req of the candidate processors and their caps, maximizing job IPS.

    With ``margin`` > 0, PTune keeps uniform power on the n_req most efficient candidates unless
    its own plan is predicted to deliver at least that fraction more IPS: a predicted gain inside
    the characterization's measurement noise is not worth acting on (it can be a loss in truth).
    ``n_min`` is the fewest processors the job may run on (n_opt is 0 when not even those fit).
    """
    ordered = by_efficiency(candidates)
    n_lo, n_hi = bounds(ordered, budget_mw, n_req)
    if n_hi < max(n_min, 1):
        return Tuning(budget_mw, n_lo, n_hi, 0, (), (), 0.0, ())
    dist = _Distribution()
    start = max(n_lo, 1)
    for c in ordered[:start]:
        dist.add(c, min(c.max_mw, budget_mw))  # n_lo processors at max power (or one below it)
    spare = dist.shift(budget_mw - sum(dist.caps))
    history = [(start, dist.ips)]
    best_n, best_ips, best_caps = start, dist.ips, list(dist.caps)
    if start < n_min:
        best_ips = -math.inf
    for n in range(start + 1, n_hi + 1):
        new = ordered[n - 1]
        from_spare = min(spare, new.min_mw)
        spare -= from_spare
        dist.steal(new.min_mw - from_spare)
        dist.add(new, new.min_mw)
        spare = dist.shift(spare)
        history.append((n, dist.ips))
        if n >= n_min and (best_ips == -math.inf or dist.ips > best_ips * (1 + TIE)):
            best_n, best_ips, best_caps = n, dist.ips, list(dist.caps)
    chosen = ordered[:best_n]
    ips = sum(c.at(cap) for c, cap in zip(chosen, best_caps, strict=True))
    if margin > 0:
        requested = ordered[:min(n_req, len(ordered))]
        even = uniform(budget_mw, requested)
        if even is not None and ips < even[1] * (1 + margin):
            return Tuning(budget_mw, n_lo, n_hi, len(requested), tuple(c.processor for c in requested), even[0],
                          even[1], tuple(history), uniform_fallback=True)
    return Tuning(budget_mw, n_lo, n_hi, best_n, tuple(c.processor for c in chosen), tuple(best_caps), ips,
                  tuple(history))


def uniform(budget_mw: int, curves: Sequence[Curve]) -> tuple[tuple[int, ...], float] | None:
    """The naive baseline: the budget split evenly over all the processors (each capped at its max);
    None when the even share is below a processor's min power."""
    if not curves:
        return None
    share = budget_mw // len(curves)
    if any(share < c.min_mw for c in curves):
        return None
    caps = tuple(min(share, c.max_mw) for c in curves)
    return caps, sum(c.at(cap) for c, cap in zip(curves, caps, strict=True))
