"""The Slurm adapter's fail-open rule (``nodeshare slurm scheduler``, see ``slurm_scheduler``'s
docstring): which held jobs the placement manager never answered are released to Slurm's own
scheduling. Pure: the jobs as ``squeue --json`` lists them in, job ids out."""

from __future__ import annotations

from collections.abc import Container, Sequence
from dataclasses import dataclass

#: squeue's reasons for a job held by its user (sbatch --hold, scontrol hold) or by an admin
HELD = frozenset({"JobHeldUser", "JobHeldAdmin"})
#: The holds nodeshare releases: the one ``sbatch --hold`` and a job_submit rule's ``priority = 0``
#: set (both JobHeldUser on Slurm 22.05, even for root). JobHeldAdmin is an operator's
#: ``scontrol hold``: never undone by a placement.
OWN_HOLDS = frozenset({"JobHeldUser"})

#: How often the adapter looks for held jobs no decision placed (``release_unplaced``).
SWEEP_EVERY_S = 30.0


@dataclass(frozen=True)
class Waiting:
    """A job as ``squeue --json`` lists it: its reason, whether it is pending, and whether it is one
    job (not an array task or a heterogeneous component, whose ids decisions spell otherwise)."""

    job_id: str
    reason: str
    single: bool = True
    pending: bool = True


def unplaced_due(waiting: Sequence[Waiting], now: float, held_since: dict[str, float], decided: Container[str],
                 release_after_s: float) -> list[str]:
    """The held jobs to release to Slurm's own scheduling: held by nodeshare (``OWN_HOLDS``), single
    jobs, never answered by the placement manager (``decided``), seen held by the adapter since
    ``held_since`` (the first sweep that saw it: a restarted adapter first gives the manager that
    long) for ``release_after_s`` or more. ``release_after_s`` 0: never (fail-open off)."""
    if release_after_s <= 0:
        return []
    return [w.job_id for w in waiting
            if w.pending and w.reason in OWN_HOLDS and w.single and w.job_id not in decided
            and now - held_since.get(w.job_id, now) >= release_after_s]
