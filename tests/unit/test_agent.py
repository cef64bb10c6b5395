"""The node agent's parts that need no broker: rotation, samples, RAPL arithmetic, the job file,
`scontrol listpids` parsing, the signalling guard, the spool, and the watchdog."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Container, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from prometheus_client import REGISTRY

from nodeshare.producers.agent import rapl
from nodeshare.producers.agent.agent import Agent, AgentOptions
from nodeshare.producers.agent.jobs import JobFileError, JobSpec, LocalJob, load_job_file, parse_listpids
from nodeshare.producers.agent.pausing import FREEZER_ROOT, Pauser, Target, check_cgroup
from nodeshare.producers.agent.processes import Guard, Proc, Refused, identity, state
from nodeshare.producers.agent.progress import (
    COUNTER,
    REREADS,
    RESET_AFTER_S,
    ApplicationCounter,
    Counter,
    ProgressFile,
    sample_between,
)
from nodeshare.producers.agent.shutter import next_lone, shutter_window
from nodeshare.producers.agent.spool import Spool, SpoolFull
from nodeshare.producers.agent.watchdog import Watchdog
from nodeshare.producers.batching import FlushPolicy
from nodeshare.schemas import CounterSource, IpcSample
from nodeshare.streams.core.shutter_policy import LevelStats, ShutterPolicy


def wait_for_state(p: Proc, wanted: str, timeout_s: float = 2.0) -> str | None:
    deadline = time.monotonic() + timeout_s
    while (s := state(p)) != wanted and time.monotonic() < deadline:
        time.sleep(0.005)
    return s


@pytest.fixture
def sleeper() -> Proc:
    proc = subprocess.Popen(["sleep", "60"])
    p = identity(proc.pid)
    assert p is not None
    yield p
    os.kill(proc.pid, signal.SIGCONT)
    proc.kill()
    proc.wait()


# ----------------------------------------------------------------------------- pure parts

def test_the_lone_job_rotates_through_the_sorted_jobs() -> None:
    assert next_lone(["b", "a", "c"], None) == "a"
    assert next_lone(["b", "a", "c"], "a") == "b"
    assert next_lone(["b", "a", "c"], "c") == "a"
    assert next_lone(["a", "c"], "b") == "c"  # the previous one has left: the next after it
    with pytest.raises(ValueError):
        next_lone([], None)


def test_a_sample_is_the_difference_of_two_readings() -> None:
    assert sample_between((100, 1_000, 1), (400, 4_000, 1)) == IpcSample(instructions=300, cycles=3_000)
    # a counter that went backwards (restarted job) reads as no work, never as negative work
    assert sample_between((400, 1_000, 1), (100, 2_000, 2)) == IpcSample(instructions=0, cycles=1_000, threads=2)


def test_one_cycle_gives_the_nodes_window() -> None:
    t = datetime(2026, 11, 22, tzinfo=UTC)
    window = shutter_window(node="n1", source="agent/n1", cycle=7, lone="a", paused=["c", "b"], start=t,
                            end=t + timedelta(milliseconds=4))
    assert window.paused_jobs == ("b", "c") and window.lone_job == "a" and window.event_id == "n1/win/7"


def test_rapl_watts_from_energy_deltas_across_a_wrap() -> None:
    assert rapl.watts(1_000_000, 51_000_000, 2**32, 1.0) == 50.0
    # the counter wrapped at 262,143,328,850 uJ (a real max_energy_range_uj): 10 J in 0.5 s
    assert rapl.watts(262_143_328_850 - 4_000_000, 6_000_000, 262_143_328_850, 0.5) == pytest.approx(20.0)
    with pytest.raises(ValueError):
        rapl.watts(0, 1, 10, 0.0)


def test_rapl_domains_are_the_packages_only(tmp_path: Path) -> None:
    for name, energy in (("intel-rapl:1", "5"), ("intel-rapl:0", "7"), ("intel-rapl:0:0", "1")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "energy_uj").write_text(energy)
    assert [d.processor for d in rapl.package_domains(tmp_path)] == [0, 1]
    assert rapl.package_domains(tmp_path / "absent") == []  # no RAPL: no numbers (the agent says unavailable)


def test_listpids_output_groups_pids_by_job() -> None:
    text = ("PID      JOBID    STEPID   LOCALID GLOBALID\n"
            "4242     17       batch    0       0\n"
            "4250     17       batch    -       -\n"
            "4301     18       0        0       0\n")
    assert parse_listpids(text) == {"17": [4242, 4250], "18": [4301]}


@pytest.mark.parametrize(("body", "message"), [
    ('[[jobs]]\nid = "a"\n', "exactly one of 'pids'"),
    ('[[jobs]]\nid = "a"\npids = [1]\n', "above 1"),
    ('[[jobs]]\nid = "a"\npids = [5]\n[[jobs]]\nid = "a"\ncommand = ["true"]\n', "duplicate job ids"),
    ('[[jobs]]\nid = "a"\npids = [5]\ncolour = "red"\n', "jobs[0].colour"),
    ('jobz = 1\n', "unknown key"),
    ('[[jobs]\n', "jobs.toml"),
])
def test_job_file_errors_name_the_file_and_entry(tmp_path: Path, body: str, message: str) -> None:
    path = tmp_path / "jobs.toml"
    path.write_text(body)
    with pytest.raises(JobFileError, match=message.replace("[", r"\[").replace("]", r"\]").replace("(", r"\(")):
        load_job_file(path)


# ----------------------------------------------------------------------------- the guard

def test_the_guard_refuses_pid_1_itself_and_unmanaged_processes(sleeper: Proc) -> None:
    guard = Guard.here()
    me = identity(os.getpid())
    assert me is not None
    init = Proc(1, 0)
    with pytest.raises(Refused, match="PID 1"):
        guard.check(init, frozenset({init}))
    with pytest.raises(Refused, match="agent itself"):
        guard.check(me, frozenset({me}))
    with pytest.raises(Refused, match="not a process of a managed job"):
        guard.check(sleeper, frozenset())
    guard.check(sleeper, frozenset({sleeper}))  # managed: allowed


def test_a_reused_pid_is_not_the_same_process(sleeper: Proc) -> None:
    pauser = Pauser(Guard.here())
    impostor = Proc(sleeper.pid, sleeper.start_ticks + 1)  # same PID, another start time
    pauser.pause(Target("j", frozenset({impostor})))
    assert wait_for_state(sleeper, "T", 0.2) != "T"  # nothing was stopped
    pauser.pause(Target("j", frozenset({sleeper})))
    assert wait_for_state(sleeper, "T") == "T"
    pauser.resume(Target("j", frozenset({sleeper})))
    assert wait_for_state(sleeper, "S") == "S"


def test_cgroups_outside_the_freezer_hierarchy_or_holding_the_agent_are_refused(tmp_path: Path) -> None:
    root = tmp_path / "freezer"
    (root / "slurm" / "job_1").mkdir(parents=True)
    (root / "slurm" / "job_1" / "cgroup.procs").write_text("123\n")
    (root / "mine").mkdir()
    (root / "mine" / "cgroup.procs").write_text(f"{os.getpid()}\n")
    guard = Guard.here()
    assert check_cgroup(root / "slurm" / "job_1", guard, root) == (root / "slurm" / "job_1").resolve()
    with pytest.raises(Refused, match="not below"):
        check_cgroup(root, guard, root)
    with pytest.raises(Refused, match="not below"):
        check_cgroup(tmp_path, guard, root)
    with pytest.raises(Refused, match="agent's own"):
        check_cgroup(root / "mine", guard, root)
    with pytest.raises(Refused, match="not below"):
        check_cgroup(root / "slurm" / ".." / "..", guard, root)


# ----------------------------------------------------------------------------- counters, spool, watchdog

def test_an_application_counter_is_read_through_shared_memory(tmp_path: Path) -> None:
    writer = ProgressFile(tmp_path / "p" / "job")
    reader = ApplicationCounter(tmp_path / "p" / "job")
    first = reader.read()
    for _ in range(1000):
        writer.add()
    second = reader.read()
    assert second[0] - first[0] == 1000 and second[1] > first[1] and reader.source is CounterSource.APPLICATION
    writer.close()
    reader.close()
    assert ProgressFile(tmp_path / "p" / "job").value == 1000  # a restarted job continues its count


def test_a_progress_file_shorter_than_a_count_begins_at_zero(tmp_path: Path) -> None:
    (tmp_path / "job").write_bytes(b"\x01\x02\x03")  # a partial write, or another program's file
    counter = ProgressFile(tmp_path / "job")
    assert counter.value == 0  # not 0x030201 with zeros appended after it
    counter.add(5)
    counter.close()
    assert (tmp_path / "job").read_bytes() == COUNTER.pack(5)


WRITER = """
import sys, time
from pathlib import Path
from nodeshare.producers.agent.progress import ProgressFile
counter, deadline = ProgressFile(Path(sys.argv[1])), time.monotonic() + float(sys.argv[2])
while time.monotonic() < deadline:
    for _ in range(64):
        counter.add()
