"""Which jobs run on this node, and their processes.

* ``StaticJobs``: a TOML job file for nodes without Slurm (and tests). Each ``[[jobs]]`` table has
  an ``id`` and either ``pids`` (processes already running) or ``command`` (the agent launches
  it); optional ``progress`` (the application counter file), ``user``, ``account``, ``program``,
  ``cores``. The agent publishes these jobs' lifecycle itself; a launched job's output goes to
  ``<progress_dir>/<id>.log``.
* ``SlurmJobs``: ``scontrol listpids`` for processes, the job's cgroup when Slurm made one
  (proctrack/cgroup: v1's freezer, or cgroup/v2), and ``<progress_dir>/<job id>`` as the
  application counter when the job writes one. Slurm's own hooks publish the lifecycle (``producers.slurm``).
"""

from __future__ import annotations

import json
import os
import subprocess
import tomllib
from collections.abc import Container
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from .pausing import FREEZER_ROOT
from .processes import Proc, alive, children, descendants, identities, identity, owner

#: Beside a static job's log in the progress directory: the identities (PID and start time) of the
#: processes the agent first took for the job, so that a restarted agent finds the same processes,
#: or none (a reboot took them, or a PID was reused), and never launches the job a second time.
ROOTS_SUFFIX = ".procs.json"

PROGRESS_ENV = "NODESHARE_PROGRESS_FILE"  # where a launched job finds its application counter


class JobsUnavailable(RuntimeError):
    """The job list could not be read this time, for a passing reason (a job step's slurmstepd
    exited while ``scontrol listpids`` went through the steps): the agent keeps the jobs it knows
    and asks again at its next rescan, instead of taking every job for gone or exiting."""


class JobFileError(ValueError):
    """The job file is unreadable or invalid; the message names the file and the entry."""


class JobSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.:\-]+$")
    pids: list[int] = []
    command: list[str] = []
    progress: Path | None = None
    user: str = "unknown"
    account: str = "default"
    program: str = "unknown"
    cores: int = Field(1, ge=1)

    @model_validator(mode="after")
    def _one_way_to_find_processes(self) -> JobSpec:
        if bool(self.pids) == bool(self.command):
            raise ValueError("give exactly one of 'pids' (running processes) or 'command' (to launch)")
        if any(p <= 1 for p in self.pids):
            raise ValueError("PIDs must be above 1")
        return self


@dataclass
class LocalJob:
    """A job on this node as the agent sees it now."""

    job_id: str
    procs: frozenset[Proc]
    cgroup: Path | None = None
    progress: Path | None = None

    @property
    def running(self) -> bool:
        return any(alive(p) for p in self.procs)

    def owner(self) -> tuple[int, int] | None:
        """The job's user and group: those of its first-started live process (Slurm's batch script
        or step, a launched command), None when none is left."""
        for p in sorted(self.procs, key=lambda p: p.start_ticks):
            found = owner(p)
            if found is not None:
                return found
        return None


class JobSource(Protocol):
    def start(self, known: Container[str] = frozenset()) -> None:
        """Begin; ``known``: the jobs a previous run of the agent had in its books (its spool), open
        or closed. A restarted agent takes those up as they are now, and never starts one again."""
        ...

    def poll(self) -> dict[str, LocalJob]:
        """The jobs on this node now, by job id (ended jobs are absent)."""
        ...

    def exit_code(self, job_id: str) -> int | None: ...

    def spec(self, job_id: str) -> JobSpec | None:
        """The job's billing details when the agent publishes its lifecycle (a static job file), else None.
        Known whether or not the job still runs: its end may be noticed only after an agent restart."""
        ...

    def close(self) -> None: ...


def load_job_file(path: Path) -> list[JobSpec]:
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise JobFileError(f"{path}: {e}") from None
    unknown = set(data) - {"jobs"}
    if unknown:
        raise JobFileError(f"{path}: unknown key(s) {sorted(unknown)}; a job file holds [[jobs]] tables")
    specs = []
    for i, entry in enumerate(data.get("jobs", [])):
        try:
            specs.append(JobSpec.model_validate(entry))
        except ValidationError as e:
            first = e.errors()[0]
            where = ".".join(str(x) for x in first["loc"]) or "entry"
            raise JobFileError(f"{path}: jobs[{i}].{where}: {first['msg']}") from None
    ids = [s.id for s in specs]
    if len(set(ids)) != len(ids):
        raise JobFileError(f"{path}: duplicate job ids {sorted({i for i in ids if ids.count(i) > 1})}")
    return specs


