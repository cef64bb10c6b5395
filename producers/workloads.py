"""The workload library: how programs behave as a function of the last-level cache they get.

A program is described the way Spread-n-Share profiles it (Seed 001, Section 3 and Fig. 10):
an *IPC-LLC* curve and a *BW-LLC* curve, each sampled at 1..11 LLC ways *per process* (the
shape of ``llc_profiles_spec.csv``, measured with Intel CAT), plus

* ``mem_stall``: the share of cycles stalled on LLC misses (a CPI stack), which says how much
  slower the program runs when loaded memory latency rises;
* ``llc_rpki``: LLC references per kilo-instruction, which sets how much of a shared LLC the
  program occupies next to others;
* ``phases``: a repeating sequence of phases (the time-step loop of an MPI code), each scaling
  IPC and bandwidth; ``micro`` adds a sub-millisecond alternation inside every phase (NPB FT's
  transposes, Seed 002 Section 8.2-8.3);
* ``comm``: the share of time spent in MPI communication, whose polling adds noise to
  instruction counts without adding progress (Seed 002, Section 6.2);
* ``solo_s``: the run time of one run alone with half the cores of each socket idle, the
  spread baseline of Seed 002 Fig. 11.

Two sources: :func:`load_profiles` reads any CSV of the ``llc_profiles_spec.csv`` shape, and
:data:`BUILTIN` holds the papers' applications with hand-chosen parameters (their curves are
generated from a few numbers, not copied from any measurement) so that their pairings behave
as the seeds report.
"""

from __future__ import annotations

import csv
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

#: The curves are sampled at 1..WAYS LLC ways per process.
WAYS = 11
_REQUIRED = ("BENCH", "NR_WAYS", "ipc", "bandwidth_mbps", "stalls_l3_miss", "llcrpki")


@dataclass(frozen=True)
class Phase:
    duration_ms: float
    ipc_factor: float = 1.0
    bw_factor: float = 1.0


@dataclass(frozen=True)
class Micro:
    """A fine alternation inside every phase: a burst of ``burst_share`` of every ``period_us``
    whose IPC and bandwidth are scaled by the factors."""

    period_us: float
    burst_share: float
    ipc_factor: float
    bw_factor: float


@dataclass(frozen=True)
class Workload:
    name: str
    ipc: tuple[float, ...]  # IPC at 1..WAYS ways per process, no bandwidth contention
    bw_gbps: tuple[float, ...]  # memory bandwidth per process (GB/s) at 1..WAYS ways
    mem_stall: float
    llc_rpki: float
    phases: tuple[Phase, ...] = (Phase(1000.0),)
    micro: Micro | None = None
    comm: float = 0.05
    solo_s: float = 60.0
    source: str = "builtin"
    notes: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        if len(self.ipc) != WAYS or len(self.bw_gbps) != WAYS:
            raise ValueError(f"{self.name}: curves need {WAYS} points (1..{WAYS} ways)")
        if min(self.ipc) <= 0 or min(self.bw_gbps) < 0:
            raise ValueError(f"{self.name}: IPC must be > 0 and bandwidth >= 0 at every way count")
        if not 0.0 <= self.mem_stall < 1.0 or not 0.0 <= self.comm < 1.0:
            raise ValueError(f"{self.name}: mem_stall and comm are shares within [0, 1)")
        if not self.phases or min(p.duration_ms for p in self.phases) <= 0:
            raise ValueError(f"{self.name}: phases need positive durations")


def interp_ways(curve: np.ndarray, ways: np.ndarray) -> np.ndarray:
    """A curve (..., WAYS) read at fractional ways per process, clamped to [1, WAYS]."""
    w = np.clip(ways, 1.0, float(WAYS)) - 1.0
    lo = np.minimum(np.floor(w).astype(np.int64), WAYS - 2)
    frac = w - lo
    a = np.take_along_axis(curve, lo[..., None], axis=-1)[..., 0]
    b = np.take_along_axis(curve, (lo + 1)[..., None], axis=-1)[..., 0]
    return a + (b - a) * frac