counter.close()
"""


def test_a_progress_file_is_never_seen_half_written(tmp_path: Path) -> None:
    """Each update is one store: a reader never sees the count go back (with struct.pack_into,
    which zeroes the word first, this read 7,200-20,000 counts lower in a second)."""
    path = tmp_path / "job"
    ProgressFile(path).close()
    writer = subprocess.Popen([sys.executable, "-c", WRITER, str(path), "1.5"])
    fd = os.open(path, os.O_RDONLY)
    try:
        deadline = time.monotonic() + 30
        while COUNTER.unpack(os.pread(fd, 8, 0))[0] == 0:  # the writer has begun
            assert writer.poll() is None and time.monotonic() < deadline, "the writer never counted"
            time.sleep(0.001)
        first, lower, deadline = COUNTER.unpack(os.pread(fd, 8, 0))[0], 0, time.monotonic() + 1.0
        last = first
        while time.monotonic() < deadline:
            count = COUNTER.unpack(os.pread(fd, 8, 0))[0]
            lower += count < last
            last = max(last, count)
    finally:
        os.close(fd)
        assert writer.wait(timeout=30) == 0
    assert lower == 0 and last > first  # the count moved while it was read


def test_a_count_read_lower_is_held_and_flagged_and_only_a_lasting_one_is_a_reset(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A writer that clears its word and is descheduled before it writes it shows a zero for
    milliseconds: the agent's work never goes back, never leaps by the whole count, and the
    windows read meanwhile are flagged (the agent drops their block). A count that stays lower
    for RESET_AFTER_S is the job starting over."""
    writer = ProgressFile(tmp_path / "job")
    reader = ApplicationCounter(tmp_path / "job")
    writer.add(5000)
    first = reader.read()
    assert first[0] == 5000 and not reader.went_back()
    real_pread, zeros = os.pread, [1]

    def flaky(fd: int, n: int, offset: int) -> bytes:
        if zeros[0]:
            zeros[0] -= 1
            return bytes(n)
        return real_pread(fd, n, offset)

    monkeypatch.setattr(os, "pread", flaky)
    writer.add(100)
    assert reader.read()[0] == 5100 and not reader.went_back()  # one zero: read again at once
    zeros[0] = 2 * (REREADS + 1)  # the writer stays descheduled over two windows
    held = [reader.read(), reader.read()]
    writer.add(7)
    back = reader.read()
    assert [r[0] for r in held] == [5100, 5100] and back[0] == 5107  # no leap, nothing lost
    assert reader.went_back() and not reader.went_back()  # flagged once, then cleared
    now = [1000.0]
    monkeypatch.setattr(time, "monotonic", lambda: now[0])
    writer.value = 0
    writer.add(3)  # the job began its count again
    assert reader.read()[0] == 5107  # lower: held...
    now[0] += RESET_AFTER_S
    writer.add(2)
    assert reader.read()[0] == 5107 + 5 and reader.went_back()  # ...until it lasted: a reset, credited at once
    writer.add(4)
    assert reader.read()[0] == 5116 and not reader.went_back()  # then counted from there
    writer.close()
    reader.close()


