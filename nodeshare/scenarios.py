"""Simulated clusters for the demo and ``nodeshare simulate``, built from command-line choices.

Two engines emit the same events: ``calibrated`` (the workload library on two-slot nodes with
per-socket contention, :mod:`producers.calibrated`; jobs from a Standard Workload Format trace
or synthetic, programs built in or loaded from an LLC-profile CSV) and ``simple`` (four
illustrative programs, :mod:`producers.simulator`; kept because the fault tests were sized on it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, Literal

from nodeshare.producers.calibrated import CalibratedConfig, JobSpec, Result, run_cluster
from nodeshare.producers.calibrated_records import RecordSink, with_records
from nodeshare.producers.job_mix import cluster_specs, library
from nodeshare.producers.simulator import JobTruth, SimConfig, simulate
from nodeshare.producers.workloads import Workload, load_profiles
from nodeshare.schemas import JobEvent, JobState, Record
from nodeshare.streams.core.shutter_policy import ShutterPolicy

EngineName = Literal["calibrated", "simple"]  # not producers.calibrated.Engine, the engine itself
ENGINES: tuple[EngineName, ...] = ("calibrated", "simple")


class ScenarioError(ValueError):
    """A choice that cannot make a cluster (unknown engine, unreadable trace or profiles, ...)."""


@dataclass(frozen=True)
class ClusterChoice:
    engine: EngineName = "calibrated"
    nodes: int = 6
    jobs: int = 12
    seed: int = 7
    trace: Path | None = None  # Standard Workload Format: the first ``jobs`` usable jobs
    profiles: Path | None = None  # CSV shaped like llc_profiles_spec.csv: jobs run those programs
    time_scale: float = 1.0  # trace run and submit times are multiplied by it
    skip: int = 0  # usable trace jobs to skip first
    mean_work_s: float = 40.0  # synthetic jobs: mean solo run time
    span_s: float = 60.0  # synthetic jobs: arrivals spread over this
    max_nodes: int = 2  # widest job (trace jobs wider than this are narrowed)
    k: int = 1
    sample_us: int = 3200
    period_ms: int = 200
    schedule: ShutterPolicy | None = None  # issue 36's adaptive schedule (calibrated engine); None: fixed

    def __post_init__(self) -> None:
        if self.engine not in ENGINES:
            raise ScenarioError(f"unknown engine {self.engine!r}; choose one of {', '.join(ENGINES)}")
        if self.engine == "simple" and (self.trace or self.profiles):
            raise ScenarioError("--trace and --profiles need the calibrated engine")
        if self.engine == "simple" and self.schedule is not None:
            raise ScenarioError("the adaptive shutter schedule needs the calibrated engine")
        if self.time_scale <= 0:
            raise ScenarioError(f"time scale must be positive, got {self.time_scale}")

    @classmethod
    def from_settings(cls, settings: Any, **choice: Any) -> ClusterChoice:
        """K, S, P and the shutter schedule come from the configuration, as on real nodes."""
        return cls(k=settings.samples_per_region, sample_us=settings.sample_us, period_ms=settings.period_ms,
                   schedule=settings.shutter_policy(), **choice)

    def config(self) -> CalibratedConfig:
        try:
            return CalibratedConfig(nodes=self.nodes, seed=self.seed, k=self.k, sample_us=self.sample_us,
                                    period_ms=self.period_ms, schedule=self.schedule)
        except ValueError as exc:  # the schedule's longest shutter does not fit the cycle
            raise ScenarioError(str(exc)) from None

    @cached_property
    def calibrated(self) -> tuple[dict[str, Workload], list[JobSpec]]:
        """The programs the engine knows and the jobs to run, or a ScenarioError naming the bad
        input. Read once: the CLI checks the files before starting a broker, the run reuses them."""
        try:
            loaded = load_profiles(self.profiles) if self.profiles else None
            programs, names = library(loaded)
            specs = cluster_specs(self.config(), self.jobs, trace=self.trace, programs=names,
                                  mean_work_s=self.mean_work_s, span_s=self.span_s, time_scale=self.time_scale,
                                  skip=self.skip, max_nodes=self.max_nodes)
        except OSError as exc:
            raise ScenarioError(f"{exc.filename}: {exc.strerror}") from None
        except ValueError as exc:
            raise ScenarioError(str(exc)) from None
        return programs, specs


@dataclass
class Cluster:
    """A whole simulated run held in memory (the demo's size)."""

    events: list[Record]
    truth: list[JobTruth]


def build(choice: ClusterChoice) -> Cluster:
    """Simulate the chosen cluster to the end of its last job."""
    if choice.engine == "simple":
        sim = simulate(SimConfig(nodes=choice.nodes, jobs=choice.jobs, seed=choice.seed, k=choice.k,
                                 sample_us=choice.sample_us, period_ms=choice.period_ms))
        return Cluster(sim.events, sim.truth)
    programs, specs = choice.calibrated
    cfg = choice.config()
    run = with_records(cfg, lambda sink: run_cluster(cfg, specs, programs, sink))
    return Cluster(run.events, run.truth)


def stream(choice: ClusterChoice, send: Callable[[list[Record]], None], *, until_s: float | None = None,
           progress: Callable[[float, int, int], None] | None = None) -> tuple[list[JobTruth], int]:
    """Simulate and hand the events to ``send`` cycle by cycle, so a large cluster is never held
    in memory. ``progress`` gets (simulated seconds, jobs ended, jobs in the run). Returns the
    truth of the jobs that ended and the number of events sent."""
    if choice.engine == "simple":
        cluster = build(choice)
        send(cluster.events)
        if progress is not None:
            progress(0.0, len(cluster.truth), len(cluster.truth))
        return cluster.truth, len(cluster.events)
    programs, specs = choice.calibrated
    cfg = choice.config()
    sink = RecordSink(cfg)
    sent = ended = 0

    def flush(t: float) -> None:
        nonlocal sent, ended
        batch = sink.drain()
        if batch:
            send(batch)
            sent += len(batch)
            ended += sum(isinstance(r, JobEvent) and r.state is JobState.ENDED for r in batch)
        if progress is not None:
            progress(t, ended, len(specs))

    result: Result = run_cluster(cfg, specs, programs, sink, until_s=until_s, progress=flush)
    flush(result.simulated_s)
    return result.truth, sent


def source(choice: ClusterChoice) -> Callable[[Callable[[list[Record]], None], Callable[[str, int, int], None]],
                                               list[JobTruth]]:
    """The chosen cluster as a pipeline source (:class:`nodeshare.demo.Source`): simulated and
    published cycle by cycle; progress counts the jobs that ended."""
    def run(send: Callable[[list[Record]], None], report: Callable[[str, int, int], None]) -> list[JobTruth]:
        truth, _ = stream(choice, send, progress=lambda t, done, total: report("simulating, publishing", done,
                                                                                 total))
        return truth
    return run