def shaped(ipc_full: float, ipc_loss: float, bw_full: float, bw_gain: float, power: float = 2.0,
           ) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Curves from four numbers: IPC falls by ``ipc_loss`` (a share) and bandwidth rises by
    ``bw_gain`` (a share) from WAYS ways down to 1 way, along ((WAYS - w) / (WAYS - 1)) ** power."""
    x = ((WAYS - np.arange(1, WAYS + 1)) / (WAYS - 1)) ** power
    return (tuple(float(v) for v in ipc_full * (1.0 - ipc_loss * x)),
            tuple(float(v) for v in bw_full * (1.0 + bw_gain * x)))


def _app(name: str, ipc: float, ipc_loss: float, bw: float, bw_gain: float, mem_stall: float, rpki: float,
         phases: Iterable[tuple[float, float, float]], comm: float, solo_s: float, notes: str,
         micro: Micro | None = None) -> Workload:
    ipc_c, bw_c = shaped(ipc, ipc_loss, bw, bw_gain)
    return Workload(name, ipc_c, bw_c, mem_stall, rpki, tuple(Phase(*p) for p in phases), micro, comm, solo_s,
                    "builtin", notes)


#: The papers' applications (Seed 002 Section 7; Seed 001 Section 2). Parameters are chosen by
#: hand to reproduce the qualitative behaviour the seeds report, not fitted to their figures.
BUILTIN: dict[str, Workload] = {w.name: w for w in (
    _app("GTC", 1.45, 0.10, 1.6, 0.6, 0.16, 9.0, [(400, 1.05, 0.9), (150, 0.85, 1.4)], 0.06, 70,
         "particle-in-cell: compute-heavy with a scatter/gather phase"),
    _app("LAMMPS", 1.85, 0.03, 0.35, 0.5, 0.04, 2.0, [(800, 1.0, 1.0), (60, 0.9, 1.5)], 0.08, 60,
         "molecular dynamics: compute bound, small working set"),
    _app("MILC", 0.95, 0.04, 4.4, 0.15, 0.52, 34.0, [(300, 1.0, 1.0), (120, 0.92, 1.1)], 0.10, 80,
         "lattice QCD: memory bound, pairs badly with itself"),
    _app("POP", 1.25, 0.08, 1.5, 0.5, 0.22, 12.0, [(250, 1.0, 1.0), (250, 1.15, 0.6), (80, 0.6, 0.4)], 0.18, 65,
         "ocean model: moderate bandwidth, barotropic solver is communication bound"),
    _app("CG", 0.75, 0.30, 2.8, 0.9, 0.40, 40.0, [(500, 1.0, 1.0)], 0.10, 45,
         "NPB CG: irregular sparse access, cache sensitive"),
    _app("FT", 1.30, 0.10, 2.2, 0.4, 0.24, 16.0, [(900, 1.0, 1.0), (300, 0.8, 0.6)], 0.12, 40,
         "NPB FT: FFTs with fine all-to-all transposes", Micro(700.0, 0.35, 0.55, 2.6)),
    _app("LU", 1.70, 0.10, 1.5, 0.4, 0.14, 9.0, [(350, 1.0, 1.0), (350, 0.93, 1.2)], 0.08, 55,
         "NPB LU: pipelined SSOR sweeps, moderate memory"),
    _app("MG", 1.10, 0.05, 5.2, 0.10, 0.30, 32.0, [(200, 1.0, 1.0), (60, 0.8, 0.7)], 0.06, 35,
         "NPB MG: memory bandwidth bound (Seed 001 Section 2)"),
    _app("LULESH", 1.40, 0.12, 2.2, 0.5, 0.20, 14.0, [(450, 1.0, 1.0), (150, 1.1, 0.8)], 0.07, 60,
         "shock hydrodynamics proxy"),
    _app("MiniFE", 0.90, 0.12, 3.9, 0.2, 0.42, 30.0, [(600, 1.0, 1.0), (100, 1.3, 0.5)], 0.12, 50,
         "finite-element CG solve: bandwidth bound sparse matrix-vector products"),
    _app("MiniGhost", 1.20, 0.08, 3.0, 0.3, 0.28, 22.0, [(300, 1.0, 1.0), (100, 0.85, 0.4)], 0.15, 55,
         "stencil with boundary exchange"),
    _app("NekBone", 2.10, 0.06, 0.9, 0.6, 0.08, 5.0, [(500, 1.0, 1.0)], 0.09, 60,
         "spectral-element small dense matrix products: compute bound"),
    _app("ADVECT3D", 1.00, 0.05, 5.6, 0.1, 0.45, 38.0, [(400, 1.0, 1.0)], 0.04, 60,
         "3-D advection on a 256^3 grid: the contentious co-runner of Seed 002 Fig. 6"),
    _app("Swim", 1.60, 0.03, 3.0, 0.1, 0.20, 24.0, [(400, 1.0, 1.0)], 0.04, 60,
         "shallow water on a 150^3 grid: the moderate co-runner of Seed 002 Fig. 7"),
    _app("NULL", 2.40, 0.0, 0.0, 0.0, 0.0, 0.01, [(1000, 1.0, 1.0)], 0.0, 60,
         "a busy loop: no cache or memory traffic, the spread baseline's co-runner"),
)}

#: The twelve codes of POPPA's pairwise evaluation (Seed 002 Figs. 10-12), in its order.
PAIRWISE = ("GTC", "LAMMPS", "MILC", "POP", "CG", "FT", "LU", "MG", "LULESH", "MiniFE", "MiniGhost", "NekBone")


def load_profiles(path: Path, solo_s: float = 60.0) -> dict[str, Workload]:
    """Workloads from a CSV shaped like ``llc_profiles_spec.csv`` (one row per program and way
    count). Raises ValueError naming the file, line and column on anything malformed."""
    rows: dict[str, dict[int, Mapping[str, str]]] = defaultdict(dict)
    with open(path, newline="") as fh:
        reader = csv.DictReader(fh)
        missing = [c for c in _REQUIRED if c not in (reader.fieldnames or ())]
        if missing:
            raise ValueError(f"{path}: missing columns {missing}; need {list(_REQUIRED)}")
        for line, row in enumerate(reader, start=2):
            try:
                ways = int(row["NR_WAYS"])
            except ValueError:
                raise ValueError(f"{path}:{line}: NR_WAYS is not an integer: {row['NR_WAYS']!r}") from None
            if not 1 <= ways <= WAYS:
                raise ValueError(f"{path}:{line}: NR_WAYS must be within 1..{WAYS}, got {ways}")
            rows[row["BENCH"]][ways] = row
    out: dict[str, Workload] = {}
    for name, by_way in sorted(rows.items()):
        if sorted(by_way) != list(range(1, WAYS + 1)):
            raise ValueError(f"{path}: {name} has ways {sorted(by_way)}, need every one of 1..{WAYS}")
        try:
            ipc = tuple(float(by_way[w]["ipc"]) for w in range(1, WAYS + 1))
            bw = tuple(float(by_way[w]["bandwidth_mbps"]) / 1000.0 for w in range(1, WAYS + 1))
            stall = float(np.median([float(by_way[w]["stalls_l3_miss"]) for w in (2, 3, 4)]))
            rpki = float(by_way[WAYS]["llcrpki"])
        except ValueError as exc:
            raise ValueError(f"{path}: {name}: {exc}") from None
        out[name] = Workload(name, ipc, bw, min(max(stall, 0.0), 0.95), max(rpki, 0.0), solo_s=solo_s,
                             source=str(path))
    if not out:
        raise ValueError(f"{path}: no programs")
    return out