@dataclass
class StaticJobs:
    specs: list[JobSpec]
    progress_dir: Path
    _launched: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    _roots: dict[str, frozenset[Proc]] = field(default_factory=dict)
    _known: dict[str, frozenset[Proc]] = field(default_factory=dict)

    def start(self, known: Container[str] = frozenset()) -> None:
        """Identify listed processes and launch commands (each in its own session). A job in
        ``known`` (the agent's books before a restart) is neither launched nor identified again: its
        processes are those recorded at its first start that still run, so a job a reboot took (or
        one that ended) reads as gone, and its stream is closed by the first rescan."""
        for spec in self.specs:
            if spec.id in known:
                self._roots[spec.id] = self._recorded_roots(spec.id)
                continue
            progress = spec.progress or self.progress_dir / spec.id
            if spec.command:
                env = {**os.environ, PROGRESS_ENV: str(progress)}
                self.progress_dir.mkdir(parents=True, exist_ok=True)
                with (self.progress_dir / f"{spec.id}.log").open("ab") as output:  # the job's, not the agent's
                    proc = subprocess.Popen(spec.command, env=env, start_new_session=True, stdin=subprocess.DEVNULL,
                                            stdout=output, stderr=subprocess.STDOUT)
                self._launched[spec.id] = proc
                roots = identities([proc.pid])
            else:
                roots = identities(spec.pids)
                if len(roots) != len(spec.pids):
                    gone = sorted(set(spec.pids) - {p.pid for p in roots})
                    raise JobFileError(f"job {spec.id}: no process with PID {gone}")
            self._roots[spec.id] = roots
            self._record_roots(spec.id, roots)

    def _roots_file(self, job_id: str) -> Path:
        return self.progress_dir / f"{job_id}{ROOTS_SUFFIX}"

    def _record_roots(self, job_id: str, roots: frozenset[Proc]) -> None:
        self.progress_dir.mkdir(parents=True, exist_ok=True)
        path = self._roots_file(job_id)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(sorted(p.encode() for p in roots)))
        os.replace(tmp, path)

    def _recorded_roots(self, job_id: str) -> frozenset[Proc]:
        """The processes recorded at the job's first start that are still those processes (an
        unreadable or missing record: none, so the job reads as gone rather than as someone else's)."""
        try:
            recorded = [Proc(int(pid), int(start)) for pid, start in json.loads(self._roots_file(job_id).read_text())]
        except (OSError, ValueError, TypeError):
            return frozenset()
        return frozenset(p for p in recorded if alive(p))

    def poll(self) -> dict[str, LocalJob]:
        jobs = {}
        tree = children()  # one scan of /proc for all jobs
        for spec in self.specs:
            launched = self._launched.get(spec.id)
            if launched is not None:
                launched.poll()  # reap it if it exited, so it is not left a zombie
            roots = [p for p in self._roots.get(spec.id, ()) if alive(p)]
            if not roots and not any(alive(p) for p in self._known.get(spec.id, ())):
                continue
            # the roots as first identified, plus whatever descends from them now
            procs = frozenset(roots) | self._known.get(spec.id, frozenset()) | identities(
                {pid for r in roots for pid in descendants(r.pid, tree)})
            procs = frozenset(p for p in procs if alive(p))
            if not procs:
                continue
            self._known[spec.id] = procs
            jobs[spec.id] = LocalJob(spec.id, procs, None, spec.progress or self.progress_dir / spec.id)
        return jobs

    def exit_code(self, job_id: str) -> int | None:
        launched = self._launched.get(job_id)
        return None if launched is None else launched.poll()

    def spec(self, job_id: str) -> JobSpec | None:
        return next((s for s in self.specs if s.id == job_id), None)

    def close(self) -> None:
        for proc in self._launched.values():
            proc.poll()


def parse_listpids(text: str) -> dict[str, list[int]]:
    """``scontrol listpids`` output -> PIDs by job id (header and unparsable lines skipped)."""
    jobs: dict[str, list[int]] = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) >= 2 and parts[0].isdigit() and parts[1].isdigit():
            jobs.setdefault(parts[1], []).append(int(parts[0]))
    return jobs


@dataclass
class SlurmJobs:
    progress_dir: Path
    freezer_root: Path = FREEZER_ROOT
    scontrol: str = "scontrol"
    env: dict[str, str] | None = None
    _first_seen: dict[str, frozenset[Proc]] = field(default_factory=dict)

    def start(self, known: Container[str] = frozenset()) -> None:
        pass  # ``scontrol listpids`` says what runs now: a job a reboot took is not listed

    def _cgroup(self, job_id: str) -> Path | None:
        """The job's cgroup: v1 ``slurm/uid_<uid>/job_<id>`` under the freezer hierarchy, or v2
        ``system.slice/slurmstepd.scope/job_<id>`` (``<node>_slurmstepd.scope`` with several slurmd)."""
        for pattern in (f"slurm/uid_*/job_{job_id}", f"system.slice/*slurmstepd.scope/job_{job_id}"):
            found = sorted(self.freezer_root.glob(pattern))
            if found:
                return found[0]
        return None

    def poll(self) -> dict[str, LocalJob]:
        out = subprocess.run([self.scontrol, "listpids"], capture_output=True, text=True, timeout=10,
                             env=self.env)
        if out.returncode != 0 and "No job steps exist" in out.stderr:  # an idle node
            return {}
        if out.returncode != 0 and "Unable to connect to slurmstepd" in out.stderr:  # a step ending meanwhile
            raise JobsUnavailable(f"scontrol listpids: {out.stderr.strip()}")
        if out.returncode != 0:
            raise RuntimeError(f"scontrol listpids failed ({out.returncode}): {out.stderr.strip()}")
        jobs = {}
        for job_id, pids in parse_listpids(out.stdout).items():
            procs = frozenset(p for p in map(identity, pids) if p is not None and alive(p))
            if not procs:
                continue
            progress = self.progress_dir / job_id
            # lexists: a link in its place is named, so the agent refuses it with a log line
            named = progress if os.path.lexists(progress) else None
            jobs[job_id] = LocalJob(job_id, procs, self._cgroup(job_id), named)
        return jobs

    def exit_code(self, job_id: str) -> int | None:
        return None

    def spec(self, job_id: str) -> JobSpec | None:
        return None  # Slurm's hooks publish the lifecycle

    def close(self) -> None:
        pass

