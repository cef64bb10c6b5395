"""POPPA's prices (Seed 002, Section 4, Eq. 1-4).

    SOP      = L * C * T_co                      Eq. 1, the standard price of the co-located run
    T_solo   = (1 - D) * T_co                    Eq. 3: T_solo / T_co = 1 - D
    P_solo   = L * C * T_solo                    Eq. 1 applied to the solo run time
    P_poppa  = L * (T_solo / T_co) * C * T_solo  Eq. 4, i.e. (1 - D) * P_solo

L is in service units per core-hour, times are in seconds.
"""

from __future__ import annotations

from dataclasses import dataclass

SECONDS_PER_HOUR = 3600.0

#: The rate function of Eq. 3-4; the name is written into every charge.
POPPA_EQ4 = "poppa_eq4"


def standard_price(rate_per_core_hour: float, cores: int, run_time_s: float) -> float:
    """Eq. 1: P = L * C * T."""
    return rate_per_core_hour * cores * (run_time_s / SECONDS_PER_HOUR)


def solo_time(run_time_s: float, degradation: float) -> float:
    """Eq. 3 solved for T_solo: T_solo = (1 - D) * T_co."""
    return (1.0 - degradation) * run_time_s


def poppa_price(rate_per_core_hour: float, cores: int, run_time_s: float, degradation: float) -> float:
    """Eq. 4: P = L * (T_solo / T_co) * C * T_solo = (1 - D) * P_solo."""
    return (1.0 - degradation) * standard_price(rate_per_core_hour, cores, solo_time(run_time_s, degradation))


@dataclass(frozen=True)
class ChargeAmounts:
    standard_price: float  # SOP
    solo_time_s: float
    solo_price: float
    price: float
    dividend: float  # SOP - price, the co-location discount


def fair_charge(
    rate_per_core_hour: float, cores: int, run_time_s: float, degradation: float
) -> ChargeAmounts:
    """Every amount of a POPPA charge. Requires 0 <= D <= 1, so 0 <= price <= SOP."""
    if not 0.0 <= degradation <= 1.0:
        raise ValueError(f"degradation must be within [0, 1], got {degradation}")
    sop = standard_price(rate_per_core_hour, cores, run_time_s)
    t_solo = solo_time(run_time_s, degradation)
    price = poppa_price(rate_per_core_hour, cores, run_time_s, degradation)
    return ChargeAmounts(sop, t_solo, standard_price(rate_per_core_hour, cores, t_solo), price, sop - price)
