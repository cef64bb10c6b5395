"""Power-IPS characterization (Seed 004, Table 2): what each processor delivers under each cap.

A processor's curve for one program is the piecewise-linear map from the power it draws to the
instructions it retires per second, through the characterization points (cap, IPS, measured
power) of Table 2. The x axis is the *measured* power: a cap above what the processor draws
uncapped buys nothing, so the curve ends at the processor's uncapped draw (its max power for
that program) and caps are never set above it.

Power is held in integer milliwatts so that budgets, caps and their sums are exact and every
decision is reproducible bit for bit.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property

from nodeshare.schemas.events import PowerReading

ProcessorId = tuple[str, int]  # (node, processor index on the node)

#: Program key used when the running program has no characterization of its own.
ANY_PROGRAM = "*"

#: The lowest cap ever planned (1 W): an inventory's min_watts of 0 is read as this, since an agent
#: refuses a cap of 0 W (powercap limits must be positive).
MIN_CAP_MW = 1000


def to_mw(watts: float) -> int:
    return round(watts * 1000)


def to_w(milliwatts: int) -> float:
    return milliwatts / 1000


@dataclass(frozen=True)
class Curve:
    """IPS (billions of instructions per second) of one processor as a function of its power.

    ``power_mw[0]`` is the minimum cap (min power), ``power_mw[-1]`` the uncapped draw (max power);
    between points the curve is linear, beyond the last point it is flat.
    """

    processor: ProcessorId
    power_mw: tuple[int, ...]
    ips: tuple[float, ...]

    def __post_init__(self) -> None:
        if not self.power_mw or len(self.power_mw) != len(self.ips):
            raise ValueError(f"curve of {self.processor}: needs equal, non-empty power and IPS points")
        if any(b <= a for a, b in zip(self.power_mw, self.power_mw[1:], strict=False)):
            raise ValueError(f"curve of {self.processor}: power points must strictly increase")

    @cached_property
    def slopes(self) -> tuple[float, ...]:
        """IPS per mW of each linear piece."""
        p, v = self.power_mw, self.ips
        return tuple((v[i + 1] - v[i]) / (p[i + 1] - p[i]) for i in range(len(p) - 1))

    @property
    def min_mw(self) -> int:
        return self.power_mw[0]

    @property
    def max_mw(self) -> int:
        return self.power_mw[-1]

    def at(self, cap_mw: int) -> float:
        """getProcIPS (Eq. 4): the IPS under a cap; below min power the processor is not usable."""
        p = self.power_mw
        if cap_mw < p[0]:
            raise ValueError(f"cap {cap_mw} mW of {self.processor} below min power {p[0]} mW")
        if cap_mw >= p[-1]:
            return self.ips[-1]
        i = bisect.bisect_right(p, cap_mw) - 1
        return self.ips[i] + (self.ips[i + 1] - self.ips[i]) * (cap_mw - p[i]) / (p[i + 1] - p[i])


def curve_from_points(processor: ProcessorId, min_mw: int, points: Iterable[tuple[int, float]]) -> Curve:
    """A curve through characterization points (measured power mW, IPS), starting at min power.

    The curve is the least concave majorant of the points: IPS never falls with more power, and
    each extra watt buys no more than the one before. The physics is concave (power grows with
    f**3, IPS at most with f), so a measured dip or kink is noise; and on concave curves PTune's
    greedy stealing and shifting is optimal. The value at min power is interpolated, or, when every
    point lies above it, extrapolated along the first measured piece.
    """
    best: dict[int, float] = {}  # one point per power: two cap levels can measure the same draw
    for p, v in points:
        if p > 0 and math.isfinite(v) and v >= 0:
            best[p] = max(v, best.get(p, v))
    pts = sorted(best.items())
    if not pts:
        raise ValueError(f"no characterization points for {processor}")
    above = [(p, v) for p, v in pts if p > min_mw]
    below = [(p, v) for p, v in pts if p <= min_mw]
    if below and above and below[-1][0] < min_mw:  # interpolate to min power
        (pa, va), (pb, vb) = below[-1], above[0]
        start = va + (vb - va) * (min_mw - pa) / (pb - pa)
    elif below:
        start = max(v for _, v in below)
    elif len(above) >= 2:  # no measurement at or below min power: extend the first piece down
        (p0, v0), (p1, v1) = above[0], above[1]
        start = max(0.0, v0 - (v1 - v0) * (p0 - min_mw) / (p1 - p0))
    else:  # a single point: through the origin
        p0, v0 = above[0]
        start = v0 * min_mw / p0
    hull: list[tuple[int, float]] = [(min_mw, start)]
    for p, v in above:
        if v <= hull[-1][1]:
            continue  # more power, no more IPS: saturated
        while len(hull) >= 2:  # drop the last point while it lies on or below the chord
            (x0, y0), (x1, y1) = hull[-2], hull[-1]
            if (y1 - y0) * (p - x0) <= (v - y0) * (x1 - x0):
                hull.pop()
            else:
                break
        hull.append((p, v))
    return Curve(processor, tuple(p for p, _ in hull), tuple(v for _, v in hull))


@dataclass(frozen=True)
class CharacterizationRow:
    """One row of Table 2 for one processor and program: a cap, the IPS and the power measured."""

    node: str
    processor: int
    program: str
    cap_watts: float
    ips: float  # billions of instructions per second
    measured_watts: float


@dataclass
class Characterization:
    """Per program and processor, the rolling power-IPS points (Seed 004, Table 2).

    Built from a characterization file or updated from ``node.power`` readings: each reading is an
    observation (measured power, IPS) under a cap level, folded into an exponentially weighted
    mean per (program, processor, cap level). Unavailable readings are skipped, never read as zero.
    """

    smoothing: float = 0.25  # weight of a new reading in the rolling mean
    points: dict[str, dict[ProcessorId, dict[int, tuple[float, float, int]]]] = field(default_factory=dict)
    _curves: dict[tuple[str, ProcessorId], Curve] = field(default_factory=dict, repr=False)
    _bounds: dict[tuple[str, ProcessorId], tuple[int, int | None]] = field(default_factory=dict, repr=False)

    def add(self, program: str, processor: ProcessorId, cap_watts: float, ips: float, measured_watts: float) -> bool:
        """Fold one observation in; False (and nothing changes) when it carries no usable numbers."""
        if not (math.isfinite(ips) and math.isfinite(measured_watts) and ips >= 0 and measured_watts > 0):
            return False
        level = to_mw(cap_watts) if math.isfinite(cap_watts) and cap_watts > 0 else 0  # 0: uncapped
        by_level = self.points.setdefault(program, {}).setdefault(processor, {})
        old = by_level.get(level)
        if old is None:
            by_level[level] = (measured_watts, ips, 1)
        else:
            a = self.smoothing
            by_level[level] = ((1 - a) * old[0] + a * measured_watts, (1 - a) * old[1] + a * ips, old[2] + 1)
        self._curves.pop((program, processor), None)
        return True

    def add_reading(self, reading: PowerReading, program: str | None = None) -> bool:
        """Fold a ``node.power`` reading in. It needs numbers, instructions and an interval, and a
        program (its own field or the caller's knowledge of what ran there)."""
        prog = reading.program or program
        if (not reading.available or reading.watts is None or reading.instructions is None
                or reading.interval_s is None or prog is None):
            return False
        ips = reading.instructions / reading.interval_s / 1e9
        cap = reading.cap_watts if reading.cap_watts is not None else 0.0
        return self.add(prog, (reading.node, reading.processor), cap, ips, reading.watts)

    def curve(self, program: str, processor: ProcessorId, min_mw: int, max_mw: int | None = None) -> Curve | None:
        """The processor's curve for the program (falling back to ``ANY_PROGRAM``), or None; from
        ``min_mw``, and cut at ``max_mw`` (the inventory's max: a draw measured above it is never a cap)."""
        for prog in (program, ANY_PROGRAM):
            by_level = self.points.get(prog, {}).get(processor)
            if not by_level:
                continue
            key = (prog, processor)
            cached = self._curves.get(key)
            if cached is None or self._bounds.get(key) != (min_mw, max_mw):
                cached = curve_from_points(processor, min_mw, ((to_mw(w), ips) for w, ips, _ in by_level.values()))
                if max_mw is not None:
                    cached = cut(cached, max_mw)
                self._curves[key], self._bounds[key] = cached, (min_mw, max_mw)
            return cached
        return None

    def readings(self) -> int:
        return sum(n for procs in self.points.values() for levels in procs.values() for *_, n in levels.values())

    @classmethod
    def from_rows(cls, rows: Iterable[CharacterizationRow]) -> Characterization:
        char = cls()
        for r in rows:
            char.add(r.program, (r.node, r.processor), r.cap_watts, r.ips, r.measured_watts)
        return char


def cut(curve: Curve, max_mw: int) -> Curve:
    """The curve up to ``max_mw`` (interpolated there); unchanged when it ends at or below it."""
    if curve.max_mw <= max_mw:
        return curve
    keep = [i for i, p in enumerate(curve.power_mw) if p < max_mw]  # never empty: power_mw[0] is min <= max
    if not keep:
        return Curve(curve.processor, (curve.min_mw,), (curve.ips[0],))
    return Curve(curve.processor, (*(curve.power_mw[i] for i in keep), max_mw),
                 (*(curve.ips[i] for i in keep), curve.at(max_mw)))


def linear_curve(processor: ProcessorId, min_mw: int, max_mw: int) -> Curve:
    """The fallback for a processor nobody characterized: IPS proportional to power up to its max.
    It makes PTune spend power evenly and never favours an unknown processor."""
    if max_mw <= min_mw:
        return Curve(processor, (min_mw,), (float(min_mw) / 1000,))
    return Curve(processor, (min_mw, max_mw), (min_mw / 1000, max_mw / 1000))


def curves_for(char: Characterization, program: str, processors: Sequence[ProcessorId],
               limits: Mapping[ProcessorId, tuple[int, int]]) -> list[Curve]:
    """Curves of the given processors for a program; ``limits`` gives each one's (min, max) mW from
    the inventory, used for processors without characterization."""
    out = []
    for proc in processors:
        lo, hi = limits[proc]
        c = char.curve(program, proc, lo, hi)
        out.append(c if c is not None else linear_curve(proc, lo, hi))
    return out
