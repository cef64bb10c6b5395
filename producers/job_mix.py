"""Where a calibrated run's jobs come from: a synthetic mix, a trace, the program library."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from .calibrated import USERS, CalibratedConfig, JobSpec
from .swf import swf_jobs
from .workloads import BUILTIN, Workload


def synthetic_jobs(n: int, seed: int, mean_work_s: float = 600.0, span_s: float = 3600.0,
                   programs: Sequence[str] | None = None, max_nodes: int = 4) -> list[JobSpec]:
    """Poisson arrivals over ``span_s``, lognormal work, mostly single-node jobs."""
    rng = np.random.default_rng(seed)
    names = list(programs or [p for p in BUILTIN if p != "NULL"])
    submit = np.sort(rng.uniform(0.0, span_s, n))
    work = rng.lognormal(math.log(mean_work_s), 0.6, n)
    nodes = np.minimum(rng.geometric(0.7, n), max_nodes)
    out = []
    for i in range(n):
        user, account = USERS[int(rng.integers(len(USERS)))]
        out.append(JobSpec(names[int(rng.integers(len(names)))], float(work[i]), float(submit[i]), int(nodes[i]),
                           user, account))
    return out


def cluster_specs(cfg: CalibratedConfig, jobs: int, *, trace: Path | None = None,
                  programs: Sequence[str] | None = None, mean_work_s: float = 40.0, span_s: float = 60.0,
                  time_scale: float = 1.0, skip: int = 0, max_nodes: int = 2) -> list[JobSpec]:
    """The jobs of a cluster run: the first ``jobs`` usable jobs of a Standard Workload Format
    ``trace`` (run and submit times times ``time_scale``), else ``jobs`` synthetic ones arriving
    over ``span_s``. Programs are drawn from ``programs`` (default: the built-in library without NULL)."""
    widest = min(max_nodes, cfg.nodes)
    if trace is not None:
        return swf_jobs(trace, cores_per_node=cfg.cores_per_node, max_nodes=widest, programs=programs,
                        time_scale=time_scale, limit=jobs, skip=skip)
    return synthetic_jobs(jobs, cfg.seed, mean_work_s=mean_work_s, span_s=span_s, programs=programs,
                          max_nodes=widest)


def library(profiles: dict[str, Workload] | None = None) -> tuple[dict[str, Workload], list[str] | None]:
    """The programs an engine knows and the names jobs are drawn from: with loaded ``profiles``
    (e.g. :func:`workloads.load_profiles`), jobs run those programs; without, the built-ins."""
    if not profiles:
        return BUILTIN, None
    clash = sorted(set(profiles) & set(BUILTIN))
    if clash:
        raise ValueError(f"profiles {clash} have the names of built-in programs; rename them")
    return {**BUILTIN, **profiles}, sorted(profiles)