def test_an_application_counters_time_is_the_jobs_cpu_time(tmp_path: Path) -> None:
    """A job that cannot run (here: stopped; in life: descheduled) spends no time, so its rate
    is not diluted by the wait; an exited process keeps the time it ran."""
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        ProgressFile(tmp_path / "job").close()
        reader = ApplicationCounter(tmp_path / "job", [busy.pid])
        time.sleep(0.3)
        os.kill(busy.pid, signal.SIGSTOP)
        stopped = reader.read()
        time.sleep(0.3)
        still = reader.read()
        assert still[1] - stopped[1] < 10_000_000  # under 10 ms of CPU in 300 ms stopped
        os.kill(busy.pid, signal.SIGCONT)
        time.sleep(0.3)
        ran = reader.read()
        assert ran[1] - still[1] > 30_000_000  # it ran again (at least 10% of a core)
    finally:
        busy.kill()
        busy.wait()
    assert reader.read()[1] >= ran[1]  # exited: its time stays counted
    reader.close()


def test_an_application_counters_cpu_time_is_exact_between_scheduler_ticks(tmp_path: Path) -> None:
    """A single-threaded job cannot run longer than the wall time between two readings. The
    process CPU clock of another process moves in whole scheduler ticks (4 ms at HZ=250), so
    1 ms apart it reads 0 or 4 ms and breaks that bound by 3 ms; the task clock is exact (to the
    few microseconds by which the processors' scheduler clocks and CLOCK_MONOTONIC differ).
    Each reading is bounded by the wall time from just before the previous read to just after this
    one: the reader itself may be preempted between a read and its clock reading (a CI run saw 2.5 ms
    of CPU against 1.4 ms of wall taken from after the previous read)."""
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        ProgressFile(tmp_path / "job").close()
        reader = ApplicationCounter(tmp_path / "job", [busy.pid])
        assert reader.coarse_error is None
        time.sleep(0.1)
        over = []
        start, (_, first, _) = time.monotonic_ns(), reader.read()
        before, cpu = start, first
        for _ in range(100):
            time.sleep(0.001)
            pre = time.monotonic_ns()
            (_, now, _), after = reader.read(), time.monotonic_ns()
            if not 0 <= now - cpu <= after - before + 100_000:  # 0.1 ms of clock skew
                over.append((now - cpu, after - before))
            before, cpu = pre, now
        assert not over
        assert cpu - first > 0.1 * (after - start)  # and it does move: the busy process ran
    finally:
        busy.kill()
        busy.wait()
    reader.close()


