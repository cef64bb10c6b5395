"""A small power scenario as input records: 4 nodes x 2 processors, their characterization as
node.power readings, and jobs that start and end."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from nodeshare.producers.power_population import characterization, inventory, population, readings
from nodeshare.schemas.events import JobEvent, JobState, Record

T0 = datetime(2026, 3, 1, tzinfo=UTC)


def job(job_id: str, state: JobState, program: str, cores: int, minute: int,
        nodes: tuple[str, ...] = ("pnode0000",)) -> JobEvent:
    at = T0 + timedelta(minutes=minute)
    started = state is not JobState.SUBMITTED
    return JobEvent(event_id=f"{job_id}-{state.value}", source="test", event_time=at, job_id=job_id, state=state,
                    user="u", account="a", program=program, cores=cores, nodes=nodes if started else (),
                    start_time=T0 if started else None, end_time=at if state is JobState.ENDED else None)


def scenario() -> list[Record]:
    chips = population(8, seed=11)
    rows = characterization(chips, programs=("EP", "SP"), seed=11)
    events: list[Record] = [*inventory(chips, T0), *readings(rows, T0)]
    # Budget 600 W for 8 processors (75 W each on average), 4 nodes of 2 processors and 24 cores. The
    # power manager decides at `started`, on the job's nodes: p1 (48 cores) occupies pnode0000 and
    # pnode0001, p2 and p3 (24 cores) one node each; p4 starts on pnode0000 once p1 has ended.
    events += [job("p1", JobState.SUBMITTED, "EP", 48, 1),
               job("p1", JobState.STARTED, "EP", 48, 1, ("pnode0000", "pnode0001")),
               job("p2", JobState.SUBMITTED, "SP", 24, 2), job("p2", JobState.STARTED, "SP", 24, 2, ("pnode0002",)),
               job("p3", JobState.SUBMITTED, "EP", 24, 3), job("p3", JobState.STARTED, "EP", 24, 3, ("pnode0003",)),
               job("p4", JobState.SUBMITTED, "SP", 24, 4),
               job("p1", JobState.ENDED, "EP", 48, 5, ("pnode0000", "pnode0001")),
               job("p4", JobState.STARTED, "SP", 24, 6)]
    return events
