"""docs/architecture.md rule 7, a shutter never leaves a job frozen, under faults at every step of a
pause and resume: an act that raises, a freezer stuck in FREEZING, SIGTERM at the main thread or
at another thread, the agent killed (its watchdog resumes). Whatever happens, everything the agent
stopped runs again, and nothing it did not stop (a job suspended, stopped by its user, frozen by
someone else) is continued or thawed. Real processes (``sleep``) and a freezer hierarchy in a
temporary directory whose "kernel" is the test."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from unit.test_agent import FakeSource, agent_on, spooled, wait_for_state

from nodeshare.producers.agent import pausing
from nodeshare.producers.agent.agent import Agent, _signals_held
from nodeshare.producers.agent.jobs import LocalJob
from nodeshare.producers.agent.pausing import Pauser, Target
from nodeshare.producers.agent.processes import Guard, Proc, identity, state
from nodeshare.producers.agent.progress import ProgressFile
from nodeshare.producers.agent.watchdog import Watchdog

UNIT = Path(__file__).parent


class AgentKilled(BaseException):
    """The agent died here (SIGKILL): nothing it would still do happens."""


def exit_on_sigterm(signum: int, frame: Any) -> None:  # as `nodeshare agent` installs it
    raise SystemExit(128 + signum)


@pytest.fixture
def on_sigterm() -> Iterator[Callable[[Callable[[int, Any], None]], None]]:
    """Install a SIGTERM handler for the test; the one before comes back after it."""
    before = signal.getsignal(signal.SIGTERM)
    yield lambda handler: signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGTERM, before)


@pytest.fixture
def python_sigint() -> Iterator[None]:
    """Python's own SIGINT handler (KeyboardInterrupt) for the test: an import elsewhere in the
    suite (dask_jobqueue's runner) replaces it with one that exits."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, before)


@pytest.fixture
def other_thread() -> Iterator[threading.Thread]:
    """A second Python thread, as the agent has (the metrics server's, the decision followers')."""
    done = threading.Event()
    thread = threading.Thread(target=done.wait, daemon=True)
    thread.start()
    yield thread
    done.set()
    thread.join()


def signal_thread(thread: threading.Thread, sig: signal.Signals = signal.SIGTERM) -> None:
    """Send ``sig`` to one thread and return once the kernel delivered it there. To the main
    thread, its Python handler has run when this returns; to another, the main thread runs it at
    its next call (Python runs handlers in the main thread only)."""
    signal.pthread_kill(thread.ident or 0, sig)
    if thread is threading.main_thread():
        return
    status = Path(f"/proc/self/task/{thread.native_id}/status")
    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline:
        pending = next(line for line in status.read_text().splitlines() if line.startswith("SigPnd:"))
        if not int(pending.split()[1], 16) & (1 << (sig - 1)):
            break
        time.sleep(0.0005)
    time.sleep(0.001)


def gone(p: Proc, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while state(p) not in (None, "Z", "X") and time.monotonic() < deadline:
        time.sleep(0.005)
    return state(p) in (None, "Z", "X")


# ----------------------------------------------------------------------------- the node

@dataclass
class Node:
    """Five jobs on one node. a: the only measurable one (the lone job); b: two processes, paused
    with SIGSTOP; c: stopped by someone else before the shutter (T); d: a freezer cgroup; e: a
    freezer cgroup frozen by someone else (Slurm's suspend) before the shutter."""

    tmp: Path
    freezer: Path
    procs: dict[str, Proc]
    popens: list[subprocess.Popen[bytes]]
    stuck: bool = False  # the kernel leaves d FREEZING (a task in uninterruptible sleep)

    def cgroup(self, job: str) -> Path:
        return self.freezer / "slurm" / f"job_{job}"

    def freezer_state(self, job: str) -> str:
        return (self.cgroup(job) / "freezer.state").read_text().strip()

    def jobs(self) -> dict[str, LocalJob]:
        p = self.procs
        return {"a": LocalJob("a", frozenset({p["a"]}), progress=self.tmp / "a"),
                "b": LocalJob("b", frozenset({p["b1"], p["b2"]})),
                "c": LocalJob("c", frozenset({p["c"]})),
                "d": LocalJob("d", frozenset({p["d"]}), cgroup=self.cgroup("d")),
                "e": LocalJob("e", frozenset({p["e"]}), cgroup=self.cgroup("e"))}

    def reset(self) -> None:
        for name in ("a", "b1", "b2", "d", "e"):
            os.kill(self.procs[name].pid, signal.SIGCONT)
        os.kill(self.procs["c"].pid, signal.SIGSTOP)
        assert wait_for_state(self.procs["c"], "T") == "T"
        (self.cgroup("d") / "freezer.state").write_text("THAWED\n")
        (self.cgroup("e") / "freezer.state").write_text("FROZEN\n")

    def stopped_by_the_agent(self) -> set[str]:
        """What of what the agent may stop is stopped now."""
        out = {n for n in ("a", "b1", "b2") if state(self.procs[n]) == "T"}
        return out | ({"d"} if self.freezer_state("d") != "THAWED" else set())

    def check(self, where: str) -> None:
        """Everything the agent stopped runs; what it did not stop is as it was."""
        for name in ("a", "b1", "b2"):
            assert wait_for_state(self.procs[name], "S", 1.0) == "S", f"{where}: {name} left stopped"
        assert self.freezer_state("d") == "THAWED", f"{where}: d left {self.freezer_state('d')}"
        time.sleep(0.01)  # a SIGCONT in flight would show by now
        assert state(self.procs["c"]) == "T", f"{where}: c, stopped before the shutter, was continued"
        assert self.freezer_state("e") == "FROZEN", f"{where}: e, frozen before the shutter, was thawed"


@pytest.fixture
def node(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Node]:
    names = ("a", "b1", "b2", "c", "d", "e")
    popens = [subprocess.Popen(["sleep", "60"]) for _ in names]
    procs = {n: identity(p.pid) for n, p in zip(names, popens, strict=True)}
    assert all(procs.values())
    freezer = tmp_path / "freezer"
    the_node = Node(tmp_path, freezer, {n: p for n, p in procs.items() if p is not None}, popens)
    for job in "de":
        the_node.cgroup(job).mkdir(parents=True)
        (the_node.cgroup(job) / "cgroup.procs").write_text(f"{the_node.procs[job].pid}\n")
    ProgressFile(tmp_path / "a").close()
    real_write = pausing._write_state

    def kernel(cgroup: Path, value: str) -> None:  # the freezer's kernel side, as the test wants it
        real_write(cgroup, "FREEZING" if value == "FROZEN" and the_node.stuck else value)

    monkeypatch.setattr(pausing, "_write_state", kernel)
    monkeypatch.setattr(pausing, "FREEZE_DEADLINE_S", 0.02)
    the_node.reset()
    yield the_node
    for p in popens:
        os.kill(p.pid, signal.SIGCONT)
        p.kill()
        p.wait()


# ----------------------------------------------------------------------------- the defects, one by one

def test_a_freezer_stuck_in_freezing_is_thawed_by_the_agent(node: Node) -> None:
    """The freezer timed out in FREEZING: the cgroup was put in the paused list only after pause()
    returned, so nothing thawed it, nor did the watchdog (told nothing was paused)."""
    node.stuck = True
    agent = agent_on(node.tmp, FakeSource(node.jobs(), {}), freezer_root=node.freezer)
    agent.rescan()
    assert agent.shutter() is False  # abandoned: the agent goes on instead of exiting (and restarting into it)
    assert node.freezer_state("d") == "THAWED" and not agent.pauser.held()
    assert agent.stats.cycles == 0 and agent.stats.skipped_freeze == 1
    assert agent.shutter() is False and agent.stats.skipped_freeze == 2  # backed off: no pause every cycle
    agent.close(0)
    node.check("stuck freezer")


@pytest.mark.parametrize("to", ["main thread", "other thread", "process"])
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_is_never_acted_on_inside_the_held_region(
        on_sigterm: Callable[[Callable[[int, Any], None]], None], other_thread: threading.Thread,
        python_sigint: None, sig: signal.Signals, to: str) -> None:
    """pthread_sigmask held SIGTERM in the main thread only: the kernel gave it to the other thread,
    and Python raised SystemExit in the main thread at once, inside the held region."""
    on_sigterm(exit_on_sigterm)
    before = signal.getsignal(signal.SIGINT)
    reached = []
    with pytest.raises(SystemExit if sig == signal.SIGTERM else KeyboardInterrupt), _signals_held():
        if to == "process":
            os.kill(os.getpid(), sig)
            deadline = time.monotonic() + 0.2
            while time.monotonic() < deadline:  # Python bytecode: the handler would run here
                pass
        else:
            signal_thread(threading.main_thread() if to == "main thread" else other_thread, sig)
        for _ in range(10_000):
            pass
        reached.append("the end of the held region")
    assert reached == ["the end of the held region"]
    assert signal.getsignal(signal.SIGTERM) is exit_on_sigterm
    assert signal.getsignal(signal.SIGINT) is before


def test_a_signal_with_its_default_action_takes_it_when_the_held_region_closes() -> None:
    """The agent used without the CLI's handler: SIGTERM's default action (the end of the process)
    is held too, and taken right after the region, as if the signal had just come."""
    code = ("import os, signal, threading\n"
            "from nodeshare.producers.agent.agent import _signals_held\n"
            "threading.Thread(target=threading.Event().wait, daemon=True).start()\n"
            "with _signals_held():\n"
            "    os.kill(os.getpid(), signal.SIGTERM)\n"
            "    for _ in range(10**6): pass\n"
            "    print('the end of the held region', flush=True)\n"
            "print('after the region', flush=True)\n")
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert child.returncode == -signal.SIGTERM and child.stdout == "the end of the held region\n", child


def test_sigterm_after_the_first_of_a_jobs_two_sigstops_leaves_nothing_stopped(
        node: Node, on_sigterm: Callable[[Callable[[int, Any], None]], None], other_thread: threading.Thread,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """SIGTERM (``systemctl stop``) landed right after job b's first SIGSTOP, with another thread
    alive: the exit came inside the shutter and b's first process stayed stopped for good."""
    on_sigterm(exit_on_sigterm)
    real_send, sent = pausing.send, []

    def send(p: Proc, sig: signal.Signals) -> bool:
        ok = real_send(p, sig)
        sent.append((p, sig))
        if sig == signal.SIGSTOP and len(sent) == 1:
            os.kill(os.getpid(), signal.SIGTERM)
        return ok

    monkeypatch.setattr(pausing, "send", send)
    jobs = {j: node.jobs()[j] for j in "abc"}
    agent = agent_on(node.tmp, FakeSource(jobs, {}), freezer_root=node.freezer)
    agent.rescan()
    with pytest.raises(SystemExit) as exit_:
        agent.run(duration_s=5)
    assert exit_.value.code == 143
    assert [sig for _, sig in sent] == [signal.SIGSTOP, signal.SIGSTOP, signal.SIGCONT, signal.SIGCONT]
    assert {p for p, _ in sent} == {node.procs["b1"], node.procs["b2"]}
    node.check("SIGTERM mid-pause")


def test_a_job_stopped_before_the_shutter_stays_stopped_and_is_not_credited(
        node: Node, monkeypatch: pytest.MonkeyPatch) -> None:
    """A job suspended (Slurm's suspend or gang scheduling, Ctrl-Z, kill -STOP, a debugger: T, or
    its cgroup FROZEN) was continued by the shutter's resume, and credited the pause."""
    ProgressFile(node.tmp / "c").close()  # c could be measured, but it does not run: never the lone job
    jobs = node.jobs()
    jobs["c"] = LocalJob("c", jobs["c"].procs, progress=node.tmp / "c")
    agent = agent_on(node.tmp, FakeSource(jobs, {}), freezer_root=node.freezer)
    agent.rescan()
    writes = []
    kernel = pausing._write_state

    def write(cgroup: Path, value: str) -> None:
        writes.append((cgroup.name, value))
        kernel(cgroup, value)

    monkeypatch.setattr(pausing, "_write_state", write)
    for _ in range(3):
        assert agent.shutter()
    credited = {j: s.paused_us for j, s in agent.state.items()}
    agent.close(0)
    node.check("stopped before the shutter")
    assert writes == [("job_d", "FROZEN"), ("job_d", "THAWED")] * 3  # e, frozen by someone else: never written
    windows = [e for e in spooled(node.tmp) if e["kind"] == "shutter_window"]
    assert [(w["lone_job"], w["paused_jobs"]) for w in windows] == [("a", ["b", "d"])] * 3
    assert credited["c"] == credited["e"] == 0 and min(credited[j] for j in "bd") > 0


def test_a_node_whose_other_jobs_are_all_stopped_is_not_shuttered(node: Node) -> None:
    jobs = node.jobs()
    agent = agent_on(node.tmp, FakeSource({j: jobs[j] for j in "ace"}, {}), freezer_root=node.freezer)
    agent.rescan()
    assert not agent.shutter()  # only a runs: as on a node with one job
    agent.close(0)
    node.check("nothing else runs")
    assert all(s.paused_us == 0 for s in agent.state.values())


def test_the_pauser_leaves_alone_what_stopped_after_it_looked(node: Node) -> None:
    """Between ``running()`` and the pause, someone else stops a process or freezes a cgroup: the
    pause skips it, so the resume does not continue or thaw it."""
    pauser = Pauser(Guard.here(), node.freezer)
    jobs = node.jobs()
    b = pauser.running(pauser.checked(Target("b", jobs["b"].procs)))
    d = pauser.running(pauser.checked(Target("d", jobs["d"].procs, jobs["d"].cgroup)))
    assert b.procs == jobs["b"].procs and d.cgroup is not None
    os.kill(node.procs["b2"].pid, signal.SIGSTOP)
    (node.cgroup("d") / "freezer.state").write_text("FROZEN\n")
    assert wait_for_state(node.procs["b2"], "T") == "T"
    pauser.pause(b)
    pauser.pause(d)
    assert set(pauser.stopped) == {node.procs["b1"]} and not pauser.frozen
    pauser.resume(b)
    pauser.resume(d)
    assert wait_for_state(node.procs["b1"], "S") == "S"
    time.sleep(0.01)
    assert state(node.procs["b2"]) == "T" and node.freezer_state("d") == "FROZEN"


def test_the_watchdog_continues_only_what_the_killed_agent_stopped(node: Node) -> None:
    """A real SIGKILL right after job b's first SIGSTOP, with job c stopped before the shutter."""
    code = (
        "import os, signal, sys\n"
        "from pathlib import Path\n"
        "from unit.test_agent import FakeSource, agent_on\n"
        "from nodeshare.producers.agent import pausing\n"
        "from nodeshare.producers.agent.jobs import LocalJob\n"
        "from nodeshare.producers.agent.processes import Proc\n"
        "tmp = Path(sys.argv[1])\n"
        "p = {n: Proc(int(pid), int(start)) for n, pid, start in (a.split(':') for a in sys.argv[2:])}\n"
        "jobs = {'a': LocalJob('a', frozenset({p['a']}), progress=tmp / 'a'),\n"
        "        'b': LocalJob('b', frozenset({p['b1'], p['b2']})), 'c': LocalJob('c', frozenset({p['c']}))}\n"
        "real_send = pausing.send\n"
        "def send(proc, sig):\n"
        "    ok = real_send(proc, sig)\n"
        "    if sig == signal.SIGSTOP:\n"
        "        print(agent.watchdog.pid, flush=True)\n"
        "        os.kill(os.getpid(), signal.SIGKILL)\n"
        "    return ok\n"
        "pausing.send = send\n"
        "agent = agent_on(tmp, FakeSource(jobs, {}))\n"
        "agent.rescan()\n"
        "agent.shutter()\n"
    )
    args = [f"{n}:{p.pid}:{p.start_ticks}" for n, p in node.procs.items()]
    env = {**os.environ, "PYTHONPATH": str(UNIT.parent)}
    child = subprocess.run([sys.executable, "-c", code, str(node.tmp), *args], capture_output=True, text=True,
                           env=env, timeout=60)
    assert child.returncode == -signal.SIGKILL, child.stderr
    watchdog = identity(int(child.stdout.split()[0]))
    assert watchdog is None or gone(watchdog)
    node.check("agent SIGKILLed after one SIGSTOP")


# ----------------------------------------------------------------------------- every fault at every step

FAULTS = ("raise", "SIGTERM to the main thread", "SIGTERM to another thread", "agent killed")


@dataclass
class Steps:
    """Every act of the agent on the node and its watchdog, in order, with one fault at step ``at``
    (None: a clean run, to list the steps)."""

    node: Node
    fault: str
    at: int | None
    thread: threading.Thread
    agent: Agent | None = None
    names: list[str] = field(default_factory=list)
    dead: bool = False
    stopped_at_exit: list[set[str]] = field(default_factory=list)

    def act(self, name: str, do: Callable[[], Any], dead: Any = None) -> Any:
        if self.dead:  # a killed agent does nothing more
            return dead
        k = len(self.names)
        self.names.append(name)
        if k == self.at and self.fault == "raise":
            raise OSError(f"injected at step {k} ({name})")
        result = do()
        if k == self.at and self.fault.startswith("SIGTERM"):
            signal_thread(threading.main_thread() if "main" in self.fault else self.thread)
        elif k == self.at and self.fault == "agent killed":
            assert self.agent is not None
            self.dead = True
            os.close(self.agent.watchdog._write_end)  # what SIGKILL does to the agent's end of the pipe
            self.agent.watchdog.process.wait(5)
            raise AgentKilled(name)
        return result

    def on_sigterm(self, signum: int, frame: Any) -> None:
        self.stopped_at_exit.append(self.node.stopped_by_the_agent())
        raise SystemExit(128 + signum)


def one_shutter(node: Node, steps: Steps, monkeypatch: pytest.MonkeyPatch) -> BaseException | None:
    """One shutter of a fresh agent on the node, with the step's fault; the agent is closed (unless
    killed) and its watchdog has ended when this returns."""
    names = {p: n for n, p in node.procs.items()}
    real_send, real_write, real_say = pausing.send, pausing._write_state, Watchdog._say

    def say(watchdog: Watchdog, *args: Any, **kwargs: Any) -> None:
        steps.act("watchdog told", lambda: real_say(watchdog, *args, **kwargs))

    with monkeypatch.context() as m:
        m.setattr(pausing, "send", lambda p, sig: steps.act(f"{sig.name} {names[p]}", lambda: real_send(p, sig),
                                                             False))
        m.setattr(pausing, "_write_state", lambda cgroup, value: steps.act(
            f"{value} {cgroup.name}", lambda: real_write(cgroup, value)))
        m.setattr(Watchdog, "_say", say)
        agent = steps.agent = agent_on(node.tmp, FakeSource(node.jobs(), {}), freezer_root=node.freezer)
        real_windows = agent._windows
        agent._windows = lambda counter, k, *s_us: steps.act("measure", lambda: real_windows(counter, k, *s_us))  # type: ignore
        agent.rescan()
        outcome: BaseException | None = None
        try:
            agent.shutter()
        except (Exception, SystemExit, AgentKilled) as e:
            outcome = e
        if steps.dead:
            for counter in agent.counters.values():
                counter.close()
            agent.spool.close()
        else:
            agent.close(0)
    return outcome


@pytest.mark.parametrize("fault", FAULTS)
@pytest.mark.parametrize("stuck", [False, True], ids=["freezer", "freezer stuck in FREEZING"])
def test_a_fault_at_any_step_leaves_stopped_only_what_the_agent_did_not_stop(
        node: Node, fault: str, stuck: bool, other_thread: threading.Thread,
        on_sigterm: Callable[[Callable[[int, Any], None]], None], monkeypatch: pytest.MonkeyPatch) -> None:
    """The fault at each step of a shutter in turn: before it (an act that raises) or after it
    (SIGTERM, the agent killed). After each: b's processes run, d is THAWED, c (stopped before)
    is still stopped and e (frozen before) still FROZEN; a SIGTERM took effect only when nothing
    the agent stops was stopped; the lone job a was never stopped."""
    node.stuck = stuck
    clean = Steps(node, fault, None, other_thread)
    outcome = one_shutter(node, clean, monkeypatch)
    assert outcome is None  # a stuck freezer abandons the cycle, it does not end the agent
    assert clean.agent.stats.skipped_freeze == int(stuck)
    assert not any(n.endswith((" a", " c", " job_e")) for n in clean.names), clean.names  # never touched
    assert "FROZEN job_d" in clean.names and "SIGCONT b2" in clean.names
    node.check("a clean shutter")
    for at, name in enumerate(clean.names):
        where = f"{fault} at step {at} ({name}) of {clean.names}"
        node.reset()
        steps = Steps(node, fault, at, other_thread)
        on_sigterm(steps.on_sigterm)
        outcome = one_shutter(node, steps, monkeypatch)
        node.check(where)
        assert steps.names[:at + 1] == clean.names[:at + 1], where
        if fault.startswith("SIGTERM"):
            assert isinstance(outcome, SystemExit) and outcome.code == 143, (where, outcome)
            assert steps.stopped_at_exit == [set()], where
        elif fault == "agent killed":
            assert isinstance(outcome, AgentKilled), (where, outcome)
        else:
            assert steps.agent is not None and not steps.agent.pauser.held(), where