def test_an_application_counter_times_threads_and_processes_the_job_starts_later(tmp_path: Path) -> None:
    """A job forks after the agent opened its counter: the child's time counts too (the task
    clock is inherited), though the agent only knew the first process. Each process prints its
    own CPU time when done; the child then exits at once (``os._exit``: no interpreter teardown),
    and the parent, once it has reaped the child and printed, waits for the test to read the
    counter. The counter holds the exited child's time and the parent's (less the interpreter's
    start, before the counter opened). The task clock runs on the scheduler's local clock, which on
    a virtual machine includes what the hypervisor stole and interrupts took, where the process
    clock leaves them out: two CI runs counted 2.6% and 3.0% above the processes' own times (59 ms
    before the child exited at once, 52.7 ms after). The bound allows 5% over, which still refuses a
    child counted twice (+50%) or the parent's 0.3 s of sleep."""
    # one write(2) a line: two print()s to one pipe interleaved their pieces in a CI run
    script = ("import os, sys, time\ntime.sleep(0.3)\nchild = os.fork()\nend = time.monotonic() + 1.0\n"
              "while time.monotonic() < end: pass\n"
              "if child == 0:\n    os.write(1, f'child {time.process_time_ns()}\\n'.encode())\n    os._exit(0)\n"
              "os.waitpid(child, 0)\nos.write(1, f'parent {time.process_time_ns()}\\n'.encode())\n"
              "sys.stdin.read()\n")
    job = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        ProgressFile(tmp_path / "job").close()
        reader = ApplicationCounter(tmp_path / "job", [job.pid])
        assert job.stdout is not None
        own = {who: int(ns) for who, ns in (job.stdout.readline().split() for _ in range(2))}
        counted = reader.read()[1]
        reader.close()
    finally:
        job.communicate(timeout=30)
    assert own["child"] > 50_000_000  # it ran
    # the upper end allows for time the VM's host stole, the child's exit in the kernel and the
    # parent's two system calls after it printed
    both = own["parent"] + own["child"]
    assert own["parent"] + 0.5 * own["child"] < counted <= 1.05 * both + 10_000_000


def test_a_job_is_timed_once_per_thread_and_too_many_threads_fall_back_to_the_process_clock(tmp_path, monkeypatch):
    """A pid listed twice (or a thread id next to its process) is one thread group, counted once;
    a job with more threads than a task clock may hold descriptors for is timed by the process
    clock, and says why."""
    from nodeshare.producers.agent import progress

    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        ProgressFile(tmp_path / "job").close()
        once, twice = (ApplicationCounter(tmp_path / "job", pids) for pids in ([busy.pid], [busy.pid, busy.pid]))
        a0, b0 = once.read()[1], twice.read()[1]
        time.sleep(0.3)
        a1, b1 = once.read()[1], twice.read()[1]
        assert abs((b1 - b0) - (a1 - a0)) < 0.2 * (a1 - a0)
        monkeypatch.setattr(progress, "MAX_TASK_CLOCK_THREADS", 0)
        many = ApplicationCounter(tmp_path / "job", [busy.pid])
        assert many.coarse_error is not None and many.coarse_error.errno == errno.EMFILE
    finally:
        busy.kill()
        busy.wait()
    for c in (once, twice, many):
        c.close()


def test_out_of_descriptors_is_no_refused_progress_file(tmp_path, monkeypatch):
    """EMFILE is the agent's own limit, not the file's fault: the job is not measured without its
    progress file for good (its counter is opened at a later rescan)."""
    from nodeshare.producers.agent import progress

    ProgressFile(tmp_path / "job").close()

    def out_of_descriptors(*_args, **_kwargs):
        raise OSError(errno.EMFILE, "Too many open files")

    monkeypatch.setattr(progress.os, "open", out_of_descriptors)
    with pytest.raises(OSError) as raised:
        progress.open_progress(tmp_path / "job", os.geteuid())
    assert raised.value.errno == errno.EMFILE and not isinstance(raised.value, progress.ProgressRefused)


def test_the_spool_keeps_order_and_its_bound_and_survives_a_restart(tmp_path: Path) -> None:
    spool = Spool(tmp_path / "spool.db", max_bytes=100)
    spool.put([("t", b"k", b"x" * 30), ("t", b"k", b"y" * 30)], {"next_cycle": 3})
    with pytest.raises(SpoolFull, match="not acknowledged"):
        spool.put([("t", b"k", b"z" * 45)])
    spool.put([("t", b"k", b"z" * 2)], reserve=True)  # a job's end marker still fits in the reserve
    spool.close()

    again = Spool(tmp_path / "spool.db", max_bytes=100)
    rows = again.after(0, 10)
    assert [r[3][:1] for r in rows] == [b"x", b"y", b"z"] and again.meta("next_cycle") == 3
    again.ack([rows[0][0]])
    assert [r[3][:1] for r in again.after(0, 10)] == [b"y", b"z"]
    assert (again.rows, again.bytes) == (2, 31 + 3)


