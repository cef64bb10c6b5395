"""A simulated processor population with manufacturing variation, for PTune/PPartition (Seed 004).

Each processor draws ``static + activity * dynamic * f**3`` watts at frequency f (GHz) and retires
``gips_per_ghz * f**beta`` billion instructions per second, up to turbo (3.2 GHz). Static and
dynamic power vary from chip to chip, so under a cap an efficient chip runs faster than an
inefficient one, and the gap is widest at low power (Seed 004, Section 2 and Fig. 4): about 30%
at 51 W, a few percent near TDP. The median chip running EP reproduces Table 2 of Seed 004
(IPS at caps of 60/80/100/120 W) within 10%.

The four programs of the paper differ in activity (how much dynamic power a cycle costs) and in
how their IPS scales with frequency (beta < 1 for the memory-bound ones), so their power-IPS
curves and uncapped draws differ. Characterization rows have the shape of Table 2: cap, IPS,
measured power, with measurement noise; experiments judge decisions against the noiseless model.
"""

from __future__ import annotations

import csv
import uuid
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

import numpy as np

from nodeshare.schemas.events import NodeInventory, PowerReading, ProcessorSpec
from nodeshare.streams.core.power.curves import CharacterizationRow

MIN_WATTS = 51.0  # the architecture's lower bound on a cap (Seed 004: Ivy Bridge, 51 W)
TDP_WATTS = 120.0
#: Seed 004: 15 power levels from 51 to 120 W.
CAP_LEVELS: tuple[float, ...] = tuple(float(round(x, 3)) for x in np.linspace(MIN_WATTS, TDP_WATTS, 15))
F_MIN_GHZ, F_MAX_GHZ = 1.2, 3.2
NAMESPACE = uuid.UUID("9a8c4772-62f0-02c6-0000-000000000004")


@dataclass(frozen=True)
class ProgramPower:
    name: str
    activity: float  # multiplies the chip's dynamic power coefficient
    gips_per_ghz: float  # billion instructions per second per GHz (12 cores)
    beta: float  # IPS ~ f**beta: 1 compute bound, lower when memory stalls do not shrink with f


#: EP, BT, SP (NPB) and CoMD (Mantevo), the programs of Seed 004's evaluation.
PROGRAMS: dict[str, ProgramPower] = {p.name: p for p in (
    ProgramPower("EP", 1.00, 24.7, 1.00),
    ProgramPower("BT", 0.95, 22.0, 0.90),
    ProgramPower("SP", 0.85, 18.0, 0.75),
    ProgramPower("CoMD", 1.05, 20.0, 0.95),
)}


@dataclass(frozen=True)
class Chip:
    node: str
    processor: int
    static_w: float
    dynamic_w_per_ghz3: float

    @property
    def id(self) -> tuple[str, int]:
        return (self.node, self.processor)

    def uncapped_watts(self, prog: ProgramPower) -> float:
        return self.static_w + prog.activity * self.dynamic_w_per_ghz3 * F_MAX_GHZ**3

    def frequency(self, prog: ProgramPower, cap_w: float) -> float:
        if cap_w >= self.uncapped_watts(prog):
            return F_MAX_GHZ
        if cap_w <= self.static_w:
            return F_MIN_GHZ  # the cap cannot be honoured; the chip runs at its floor
        return max(F_MIN_GHZ, ((cap_w - self.static_w) / (prog.activity * self.dynamic_w_per_ghz3)) ** (1 / 3))

    def gips(self, prog: ProgramPower, cap_w: float) -> float:
        """The true IPS (billions) of this chip running the program under a cap."""
        return prog.gips_per_ghz * self.frequency(prog, cap_w) ** prog.beta

    def watts(self, prog: ProgramPower, cap_w: float) -> float:
        """The true power drawn under a cap."""
        return self.static_w + prog.activity * self.dynamic_w_per_ghz3 * self.frequency(prog, cap_w) ** 3


def population(n: int = 600, seed: int = 4, per_node: int = 2) -> list[Chip]:
    """n chips, ``per_node`` to a node (node names ``pnode0000``...), with manufacturing variation."""
    rng = np.random.default_rng(seed)
    static = rng.uniform(41.5, 46.5, n)  # leakage: the main source of variation at low power
    dynamic = 1.851 * rng.uniform(0.96, 1.04, n) * (1 + 0.02 * (static - 44.0) / 2.5)  # leaky chips also switch worse
    return [Chip(f"pnode{i // per_node:04d}", i % per_node, float(s), float(d))
            for i, (s, d) in enumerate(zip(static, dynamic, strict=True))]


def characterization(chips: Sequence[Chip], programs: Iterable[str] = tuple(PROGRAMS), seed: int = 4,
                     levels: Sequence[float] = CAP_LEVELS, noise: float = 0.005) -> list[CharacterizationRow]:
    """Table-2 rows for every chip, program and cap level, as a profiler would measure them."""
    rng = np.random.default_rng(seed + 1)
    rows = []
    for name in programs:
        prog = PROGRAMS[name]
        for chip in chips:
            for cap in levels:
                ips = chip.gips(prog, cap) * (1 + noise * rng.standard_normal())
                measured = chip.watts(prog, cap) - abs(0.3 * rng.standard_normal())
                rows.append(CharacterizationRow(chip.node, chip.processor, name, cap, round(ips, 4),
                                                round(measured, 3)))
    return rows


CSV_FIELDS = ("node", "processor", "program", "cap_watts", "ips", "measured_watts")


def write_characterization(rows: Iterable[CharacterizationRow], path: Path) -> int:
    n = 0
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(CSV_FIELDS)
        for r in rows:
            w.writerow([r.node, r.processor, r.program, r.cap_watts, r.ips, r.measured_watts])
            n += 1
    return n


def inventory(chips: Sequence[Chip], start: datetime | None = None,
              cores_per_processor: int = 12) -> list[NodeInventory]:
    """One ``cluster.inventory`` record per node, listing its processors' min and max caps."""
    at = start or datetime(2026, 1, 1, tzinfo=UTC)
    by_node: dict[str, list[Chip]] = {}
    for c in chips:
        by_node.setdefault(c.node, []).append(c)
    return [NodeInventory(event_id=str(uuid.uuid5(NAMESPACE, f"inv/{node}")), source="sim/power", event_time=at,
                          node=node, cores=cores_per_processor * len(cs), sockets=len(cs), llc_ways=20,
                          mem_bandwidth_gbps=100.0,
                          processors=tuple(ProcessorSpec(processor=c.processor, min_watts=MIN_WATTS,
                                                         max_watts=TDP_WATTS) for c in cs))
            for node, cs in by_node.items()]


def readings(rows: Iterable[CharacterizationRow], start: datetime | None = None,
             interval_s: float = 1.0) -> Iterator[PowerReading]:
    """Characterization rows as the ``node.power`` readings a profiling run would have produced."""
    at = start or datetime(2026, 1, 1, tzinfo=UTC)
    for i, r in enumerate(rows):
        yield PowerReading(event_id=str(uuid.uuid5(NAMESPACE, f"pw/{r.node}/{r.processor}/{r.program}/{r.cap_watts}")),
                           source="sim/power", event_time=at + timedelta(milliseconds=i), node=r.node,
                           processor=r.processor, available=True, watts=r.measured_watts, cap_watts=r.cap_watts,
                           instructions=round(r.ips * 1e9 * interval_s), interval_s=interval_s, program=r.program)
