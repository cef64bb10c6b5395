"""POPPA's prices (Seed 002, Section 4, Eq. 1-4).

    SOP      = L * C * T_co                      Eq. 1, the standard price of the co-located run
    T_solo   = (1 - D) * T_co                    Eq. 3: T_solo / T_co = 1 - D
    P_solo   = L * C * T_solo                    Eq. 1 applied to the solo run time
    P_poppa  = L * (T_solo / T_co) * C * T_solo  Eq. 4, i.e. (1 - D) * P_solo

With a pause credit (the time nodeshare's own shutters kept the job paused), T_solo is
estimated from the run time less the credit, (1 - D) * (T_co - credit), and Eq. 4 keeps the
real T_co in its ratio: the credit lowers T_solo, so the price, and never raises the ratio.

A node with one job is never shuttered, so the blocks measure D over the time the job shared its
nodes; a job that also ran alone for a time A of its billed time T is charged with
D = D_shared * (1 - A / T), its solo time being A + (1 - D_shared) * (T - A).

L is in service units per core-hour, times are in seconds. C is the job's cores, or (beyond POPPA,
schema 8) its billable TRES where the lifecycle event carries its allocation: Slurm's own ``billing``
count, or a partition's ``TRESBillingWeights`` applied to it (``billed_units``), so a site that
bills GPUs or memory through Slurm gets the same standard price ``sreport`` counts.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

SECONDS_PER_HOUR = 3600.0

#: Rate functions by the name written into every charge (Seed 002 Section 4.2: "supercomputing
#: facilities will have to decide what F makes sense for each of their systems").
POPPA_EQ4 = "poppa_eq4"  # (1 - D) * P_solo: the discount of Eq. 4
SOLO_BASELINE = "solo_baseline"  # P_solo: pay for the time the job would have taken alone
STANDARD = "sop"  # L * C * T_co: today's price, no discount (co-location measured but not priced)


def standard_price(rate_per_core_hour: float, cores: float, run_time_s: float) -> float:
    """Eq. 1: P = L * C * T."""
    return rate_per_core_hour * cores * (run_time_s / SECONDS_PER_HOUR)


def solo_time(run_time_s: float, degradation: float) -> float:
    """Eq. 3 solved for T_solo: T_solo = (1 - D) * T_co."""
    return (1.0 - degradation) * run_time_s


def poppa_price(rate_per_core_hour: float, cores: float, run_time_s: float, degradation: float,
                pause_credit_s: float = 0.0) -> float:
    """Eq. 4: P = L * (T_solo / T_co) * C * T_solo, with T_co the real co-located run time and
    T_solo = (1 - D) * (T_co - pause credit). Without a credit this is (1 - D) * P_solo."""
    t_solo = solo_time(billed_time(run_time_s, pause_credit_s), degradation)
    if run_time_s <= 0.0:
        return 0.0
    return rate_per_core_hour * (t_solo / run_time_s) * cores * (t_solo / SECONDS_PER_HOUR)


@dataclass(frozen=True)
class ChargeAmounts:
    standard_price: float  # SOP, of the whole run time
    billed_time_s: float  # run time less the pause credit
    solo_time_s: float
    solo_price: float
    price: float
    dividend: float  # SOP - price, the co-location discount


#: Every rate function prices (L, C, T_co, D, pause credit).
RATE_FUNCTIONS: dict[str, Callable[[float, float, float, float, float], float]] = {
    POPPA_EQ4: poppa_price,
    SOLO_BASELINE: lambda rate, cores, t_co, d, credit: standard_price(rate, cores,
                                                                      solo_time(billed_time(t_co, credit), d)),
    STANDARD: lambda rate, cores, t_co, d, credit: standard_price(rate, cores, t_co),
}


def alone_time(node_alone_s: Sequence[float], nodes: int, billed_time_s: float) -> float:
    """The billed time a job ran with no co-runner on any of its ``nodes``, from the per-node totals
    the agents report (a node that reported none counts 0): the least the intersection of the
    nodes' alone periods can be, max(0, sum - (nodes - 1) * T), and never more than T. Exact for
    one node; for more, a lower bound, so the discount it removes is never more than measured."""
    if nodes < 1:
        raise ValueError(f"a job has at least one node, got {nodes}")
    t = max(0.0, billed_time_s)
    return min(t, max(0.0, math.fsum(min(t, max(0.0, a)) for a in node_alone_s) - (nodes - 1) * t))


def job_degradation(shared_degradation: float, alone_s: float, billed_time_s: float) -> float:
    """D over the whole billed time of a job whose blocks measured D_shared over the time it shared
    its nodes and which ran ``alone_s`` of it undisturbed (a node with one job is never shuttered):
    T_solo = alone + (1 - D_shared) * (T - alone), so D = D_shared * (1 - alone / T)."""
    if billed_time_s <= 0.0:
        return shared_degradation
    return shared_degradation * (1.0 - min(alone_s, billed_time_s) / billed_time_s)


def billed_time(run_time_s: float, pause_credit_s: float) -> float:
    """Run time less the time the shutters kept the job paused (beyond POPPA: nodeshare's own
    measurement overhead is not the user's to pay). Never negative."""
    return max(0.0, run_time_s - pause_credit_s)


def fair_charge(
    rate_per_core_hour: float, cores: float, run_time_s: float, degradation: float, rate_function: str = POPPA_EQ4,
    pause_credit_s: float = 0.0,
) -> ChargeAmounts:
    """Every amount of a charge. The standard price is of the whole run time. The solo time is
    estimated from the billed time (run time less the pause credit): T_solo = (1 - D) * billed.
    Requires 0 <= D <= 1 and a credit >= 0, so 0 <= price <= SOP for every rate function."""
    if not 0.0 <= degradation <= 1.0:
        raise ValueError(f"degradation must be within [0, 1], got {degradation}")
    if not pause_credit_s >= 0.0:
        raise ValueError(f"pause credit must be >= 0, got {pause_credit_s}")
    try:
        price_of = RATE_FUNCTIONS[rate_function]
    except KeyError:
        raise ValueError(f"unknown rate function {rate_function!r}; known: {sorted(RATE_FUNCTIONS)}") from None
    sop = standard_price(rate_per_core_hour, cores, run_time_s)
    billed = billed_time(run_time_s, pause_credit_s)
    t_solo = solo_time(billed, degradation)
    price = price_of(rate_per_core_hour, cores, run_time_s, degradation, pause_credit_s)
    return ChargeAmounts(sop, billed, t_solo, standard_price(rate_per_core_hour, cores, t_solo), price, sop - price)


def adjusted_price(action: str | None, requested: float | None, standard: float, computed: float) -> float:
    """The price an operator's adjustment sets (beyond POPPA: a site's correction of a charge).
    ``void`` charges 0; ``adjust`` charges the ``requested`` price, but never more than the standard
    price (sharing never costs more than not sharing, whoever sets the price); no action keeps the
    ``computed`` price."""
    if action is None:
        return computed
    if action == "void":
        return 0.0
    if action == "adjust":
        if requested is None or not requested >= 0.0:
            raise ValueError(f"adjust needs a price >= 0, got {requested}")
        return min(requested, standard)
    raise ValueError(f"unknown adjustment {action!r}; known: adjust, void")


#: MB per unit of a memory suffix (Slurm counts memory in MB): "Mem=0.25G" is 0.25 per GB, "mem=8G" 8192 MB.
_MEM_UNITS = {"K": 1 / 1024, "M": 1.0, "G": 1024.0, "T": 1024.0**2, "P": 1024.0**3}


def parse_billing_weights(text: str) -> dict[str, float]:
    """A partition's ``TRESBillingWeights`` as slurm.conf writes it ("CPU=1.0,Mem=0.25G,GRES/gpu=2.0"):
    the weight per unit of each TRES, by Slurm's lower-case TRES name ("cpu", "mem", "gres/gpu"), the
    memory weight per MB (a suffix K, M, G, T or P says per what; none: per MB, as Slurm reads it).
    Raises ValueError naming the part it cannot read."""
    weights: dict[str, float] = {}
    for part in (p.strip() for p in text.split(",") if p.strip()):
        name, sep, value = part.partition("=")
        name = name.strip().lower()
        if not sep or not name:
            raise ValueError(f"TRESBillingWeights part {part!r}: expected NAME=WEIGHT")
        value = value.strip()
        per = 1.0
        if value[-1:].upper() in _MEM_UNITS and not value[-1:].isdigit():
            if name != "mem":
                raise ValueError(f"TRESBillingWeights part {part!r}: a unit suffix is read for Mem only")
            per, value = _MEM_UNITS[value[-1:].upper()], value[:-1]
        try:
            weight = float(value)
        except ValueError:
            raise ValueError(f"TRESBillingWeights part {part!r}: {value!r} is not a number") from None
        if not (math.isfinite(weight) and weight >= 0.0):
            raise ValueError(f"TRESBillingWeights part {part!r}: a weight is a number >= 0")
        if name in weights:
            raise ValueError(f"TRESBillingWeights: {name} is weighted twice")
        weights[name] = weight / per
    return weights


def parse_tres(text: str) -> dict[str, float]:
    """A TRES string as ``scontrol show job`` writes it ("cpu=4,mem=8G,node=1,billing=6,gres/gpu=1")
    -> counts by Slurm's TRES name, memory in MB (a K, M, G, T or P suffix). A part it cannot read is
    left out (a TRES no weight names bills nothing anyway)."""
    out: dict[str, float] = {}
    for part in text.split(","):
        name, sep, value = part.strip().partition("=")
        if not sep or not re.fullmatch(r"[a-z]+(/[A-Za-z0-9_.:-]+)?", name):
            continue
        per = 1.0
        if value[-1:] in _MEM_UNITS:
            per, value = _MEM_UNITS[value[-1:]], value[:-1]
        try:
            count = float(value) * per
        except ValueError:
            continue
        if math.isfinite(count) and count >= 0.0:
            out[name] = count
    return out


def billing_units(tres: Mapping[str, float], weights: Mapping[str, float]) -> float:
    """Slurm's billable TRES of an allocation under a partition's weights, by its default rule: the
    sum over the weighted TRES of weight x count (memory in MB), names compared without case (slurm.conf
    writes "GRES/gpu:A100", scontrol "gres/gpu:A100"), truncated to a whole count as Slurm stores it
    (its tres docs: 4.5 bills 4). A TRES the job was not allocated counts 0. (``PriorityFlags=MAX_TRES``,
    the per-node maximum, is not modelled: a site that sets it takes Slurm's own ``billing`` count.)"""
    counts = {name.lower(): float(n) for name, n in tres.items()}
    return float(math.floor(math.fsum(w * counts.get(name, 0.0) for name, w in sorted(weights.items()))))


def billed_units(cores: int, tres: Mapping[str, float], weights_text: str | None, by_tres: bool = True,
                 ) -> tuple[float, str | None]:
    """What the standard price multiplies (Eq. 1's C, beyond POPPA: a site bills GPUs and memory too)
    and the rule that gave it. Without ``by_tres`` (the default configuration: ``standard_units =
    "cores"``) the cores, as POPPA's C (None). With it: Slurm's own ``billing`` TRES when the lifecycle
    event carries it (what ``sreport`` counts, whatever the partition's weights and flags), else the
    site's weights for the job's partition applied to its TRES (``weights_text``), else its cores."""
    if not by_tres:
        return float(cores), None
    if "billing" in tres:
        return float(tres["billing"]), "slurm"
    if weights_text:
        return billing_units(tres, parse_billing_weights(weights_text)), weights_text
    return float(cores), None