def test_a_signal_around_the_spools_commit_keeps_its_count_true(tmp_path: Path) -> None:
    """SIGTERM's SystemExit can arrive just after COMMIT returns (seen in CI: the ROLLBACK then
    failed, masked the exit and left the spool's count one short). Before COMMIT: rolled back;
    after it: the rows are in and counted. (Mutation: the unconditional ROLLBACK of before.)"""

    class Interrupted:  # the connection, with a SystemExit raised around one statement
        def __init__(self, db, statement: str, after: bool) -> None:
            self.db, self.statement, self.after = db, statement, after

        def __getattr__(self, name):
            return getattr(self.db, name)

        def execute(self, sql, *args):
            if sql == self.statement and not self.after:
                raise SystemExit(143)
            out = self.db.execute(sql, *args)
            if sql == self.statement:
                raise SystemExit(143)
            return out

    spool = Spool(tmp_path / "spool.db")
    real = spool._db
    spool._db = Interrupted(real, "COMMIT", after=True)
    with pytest.raises(SystemExit):
        spool.put([("t", b"k", b"x" * 10)])
    spool._db = Interrupted(real, "COMMIT", after=False)
    with pytest.raises(SystemExit):
        spool.put([("t", b"k", b"y" * 10)])
    spool._db = real
    assert not real.in_transaction and [r[3] for r in spool.after(0, 10)] == [b"x" * 10]
    assert (spool.rows, spool.bytes) == (1, 11)
    spool.put([("t", b"k", b"z" * 10)])
    seqs = [r[0] for r in spool.after(0, 10)]
    spool._db = Interrupted(real, "COMMIT", after=False)  # an ack interrupted: nothing forgotten
    with pytest.raises(SystemExit):
        spool.ack(seqs[:1])
    spool._db = Interrupted(real, "COMMIT", after=True)  # interrupted once committed: forgotten, and counted
    with pytest.raises(SystemExit):
        spool.ack(seqs[:1])
    spool._db = real
    assert not real.in_transaction and [r[3] for r in spool.after(0, 10)] == [b"z" * 10]
    assert (spool.rows, spool.bytes) == (1, 11)


def test_the_watchdog_resumes_what_was_paused_when_the_agent_dies(sleeper: Proc) -> None:
    # the "agent" is a child that arms a watchdog, pauses the sleeper and is then SIGKILLed
    code = (
        "import os, signal, sys, time\n"
        "from nodeshare.producers.agent.watchdog import Watchdog\n"
        "from nodeshare.producers.agent.pausing import Pauser, Target\n"
        "from nodeshare.producers.agent.processes import Guard, Proc\n"
        f"p = Proc({sleeper.pid}, {sleeper.start_ticks})\n"
        "w = Watchdog()\n"
        "t = Target('j', frozenset({p}))\n"
        "w.arm([t]); Pauser(Guard.here(w.pid)).pause(t)\n"
        "print('paused', flush=True); time.sleep(60)\n"
    )
    agent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert agent.stdout is not None and agent.stdout.readline().strip() == "paused"
    assert wait_for_state(sleeper, "T") == "T"
    agent.kill()
    agent.wait()
    assert wait_for_state(sleeper, "S", 1.0) == "S"  # resumed within a second of the SIGKILL


def test_a_disarmed_watchdog_touches_nothing(sleeper: Proc) -> None:
    w = Watchdog()
    t = Target("j", frozenset({sleeper}))
    w.arm([t])
    w.disarm()
    os.kill(sleeper.pid, signal.SIGSTOP)  # stopped by someone else after the shutter: not the watchdog's business
    assert wait_for_state(sleeper, "T") == "T"
    w.close()
    assert w.process.returncode == 0
    time.sleep(0.1)
    assert state(sleeper) == "T"


FREEZER = Path("/sys/fs/cgroup/freezer")


@pytest.mark.skipif(os.geteuid() != 0 or not (FREEZER / "cgroup.procs").exists(),
                    reason="needs root and a cgroup v1 freezer hierarchy")
def test_a_job_cgroup_is_frozen_and_thawed_and_the_watchdog_thaws_it_after_sigkill(sleeper: Proc) -> None:
    cgroup = FREEZER / f"nodeshare-test-{os.getpid()}"
    cgroup.mkdir()
    try:
        (cgroup / "cgroup.procs").write_text(str(sleeper.pid))
        target = Target("j", frozenset({sleeper}), cgroup)
        pauser = Pauser(Guard.here())
        pauser.pause(pauser.checked(target))
        assert (cgroup / "freezer.state").read_text().strip() == "FROZEN"
        pauser.resume(target)
        assert (cgroup / "freezer.state").read_text().strip() == "THAWED"

        code = ("import time\nfrom pathlib import Path\n"
                "from nodeshare.producers.agent.watchdog import Watchdog\n"
                "from nodeshare.producers.agent.pausing import Pauser, Target\n"
                "from nodeshare.producers.agent.processes import Guard\n"
                f"t = Target('j', frozenset(), Path('{cgroup}'))\n"
                "w = Watchdog(); w.arm([t]); Pauser(Guard.here(w.pid)).pause(t)\n"
                "print('frozen', flush=True); time.sleep(60)\n")
        agent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
        assert agent.stdout is not None and agent.stdout.readline().strip() == "frozen"
        agent.kill()
        agent.wait()
        deadline = time.monotonic() + 1.0
        while (cgroup / "freezer.state").read_text().strip() != "THAWED" and time.monotonic() < deadline:
            time.sleep(0.005)
        assert (cgroup / "freezer.state").read_text().strip() == "THAWED"
    finally:
        (FREEZER / "cgroup.procs").write_text(str(sleeper.pid))  # back to the root before removing
        cgroup.rmdir()


# ----------------------------------------------------------------------------- the agent's books

class FakeSource:
    """Jobs the test says are running; a static job's billing details."""

    def __init__(self, jobs: dict[str, LocalJob], specs: dict[str, JobSpec]) -> None:
        self.jobs, self.specs = jobs, specs

    def start(self, known: Container[str] = frozenset()) -> None: ...

    def poll(self) -> dict[str, LocalJob]:
        return dict(self.jobs)

    def exit_code(self, job_id: str) -> int | None:
        return None

    def spec(self, job_id: str) -> JobSpec | None:
        return self.specs.get(job_id)

    def close(self) -> None: ...


