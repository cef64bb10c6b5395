"""Where each job is in its lifecycle, as a decision fold has seen it: the one rule by which the
decision managers ignore duplicate and late lifecycle events.

A job moves forward only: submitted, then started, then ended (ended, failed or cancelled). A
lifecycle event that does not move its job forward changes nothing. That covers a record
delivered twice (a restarted Slurm source publishes ``submitted`` again for every job ``squeue``
still lists, with the same event id: event ids name the job and its state), a ``submitted`` for a
job already started or ended, and a second terminal event. It is kept per job, not per event id,
so it also holds when two sources describe one job under different ids.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum

from nodeshare.schemas.events import TERMINAL_STATES, JobEvent, JobState


class Phase(IntEnum):
    SUBMITTED = 1
    STARTED = 2
    ENDED = 3


def phase_of(state: JobState) -> Phase:
    if state in TERMINAL_STATES:
        return Phase.ENDED
    return Phase.STARTED if state is JobState.STARTED else Phase.SUBMITTED


@dataclass
class JobPhases:
    phases: dict[str, Phase] = field(default_factory=dict)

    def get(self, job_id: str) -> Phase | None:
        return self.phases.get(job_id)

    def advance(self, ev: JobEvent) -> bool:
        """Record ``ev`` when it moves its job forward and say so; False: a duplicate or late
        event, which must change nothing."""
        new = phase_of(ev.state)
        old = self.phases.get(ev.job_id)
        if old is not None and new <= old:
            return False
        self.phases[ev.job_id] = new
        return True
