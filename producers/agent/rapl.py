"""Processor power from RAPL (``/sys/class/powercap/intel-rapl:N``), or an honest "unavailable".

Watts are energy deltas over time; the energy counter wraps at ``max_energy_range_uj``. The cap
is constraint 0 (the long-term package limit). No RAPL, no numbers: the reading says unavailable.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

POWERCAP = Path("/sys/class/powercap")
_PACKAGE = re.compile(r"^intel-rapl:(\d+)$")  # package domains; intel-rapl:N:M are sub-domains


def energy_delta_uj(before: int, after: int, max_range_uj: int) -> int:
    """Energy used between two readings of a counter that wraps at ``max_range_uj`` (one wrap at most)."""
    return after - before if after >= before else after + max_range_uj - before


def watts(before_uj: int, after_uj: int, max_range_uj: int, seconds: float) -> float:
    if seconds <= 0:
        raise ValueError("the interval between two energy readings must be positive")
    return energy_delta_uj(before_uj, after_uj, max_range_uj) / 1e6 / seconds


@dataclass(frozen=True)
class Domain:
    processor: int
    path: Path

    def energy_uj(self) -> int:
        return int((self.path / "energy_uj").read_text())

    def max_range_uj(self) -> int:
        return int((self.path / "max_energy_range_uj").read_text())

    def cap_watts(self) -> float | None:
        limit = self.path / "constraint_0_power_limit_uw"
        return int(limit.read_text()) / 1e6 if limit.exists() else None


def package_domains(root: Path = POWERCAP, energy: bool = True) -> list[Domain]:
    """One domain per processor package, in processor order; [] when there is no RAPL (or no access).
    With ``energy`` only the packages whose energy counter can be read."""
    domains = []
    if root.is_dir():
        for entry in root.iterdir():
            m = _PACKAGE.match(entry.name)
            if m and energy and (entry / "energy_uj").exists():
                try:
                    (entry / "energy_uj").read_text()
                except OSError:  # since 2020 energy_uj is root-only on many kernels
                    continue
                domains.append(Domain(int(m.group(1)), entry))
            elif m and not energy:
                domains.append(Domain(int(m.group(1)), entry))
    return sorted(domains, key=lambda d: d.processor)