class NoBroker:
    """A forwarder that never sends: what the agent publishes stays in its spool for the test to read."""

    def __init__(self, spool: Spool) -> None: ...

    def pump(self, timeout: float = 0.0) -> None: ...

    def drain(self, timeout: float) -> bool:
        return False

    def close(self, timeout: float) -> None: ...


def agent_on(tmp_path: Path, source: FakeSource, max_bytes: int = 2**20, flush: FlushPolicy | None = None,
             freezer_root: Path = FREEZER_ROOT) -> Agent:
    options = AgentOptions(node="n1", spool=tmp_path / "spool.db", spool_max_bytes=max_bytes, sample_us=1000,
                           hardware_counters=False, flush=flush or FlushPolicy(), freezer_root=freezer_root)
    return Agent(options, source, NoBroker, lambda name: name)  # type: ignore[arg-type]


def spooled(tmp_path: Path) -> list[dict]:
    spool = Spool(tmp_path / "spool.db")
    events = [json.loads(r[3]) for r in spool.after(0, 1000)]
    spool.close()
    return events


def spooled_ids(tmp_path: Path) -> list[str]:
    return [e["event_id"] for e in spooled(tmp_path)]


@pytest.fixture
def two_jobs(tmp_path: Path) -> Iterator[dict[str, LocalJob]]:
    """Two sleeping processes with application progress counters (so the agent can shutter them)."""
    procs = [subprocess.Popen(["sleep", "60"]) for _ in range(2)]
    try:
        jobs = {}
        for name, proc in zip("ab", procs, strict=True):
            ProgressFile(tmp_path / name).close()
            p = identity(proc.pid)
            assert p is not None
            jobs[name] = LocalJob(name, frozenset({p}), progress=tmp_path / name)
        yield jobs
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def test_the_agent_batches_blocks_and_a_crash_loses_no_open_batch(tmp_path: Path,
                                                                   two_jobs: dict[str, LocalJob]) -> None:
    flush = FlushPolicy(max_blocks=2, max_age_s=3600)
    first = agent_on(tmp_path, FakeSource(two_jobs, {}), flush=flush)
    first.rescan()
    for _ in range(6):  # the lone job alternates: a gets cycles 0, 2, 4 and b 1, 3, 5
        assert first.shutter()
    # a crash: no close, so nothing flushes; only what the spool holds survives
    first.watchdog.close()
    first.spool.close()
    second = agent_on(tmp_path, FakeSource({"b": two_jobs["b"]}, {}), flush=flush)
    assert {j: b.cycle for (j, _), b in second.batcher.open.items()} == {"a": [4], "b": [5]}
    second.rescan()  # job a left the node: its open batch goes out before its marker
    second.close(0)  # stop: b's open batch goes out too
    events = [e for e in spooled(tmp_path) if e["kind"] != "shutter_window"]
    assert [(e["kind"], e["job_id"], e.get("cycle"), e.get("seq")) for e in events] == [
        ("shutter_batch", "a", [0, 2], 0), ("shutter_batch", "b", [1, 3], 0),
        ("shutter_batch", "a", [4], 1), ("job_left_node", "a", None, None), ("shutter_batch", "b", [5], 1)]
    assert events[3]["blocks_sent"] == 3 and events[3]["last_cycle"] == 4
    assert all(len(e["during"]["cycles"]) == len(e["cycle"]) for e in events if e["kind"] == "shutter_batch")


def test_a_static_job_that_ended_while_the_agent_was_down_still_gets_its_end(sleeper: Proc, tmp_path: Path) -> None:
    spec = JobSpec(id="a", pids=[sleeper.pid], program="p", cores=2)
    first = agent_on(tmp_path, FakeSource({"a": LocalJob("a", frozenset({sleeper}))}, {"a": spec}))
    first.rescan()
    first.close(0)
    # restarted after the job ended: this agent never sees it run
    second = agent_on(tmp_path, FakeSource({}, {"a": spec}))
    second.rescan()
    assert REGISTRY.get_sample_value("nodeshare_agent_spool_events") == 3  # nothing acknowledged: all spooled
    second.close(0)
    assert spooled_ids(tmp_path) == ["n1/job/a/started", "n1/left/a", "n1/job/a/ended"]


def test_an_aged_batch_the_full_spool_refuses_stays_open(tmp_path: Path, two_jobs: dict[str, LocalJob]) -> None:
    agent = agent_on(tmp_path, FakeSource(two_jobs, {}), flush=FlushPolicy(max_age_s=0))
    agent.rescan()
    assert agent.shutter() and len(agent.batcher.open) == 1
    agent.spool.max_bytes = 1  # the broker went away and the spool filled up
    assert not agent._send(agent.batcher.due(datetime.now(UTC)))  # no crash...
    assert [b.cycle for b in agent.batcher.open.values()] == [[0]]  # ...and the block waits, in the meta
    agent.spool.max_bytes = 2**20
    assert agent._send(agent.batcher.due(datetime.now(UTC))) and not agent.batcher.open
    agent.close(0)
    assert [e["cycle"] for e in spooled(tmp_path) if e["kind"] == "shutter_batch"] == [[0]]


