"""Small builders of valid records for tests."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from nodeshare.schemas import (
    CounterSource,
    IpcSample,
    JobEvent,
    JobLeftNode,
    JobState,
    ShutterBlock,
)

T0 = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)
CYCLES = 1_000_000  # per sample: IPC x CYCLES is an exact instruction count for IPCs with <= 6 decimals


def samples(*ipcs: float) -> tuple[IpcSample, ...]:
    return tuple(IpcSample(instructions=round(i * CYCLES), cycles=CYCLES) for i in ipcs)


def block(before: float | tuple[float, ...], during: float | tuple[float, ...], after: float | tuple[float, ...],
          *, job: str = "j1", node: str = "n1", cycle: int = 0) -> ShutterBlock:
    b, d, a = (x if isinstance(x, tuple) else (x,) for x in (before, during, after))
    return ShutterBlock(
        event_id=f"blk-{job}-{node}-{cycle}", source="test", event_time=T0 + timedelta(seconds=cycle),
        job_id=job, node=node, cycle=cycle, k=len(b), sample_us=3200, counter=CounterSource.SIMULATED,
        before=samples(*b), during=samples(*d), after=samples(*a),
    )


def left(job: str, node: str, blocks_sent: int, last_cycle: int, at_s: float = 3600) -> JobLeftNode:
    return JobLeftNode(event_id=f"left-{job}-{node}", source="test", event_time=T0 + timedelta(seconds=at_s),
                       job_id=job, node=node, blocks_sent=blocks_sent, last_cycle=last_cycle)


def job_event(job: str, state: JobState, *, nodes: tuple[str, ...] = ("n1",), cores: int = 16,
              run_s: float = 3600, user: str = "alice", account: str = "physics") -> JobEvent:
    ran = state is not JobState.SUBMITTED
    ended = state in (JobState.ENDED, JobState.FAILED)
    return JobEvent(
        event_id=f"job-{job}-{state.value}", source="test",
        event_time=T0 + timedelta(seconds=run_s if ended else 0), job_id=job, state=state, user=user,
        account=account, program="lammps", cores=cores, nodes=nodes if ran else (), submit_time=T0,
        start_time=T0 if ran else None, end_time=T0 + timedelta(seconds=run_s) if ended else None,
    )
