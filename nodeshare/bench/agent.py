"""What the agent costs: its own CPU time, and how much longer real co-runners take (Eq. 9-10).

The same ``n`` workloads run throughout; time is cut into slots that alternate between no agent
and the agent shuttering them (started before its slot, so its start-up is not measured).
Alternating short slots keeps the machine's drift out of the comparison. Reported:
* the agent's CPU (user + system, watchdog included) per cycle and as a share of one core;
* the paused share each job actually saw (from the agent's own books) against Eq. 9's Z;
* the work-rate dilation against Eq. 10's T(S, P) / T - 1 = Z / (1 - Z).
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from nodeshare.producers.agent.processes import descendants
from nodeshare.producers.agent.progress import COUNTER
from nodeshare.producers.agent.spool import Spool
from nodeshare.streams.core.shutter_overhead import dilated_run_time, sleep_fraction

from .machine import machine_stamp

AGENT_WARM_UP_S = 2.5  # interpreter start, imports, watchdog, first rescan


def _units(path: Path) -> int:
    return COUNTER.unpack(path.read_bytes()[:COUNTER.size])[0]


def _rates(paths: list[Path], seconds: float) -> list[float]:
    before = [_units(p) for p in paths]
    t0 = time.monotonic()
    time.sleep(seconds)
    spent = time.monotonic() - t0
    return [(_units(p) - b) / spent for p, b in zip(paths, before, strict=True)]


def _cpu_s(root: int) -> float:
    """User + system CPU seconds of a process and its descendants (the agent and its watchdog), now."""
    ticks = 0
    for pid in descendants(root):
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError):
            continue
        ticks += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of stat)
    return ticks / os.sysconf("SC_CLK_TCK")


def _agent_slot(work: Path, slot: int, env: dict[str, str], paths: list[Path],
                seconds: float) -> tuple[list[float], float, float, float]:
    """Rates with the agent on, its steady-state CPU seconds over the slot, the slot's wall seconds,
    and the mean paused share of the jobs over the agent's whole run."""
    spool = work / f"spool{slot}.db"
    agent = subprocess.Popen(
        [sys.executable, "-m", "nodeshare", "agent", "--jobs", str(work / "jobs.toml"), "--node", "bench",
         "--spool", str(spool), "--duration", str(AGENT_WARM_UP_S + seconds), "--drain-timeout", "1"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    started = time.monotonic()
    time.sleep(AGENT_WARM_UP_S)
    cpu0, t0 = _cpu_s(agent.pid), time.monotonic()
    rates = _rates(paths, seconds)
    cpu, wall = _cpu_s(agent.pid) - cpu0, time.monotonic() - t0
    if agent.wait() != 0:
        raise RuntimeError(f"the agent exited with {agent.returncode}")
    books = Spool(spool).meta("jobs", {})
    lived = time.monotonic() - started
    paused = statistics.mean(j["paused_us"] for j in books.values()) / 1e6 / lived if books else 0.0
    return rates, cpu, wall, paused


def measure(agent_env: dict[str, str], *, jobs: int = 2, seconds: float = 4.0, slots: int = 10,
            progress: Callable[[int, int], None] = lambda done, total: None) -> dict[str, Any]:
    """``slots`` slots without and ``slots`` with the agent, alternating; the result is JSON-ready."""
    sample_us = int(agent_env.get("NODESHARE_SAMPLE_US", "3200"))
    period_ms = int(agent_env.get("NODESHARE_PERIOD_MS", "200"))
    s, p = sample_us / 1e6, period_ms / 1e3
    off: list[float] = []
    on: list[float] = []
    cpu_pct: list[float] = []
    cpu_ms_per_cycle: list[float] = []
    paused_share: list[float] = []
    with tempfile.TemporaryDirectory(prefix="ns-overhead-") as tmp:
        work = Path(tmp)
        paths = [work / f"p{i}" for i in range(jobs)]
        procs = [subprocess.Popen([sys.executable, "-m", "nodeshare", "workload", "--kind", "compute", "--seconds",
                                   str(10 * slots * (seconds + AGENT_WARM_UP_S) + 60), "--progress", str(path)],
                                  stdout=subprocess.DEVNULL) for path in paths]
        try:
            deadline = time.monotonic() + 30
            while not all(path.exists() for path in paths):
                if time.monotonic() > deadline:
                    raise RuntimeError("the workloads did not start within 30 s")
                time.sleep(0.05)
            (work / "jobs.toml").write_text("".join(
                f'[[jobs]]\nid = "j{i}"\npids = [{proc.pid}]\nprogress = "{path}"\n'
                for i, (proc, path) in enumerate(zip(procs, paths, strict=True))))
            time.sleep(1.0)  # past numpy's import and first touches
            for slot in range(slots):
                off.append(statistics.mean(_rates(paths, seconds)))
                rates, cpu, wall, paused = _agent_slot(work, slot, agent_env, paths, seconds)
                on.append(statistics.mean(rates))
                cpu_pct.append(100 * cpu / wall)
                cpu_ms_per_cycle.append(1000 * cpu / (wall / (3 * s + p)))
                paused_share.append(paused)
                progress(slot + 1, slots)
        finally:
            for proc in procs:
                proc.kill()
                proc.wait()
    dilation = [a / b - 1 for a, b in zip(off, on, strict=True)]
    return {
        "jobs": jobs, "seconds_per_slot": seconds, "slots": slots, "sample_us": sample_us, "period_ms": period_ms,
        "agent_cpu_pct_of_one_core": round(statistics.median(cpu_pct), 3),
        "agent_cpu_ms_per_cycle": round(statistics.median(cpu_ms_per_cycle), 3),
        "paused_share_pct": round(100 * statistics.median(paused_share), 3),
        "eq9_paused_share_pct": round(100 * sleep_fraction(jobs, s, p), 3),
        "dilation_pct": round(100 * statistics.median(dilation), 3),
        "dilation_pct_iqr": [round(100 * q, 3) for q in statistics.quantiles(dilation, n=4)[::2]]
        if len(dilation) >= 2 else [],
        "eq10_dilation_pct": round(100 * (dilated_run_time(1.0, jobs, s, p) - 1), 3),
        "work_rate_off_median": round(statistics.median(off)), "work_rate_on_median": round(statistics.median(on)),
        "machine": machine_stamp(),
    }