def test_a_cycle_the_full_spool_refused_is_not_counted(tmp_path: Path, two_jobs: dict[str, LocalJob]) -> None:
    agent = agent_on(tmp_path, FakeSource(two_jobs, {}), max_bytes=1, flush=FlushPolicy(max_blocks=1))  # none fits
    agent.rescan()
    shutters = REGISTRY.get_sample_value("nodeshare_agent_shutter_seconds_count") or 0.0
    assert agent.shutter()  # measured, paused and resumed...
    assert REGISTRY.get_sample_value("nodeshare_agent_shutter_seconds_count") == shutters + 1
    assert REGISTRY.get_sample_value("nodeshare_agent_spool_events") == agent.spool.rows == 0
    books = {j: (s.blocks, s.last_cycle) for j, s in agent.state.items()}
    paused = [s.paused_us for s in agent.state.values()]
    assert not agent.batcher.open  # the refused block is not waiting in a batch either
    agent.close(0)
    # ...but not kept: no block counted, the cycle number free again, the pause still credited
    assert books == {"a": (0, -1), "b": (0, -1)} and agent.cycle == 0 and max(paused) > 0
    assert all(state(p) != "T" for job in two_jobs.values() for p in job.procs)


def test_a_file_with_no_count_or_a_count_torn_high_is_flagged(tmp_path: Path) -> None:
    """A writer that truncates the file to write it again shows no count in between; one that
    stores the high half first can show a count too high, seen by the read after it: both flag the
    reads (the agent drops the block), and the work never leaps by the job's whole count."""
    path = tmp_path / "job"
    writer = ProgressFile(path)
    reader = ApplicationCounter(path)
    writer.add(1000)
    assert reader.read()[0] == 1000 and not reader.went_back()
    path.write_bytes(b"")  # truncated...
    assert reader.read()[0] == 1000 and reader.went_back()  # ...no count: held, flagged
    path.write_bytes(COUNTER.pack(2000))  # ...and written again
    assert reader.read()[0] == 2000 and not reader.went_back()
    path.write_bytes(COUNTER.pack(0x01FF_FFFF))  # 0x00FF_FFF8 -> 0x0100_0000 read with the new high half
    torn = reader.read()
    path.write_bytes(COUNTER.pack(2016))
    after = reader.read()
    assert reader.went_back()  # the read after the torn one is lower, not below the count before it
    path.write_bytes(COUNTER.pack(2020))
    assert reader.read()[0] - after[0] == 4 and not reader.went_back()  # counted from there at once
    assert torn[0] > 2000  # (the torn rise itself is in the flagged block)
    reader.close()
    writer.close()


class _WentBack:
    """A job's counter whose count went back during its first shutter (the agent asks twice a
    shutter: to clear the flag before the windows, and after them)."""

    def __init__(self, inner: Counter) -> None:
        self.inner, self.source, self.calls = inner, inner.source, 0

    def read(self) -> tuple[int, int, int]:
        return self.inner.read()

    def went_back(self) -> bool:
        self.calls += 1
        return self.inner.went_back() or self.calls == 2

    def close(self) -> None:
        self.inner.close()


def test_a_block_whose_count_went_back_is_not_sent_but_its_pause_is_credited(
        tmp_path: Path, two_jobs: dict[str, LocalJob]) -> None:
    agent = agent_on(tmp_path, FakeSource(two_jobs, {}), flush=FlushPolicy(max_blocks=1))
    agent.rescan()
    agent.counters["a"] = _WentBack(agent.counters["a"])
    dropped = REGISTRY.get_sample_value("nodeshare_agent_blocks_dropped_total", {"reason": "counter_went_back"}) or 0.0
    assert agent.shutter()  # a's block: its count went back
    assert agent.state["b"].paused_us > 0 and agent.state["a"].blocks == 0  # the pause credited, no block
    assert agent.shutter() and agent.shutter()  # b, then a measured
    assert agent.stats.blocks_dropped == 1 and agent.cycle == 3
    assert REGISTRY.get_sample_value("nodeshare_agent_blocks_dropped_total",
                                     {"reason": "counter_went_back"}) == dropped + 1
    assert (agent.state["a"].blocks, agent.state["a"].last_cycle) == (1, 2)
    assert agent.state["a"].paused_us > 0
    agent.close(0)
    events = spooled(tmp_path)
    assert [(e["job_id"], e["cycle"]) for e in events if e["kind"] == "shutter_batch"] == [("b", [1]), ("a", [2])]
    assert [e["cycle"] for e in events if e["kind"] == "shutter_window"] == [0, 1, 2]  # every pause is said


def test_a_dropped_block_whose_cycle_the_full_spool_refused_is_not_counted(
        tmp_path: Path, two_jobs: dict[str, LocalJob]) -> None:
    agent = agent_on(tmp_path, FakeSource(two_jobs, {}), max_bytes=1, flush=FlushPolicy(max_blocks=1))  # none fits
    agent.rescan()
    agent.counters["a"] = _WentBack(agent.counters["a"])
    assert agent.shutter()  # a's count went back, and the spool refused its window too
    assert agent.stats.blocks_dropped == 0 and agent.cycle == 0  # the cycle never happened as far as anyone knows
    agent.close(0)


