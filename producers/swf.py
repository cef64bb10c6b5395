"""Jobs from a Standard Workload Format trace (one job per line, 18 fields; ';' comments), as the
calibrated simulator runs them."""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from pathlib import Path

from .calibrated import SLOTS, JobSpec
from .workloads import BUILTIN


def swf_lines(path: Path) -> Iterator[tuple[int, list[str]]]:
    """(line number, its 18+ fields) of every job line of a Standard Workload Format trace; a line
    with fewer fields is a ValueError naming it."""
    with open(path) as fh:
        for line_no, line in enumerate(fh, start=1):
            if not line.strip() or line.lstrip().startswith(";"):
                continue
            f = line.split()
            if len(f) < 18:
                raise ValueError(f"{path}:{line_no}: a Standard Workload Format line has 18 fields, got {len(f)}")
            yield line_no, f


def swf_jobs(path: Path, *, cores_per_node: int, max_nodes: int, programs: Sequence[str] | None = None,
             time_scale: float = 1.0, limit: int | None = None, skip: int = 0) -> list[JobSpec]:
    """Jobs of a Standard Workload Format trace: submit time (field 2, rebased to 0), run time
    (field 4, times ``time_scale``), processors (field 5, else 8), user (12) and group (13);
    the program comes from the executable number (field 14), else the job number. Jobs without
    a positive run time or processor count are skipped."""
    names = list(programs or [p for p in BUILTIN if p != "NULL"])
    out: list[JobSpec] = []
    first: float | None = None
    seen = 0
    for line_no, f in swf_lines(path):
        try:
            num, submit, run = int(f[0]), float(f[1]), float(f[3])
            procs = int(f[4]) if int(f[4]) > 0 else int(f[7])
            user, group, exe = int(f[11]), int(f[12]), int(f[13])
        except ValueError as exc:
            raise ValueError(f"{path}:{line_no}: {exc}") from None
        if run <= 0 or procs <= 0:
            continue
        seen += 1
        if seen <= skip:
            continue
        first = submit if first is None else first
        nodes = min(max_nodes, max(1, math.ceil(procs / (cores_per_node // SLOTS))))
        prog = names[(exe if exe > 0 else num) % len(names)]
        out.append(JobSpec(prog, run * time_scale, (submit - first) * time_scale, nodes, f"user{user}",
                           f"group{group}"))
        if limit is not None and len(out) >= limit:
            break
    if not out:
        raise ValueError(f"{path}: no usable jobs")
    return out
