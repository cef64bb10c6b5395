"""A small power scenario as input records: 4 nodes x 2 processors, their characterization as
node.power readings, and jobs that start and end."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from nodeshare.producers.power_population import characterization, inventory, population, readings
from nodeshare.schemas.events import JobEvent, JobState, Record

T0 = datetime(2026, 3, 1, tzinfo=UTC)


def job(job_id: str, state: JobState, program: str, cores: int, minute: int) -> JobEvent:
    at = T0 + timedelta(minutes=minute)
    started = state is not JobState.SUBMITTED
    return JobEvent(event_id=f"{job_id}-{state.value}", source="test", event_time=at, job_id=job_id, state=state,
                    user="u", account="a", program=program, cores=cores, nodes=("pnode0000",) if started else (),
                    start_time=T0 if started else None, end_time=at if state is JobState.ENDED else None)


def scenario() -> list[Record]:
    chips = population(8, seed=11)
    rows = characterization(chips, programs=("EP", "SP"), seed=11)
    events: list[Record] = [*inventory(chips, T0), *readings(rows, T0)]
    # Budget 600 W for 8 processors (75 W each on average). Jobs ask for 2..4 processors (24..48 cores).
    events += [job("p1", JobState.SUBMITTED, "EP", 48, 1), job("p2", JobState.SUBMITTED, "SP", 24, 2),
               job("p3", JobState.SUBMITTED, "EP", 36, 3), job("p4", JobState.SUBMITTED, "SP", 24, 4),
               job("p1", JobState.ENDED, "EP", 48, 5)]
    return events