def test_the_time_a_job_is_the_nodes_only_job_is_said_in_its_marker(tmp_path: Path,
                                                                    two_jobs: dict[str, LocalJob]) -> None:
    """A node with one job is never shuttered, so that time is undisturbed: the loop credits each
    interval to the node's only job as of the interval's start, and the marker carries the total.
    (Mutation: crediting every job, or the interval after a rescan to the new set, fails here.)"""
    source = FakeSource(dict(two_jobs), {})
    agent = agent_on(tmp_path, source)
    s = 1_000_000_000
    agent.count_alone(0)
    agent.rescan()  # a and b share the node
    agent.count_alone(2 * s)
    del source.jobs["b"]
    agent.rescan()  # b left after 2 s shared: never alone
    agent.count_alone(5 * s)  # 3 s alone for a
    agent.count_alone(5 * s + 500_000)  # and 0.5 ms more
    source.jobs.clear()
    agent.rescan()
    agent.count_alone(9 * s)  # an empty node: nobody to credit
    agent.close(0)
    left = {e["job_id"]: e["alone_us"] for e in spooled(tmp_path) if e["kind"] == "job_left_node"}
    assert left == {"a": 3_000_500, "b": 0}


# ------------------------------------------------------------------ the adaptive shutter schedule (issue 36)
# The lone job's policy picks each shutter's S, the block carries it, and a turn that would exceed a
# co-runner's pause budget passes.


def agent_with(tmp_path: Path, jobs: dict[str, LocalJob], pol: ShutterPolicy) -> Agent:
    options = AgentOptions(node="n1", spool=tmp_path / "spool.db", sample_us=1000, hardware_counters=False,
                           flush=FlushPolicy(max_blocks=100, max_age_s=3600), schedule=pol)
    return Agent(options, FakeSource(jobs, {}), NoBroker, lambda name: name)  # type: ignore[arg-type]


def test_each_shutter_takes_the_s_the_lone_jobs_policy_chose(tmp_path: Path, two_jobs: dict[str, LocalJob]) -> None:
    pol = ShutterPolicy(ladder_us=(1000, 4000), period_ms=0, n_start=2, n_level=1, budget_share=0.5)
    agent = agent_with(tmp_path, two_jobs, pol)
    agent.rescan()
    time.sleep(0.05)  # 0.5 x 50 ms of run: room for a 4 ms pause of each co-runner
    assert agent.shutter() and agent.shutter()  # a then b: the dense start, 1 ms
    # the sleeping jobs retire no instructions, so Alg. 4 rejects their blocks: a is still starting
    assert agent.levels["a"][1000].n == 0 and agent.levels["a"][1000].rejected == 1
    # as if a had two accepted 1 ms blocks: its next shutter probes the longest S
    st = LevelStats()
    st.add(1.0, 1.2, 1.0)
    st.add(1.0, 1.2, 1.0)
    agent.levels["a"][1000] = st
    assert agent.shutter()
    assert agent.levels["a"][4000].rejected == 1
    agent.close(0)
    batches = [e for e in spooled(tmp_path) if e["kind"] == "shutter_batch"]
    # a's batch is cut where S changes (producers.batching): [0] at 1 ms, [2] at 4 ms; b's [1] at 1 ms
    assert sorted((e["job_id"], e["cycle"], e["sample_us"]) for e in batches) == [
        ("a", [0], 1000), ("a", [2], 4000), ("b", [1], 1000)]


def test_a_block_whose_count_went_back_still_counts_as_taken_in_the_schedule(
        tmp_path: Path, two_jobs: dict[str, LocalJob]) -> None:
    """It paused the co-runners as a measured block does: the schedule's fill and tries count it."""
    pol = ShutterPolicy(ladder_us=(1000, 4000), period_ms=0, n_start=2, n_level=1, budget_share=0.5)
    agent = agent_with(tmp_path, two_jobs, pol)
    agent.rescan()
    agent.counters["a"] = _WentBack(agent.counters["a"])
    assert agent.shutter()
    assert agent.stats.blocks_dropped == 1
    st = agent.levels["a"][1000]
    assert (st.n, st.rejected, st.taken) == (0, 1, 1)
    agent.close(0)


def test_a_turn_over_a_co_runners_pause_budget_passes(tmp_path: Path, two_jobs: dict[str, LocalJob]) -> None:
    # a budget of one 1 ms sample (the allowance) and almost nothing per second of run
    pol = ShutterPolicy(ladder_us=(1000,), period_ms=0, budget_share=1e-9)
    agent = agent_with(tmp_path, two_jobs, pol)
    agent.rescan()
    assert agent.shutter()  # a alone: b paused for its one allowed sample (and the freezer's time)
    assert agent.shutter()  # b alone: a not paused yet
    assert agent.state["b"].paused_us >= 1000
    assert not agent.shutter()  # a's turn again: b has no budget left, the turn passes...
    assert agent.stats.skipped_schedule == 1 and agent.lone == "a"
    assert not agent.shutter()  # ...and b's, a being paused as much now
    assert agent.stats.skipped_schedule == 2
    agent.close(0)
