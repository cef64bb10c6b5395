"""Progress counters behind one interface.

A counter returns two cumulative numbers: work done, and time spent doing it.
* Hardware (``perf_event_open``): instructions and cycles, summed over the job's threads, each
  thread's pair read as one group so the two counts cover the same interval.
* Application: the job increments a 64-bit little-endian counter at offset 0 of a file it shares
  with the agent (``ProgressFile``; an mmap, so incrementing costs no system call), each update
  one aligned 8-byte store (a writer that clears the word and then writes it lets the agent read
  zeros in between; see ``ApplicationCounter.read``). Work is that
  count; time is the CPU time of the job's processes in nanoseconds (wall-clock time when the
  agent knows no process of the job), so a "sample IPC" is units per CPU nanosecond. Like
  cycles, CPU time stands still while the job waits for a processor: a job the OS deschedules
  for a window does not read as slowed by its co-runners (on a machine with fewer cores than
  runnable processes, wall-clock time made that look like a 90% degradation).
  The CPU time is read from the kernel's per-thread task clock (``TaskClock``: a software perf
  event, no PMU needed), exact at the moment it is read. The process CPU clock
  (``clock_gettime`` on another process) is only the fallback: Linux updates a running thread's
  total only at scheduler ticks unless the reader is in the same process, so that clock moves in
  steps of one tick (4 ms at HZ=250). A 3.2 ms shutter window then reads 0 or 4 ms of CPU time and
  the job's rate is noise (measured: degradation 0.96-1.0 for jobs slowed by a few percent).
The estimator only compares a job's rate during a shutter with its rate around it, so both are
valid; every block names the source it used.

The agent runs as root and the progress file is the job's user's: it is opened as a hostile file
(``open_progress``): with the job's user's file access (setfsuid), O_NOFOLLOW (the file itself is
no link), O_NONBLOCK (a FIFO in its place cannot hang the agent), a regular file only, owned by the
job's user (a root-only file hard-linked in is refused), and only its first 8 bytes ever read
(``pread``: a huge file costs nothing, and a file truncated under the agent reads as no count,
which drops that shutter's block, instead of the SIGBUS a mapping would raise).
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import platform
import stat
import struct
import sys
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Protocol

from nodeshare.schemas import CounterSource, IpcSample

COUNTER = struct.Struct("<Q")
_LITTLE = sys.byteorder == "little"
#: Times a count lower than the last one taken is read again at once (ApplicationCounter.read).
REREADS = 3
#: How long a count must stay lower than the last one taken to be the job beginning its count again.
RESET_AFTER_S = 1.0


class Counter(Protocol):
    source: CounterSource

    def read(self) -> tuple[int, int, int]:
        """(work, time, threads): cumulative work and time, and the threads they were summed over."""
        ...

    def went_back(self) -> bool:
        """Whether the work read went back since the last call (application counters; see
        ``ApplicationCounter.read``): the windows read meanwhile are no measurement."""
        ...

    def close(self) -> None: ...


def sample_between(first: tuple[int, int, int], second: tuple[int, int, int]) -> IpcSample:
    """One IpcSample from two readings of a counter (a counter reset or wrap reads as no work)."""
    work = max(second[0] - first[0], 0)
    spent = max(second[1] - first[1], 1)
    return IpcSample(instructions=work, cycles=spent, threads=max(second[2], 1))


class ProgressFile:
    """The job's side of an application counter: ``add(n)`` after each unit of work."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a+b") as f:
            if f.seek(0, os.SEEK_END) < COUNTER.size:  # shorter than a count holds none: begun at 0
                f.truncate(0)
                f.write(b"\0" * COUNTER.size)
        self._file = path.open("r+b")
        self._map = mmap.mmap(self._file.fileno(), COUNTER.size)
        self.value = COUNTER.unpack_from(self._map)[0]
        # One aligned 8-byte store per update. ``struct.pack_into`` is not one: CPython zeroes the
        # target before packing into it, and the agent read those zeros in about 1 of 1,000 reads
        # (for as long as the writer was descheduled between the two), a window of no work followed
        # by one of the job's whole count. A native uint64 view stores the value at once.
        self._word = memoryview(self._map).cast("Q")

    def add(self, n: int = 1) -> None:
        self.value += n
        self._word[0] = self.value if _LITTLE else int.from_bytes(self.value.to_bytes(8, "little"), sys.byteorder)

    def close(self) -> None:
        self._word.release()
        self._map.close()
        self._file.close()


def cpu_clock(pid: int) -> int:
    """The clock id of a process's CPU time, all its threads (what glibc's clock_getcpuclockid
    returns on Linux: the pid, complemented, shifted by 3, with CPUCLOCK_SCHED = 2)."""
    return (~pid << 3) | 2


class ProgressRefused(OSError):
    """The progress file is not one the agent may read (a link, not a regular file, not the job's user's)."""


_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
_LIBC = ctypes.CDLL(None, use_errno=True)


@contextmanager
def _as_user(uid: int, gid: int | None) -> Iterator[None]:
    """File access checked as the job's user in this thread (setfsuid/setfsgid, per thread in
    Linux and glibc; a fsuid other than 0 also drops CAP_DAC_OVERRIDE): a path the user cannot
    open (a root-only device through a linked directory) is not opened at all. A no-op when the
    agent is not root or lacks CAP_SETUID/CAP_SETGID; the checks after the open still hold."""
    if os.geteuid() != 0 or uid == 0:
        yield
        return
    old_gid = _LIBC.setfsgid(gid) if gid is not None else None
    old_uid = _LIBC.setfsuid(uid)
    try:
        yield
    finally:
        _LIBC.setfsuid(old_uid)
        if old_gid is not None:
            _LIBC.setfsgid(old_gid)


def open_progress(path: Path, uid: int, gid: int | None = None) -> int | None:
    """A read-only descriptor of the job's progress file, or None when it does not exist yet or is
    shorter than a counter (the job has not written it yet). Raises ``ProgressRefused`` for a file
    the agent must not read: a symbolic link, one the job's user (``uid``, ``gid``) may not open,
    anything but a regular file, a file whose owner is not ``uid``."""
    try:
        with _as_user(uid, gid):
            found = os.open(path, _FILE_FLAGS)
    except FileNotFoundError:
        return None
    except OSError as e:
        if e.errno in (errno.EMFILE, errno.ENFILE, errno.ENOMEM):
            raise  # the agent's own limits, not the file's fault: tried again at the next rescan
        why = "a symbolic link" if e.errno == errno.ELOOP else e.strerror
        raise ProgressRefused(e.errno or errno.EPERM, f"progress file {path}: {why}") from None
    info = os.fstat(found)
    reason = None
    if not stat.S_ISREG(info.st_mode):
        reason = "not a regular file"
    elif info.st_uid != uid:
        reason = f"owned by uid {info.st_uid}, not by the job's user (uid {uid})"
    elif info.st_size < COUNTER.size:
        os.close(found)
        return None
    if reason is not None:
        os.close(found)
        raise ProgressRefused(errno.EPERM, f"progress file {path}: {reason}")
    return found


class ApplicationCounter:
    """The agent's side of an application counter; time is the CPU time of ``pids`` (see above).
    ``uid`` is the job's user, who must own the file (default: this process's own user)."""

    source = CounterSource.APPLICATION

    def __init__(self, path: Path, pids: Iterable[int] = (), uid: int | None = None, gid: int | None = None) -> None:
        self.path = path
        fd = open_progress(path, os.geteuid() if uid is None else uid, gid)
        if fd is None:
            raise FileNotFoundError(errno.ENOENT, f"progress file {path}: absent or shorter than {COUNTER.size} bytes")
        self._fd = fd
        self._work = 0  # the work reported: never goes back
        self._raw = 0  # the last count taken
        self._before = 0  # the count taken before the last rise
        self._low_since: float | None = None  # when a count lower than ``_raw`` was first read, if one is
        self._went_back = False
        pids = sorted(set(pids))
        self._clock: TaskClock | None = None
        #: why the exact task clock could not be used (None when it is): the agent says so once
        self.coarse_error: OSError | None = None
        if pids:
            try:
                self._clock = TaskClock(pids)
            except OSError as e:
                self.coarse_error = e
        self._cpu_ns = {} if self._clock else {pid: 0 for pid in pids}  # last reading of each process clock
        self._live = [(pid, cpu_clock(pid)) for pid in self._cpu_ns]  # read at every window: kept ready

    def _count(self) -> int | None:
        raw = os.pread(self._fd, COUNTER.size, 0)  # bounded: 8 bytes, whatever the file's size
        return COUNTER.unpack(raw)[0] if len(raw) == COUNTER.size else None

    def read(self) -> tuple[int, int, int]:
        count = self._count()
        # The work is a count that never goes back, and a read that cannot be trusted says so
        # (``went_back``): the agent drops that shutter's block. A writer that clears the word before
        # it writes it (CPython's struct.pack_into does, and ProgressFile used it until 2026-11-26)
        # shows zeros in between, for as long as it is descheduled there; one that truncates the file
        # and writes it again shows no count at all. Taken as read, one such zero made a window of no
        # work and the next a window of the job's whole count, and priced a real job 0.92-0.98
        # degraded (fresh-clone CI, 2026-11-26). So:
        # * a count lower than the last one taken is read again at once (REREADS times);
        # * no count (a file shorter than 8 bytes): the work is held, flagged;
        # * a count still lower, but not below the one before the last rise: that rise was a torn
        #   read (a writer that stores the high half first): flagged, and counted from here;
        # * lower still: the work is held (no work), flagged, until the count is back at or above
        #   the last one taken (nothing lost), or has stayed lower for RESET_AFTER_S: the job began
        #   its count again, and the work goes on from there (what it counted since is credited at
        #   once, in a window that is flagged too).
        for _ in range(REREADS):
            if count is None or count >= self._raw:
                break
            count = self._count()
        if count is None:
            self._went_back = True
        elif count >= self._raw:
            self._work += count - self._raw
            self._before, self._raw, self._low_since = self._raw, count, None
        elif count >= self._before:
            self._went_back = True
            self._raw, self._low_since = count, None
        else:
            self._went_back = True
            now = time.monotonic()
            if self._low_since is None:
                self._low_since = now
            elif now - self._low_since >= RESET_AFTER_S:
                self._work += count
                self._before, self._raw, self._low_since = 0, count, None
        work = self._work
        if self._clock is not None:
            return work, self._clock.read(), 1
        if not self._cpu_ns:
            return work, time.monotonic_ns(), 1
        gone = []
        for pid, clock in self._live:
            try:
                self._cpu_ns[pid] = max(self._cpu_ns[pid], time.clock_gettime_ns(clock))
            except OSError:  # exited: the time it ran stays counted, and its pid is never read again
                gone.append(pid)
        if gone:
            self._live = [(pid, clock) for pid, clock in self._live if pid not in gone]
        return work, sum(self._cpu_ns.values()), 1

    def went_back(self) -> bool:
        """Whether a read since the last call could not be trusted (a count lower than the last
        one taken, or no count): the windows read meanwhile are no measurement. Clears the flag."""
        went, self._went_back = self._went_back, False
        return went

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        if self._clock is not None:
            self._clock.close()
            self._clock = None


# ----------------------------------------------------------------------------- hardware counters

_PERF_EVENT_OPEN = {"x86_64": 298, "aarch64": 241}.get(platform.machine())
_PERF_TYPE_HARDWARE, _PERF_TYPE_SOFTWARE = 0, 1
_HW_CPU_CYCLES, _HW_INSTRUCTIONS = 0, 1
_SW_TASK_CLOCK = 1
_FORMAT_GROUP = 1 << 3
_DISABLED, _INHERIT, _EXCLUDE_KERNEL, _EXCLUDE_HV = 1 << 0, 1 << 1, 1 << 5, 1 << 6
_FLAG_FD_CLOEXEC = 1 << 3
_IOC_ENABLE = 0x2400
_ATTR = struct.Struct("IIQQQQQIIQQ")  # perf_event_attr up to config2 (PERF_ATTR_SIZE_VER1 = 72 bytes)


def _perf_open(config: int, tid: int, group_fd: int, leader: bool, kind: int = _PERF_TYPE_HARDWARE,
               read_format: int = _FORMAT_GROUP, extra: int = 0) -> int:
    if _PERF_EVENT_OPEN is None:
        raise OSError(f"perf_event_open: unsupported machine {platform.machine()}")
    flags = _EXCLUDE_KERNEL | _EXCLUDE_HV | (_DISABLED if leader else 0) | extra
    attr = ctypes.create_string_buffer(_ATTR.pack(kind, _ATTR.size, config, 0, 0, read_format, flags, 0, 0, 0, 0))
    libc = ctypes.CDLL(None, use_errno=True)
    fd = libc.syscall(_PERF_EVENT_OPEN, attr, tid, -1, group_fd, _FLAG_FD_CLOEXEC)
    if fd < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"perf_event_open: {os.strerror(err)}")
    return int(fd)


def _threads(pid: int) -> list[int]:
    """The threads of ``pid`` now (none when it has exited)."""
    try:
        return sorted(int(task.name) for task in Path(f"/proc/{pid}/task").iterdir())
    except FileNotFoundError:
        return []


#: The most threads a job's task clock opens a descriptor for; beyond, the job is timed by the
#: process clock (reading 256 descriptors took 85 us here, against 2.3 us for the process clock).
MAX_TASK_CLOCK_THREADS = 1024


class TaskClock:
    """The CPU time of a job's processes, exact when read: the kernel's task clock of each of
    their threads (a software perf event: no PMU needed, so it works on virtual machines too),
    inherited by every thread and process they start later, so a thread pool made after the
    clock was opened is counted (a later job step that Slurm starts from a new slurmstepd is not:
    the counter is opened once, with the processes the job has then). An exited thread keeps the
    time it ran. ``perf_event_open`` needs the agent's rights over the threads (root with
    CAP_SYS_PTRACE for other users' threads, and CAP_PERFMON where perf_event_paranoid > 1); it
    raises OSError otherwise (also above ``MAX_TASK_CLOCK_THREADS`` threads, or out of
    descriptors), and the caller falls back to the tick-granular process clock.
    Kernel time is counted (the task clock counts all of a task's time on a processor; the
    exclude bits only let an unprivileged agent measure its own user's jobs). It runs on the
    scheduler's local clock: on a virtual machine, time the host stole while a thread was on a
    processor counts, where the process clock (``CLOCK_PROCESS_CPUTIME_ID``) leaves it out; loaded CI
    runs read 2.6-3.0% above the process clock (tests/unit/test_agent.py)."""

    def __init__(self, pids: Iterable[int]) -> None:
        self._fds: list[int] = []
        # each thread once (a pid list holding a thread id would otherwise count its group twice)
        tids = sorted({tid for pid in pids for tid in _threads(pid)})
        if len(tids) > MAX_TASK_CLOCK_THREADS:
            raise OSError(errno.EMFILE, f"task clock: {len(tids)} threads, more than the {MAX_TASK_CLOCK_THREADS} "
                                        "descriptors a job may hold")
        try:
            for tid in tids:
                try:
                    self._fds.append(_perf_open(_SW_TASK_CLOCK, tid, -1, leader=False, kind=_PERF_TYPE_SOFTWARE,
                                                read_format=0, extra=_INHERIT))
                except OSError as e:
                    if e.errno != errno.ESRCH:  # a thread that exited meanwhile has no time to add
                        raise
        except OSError:
            self.close()
            raise
        if not self._fds:
            raise OSError(errno.ESRCH, "task clock: none of the job's threads is left")

    def read(self) -> int:
        return sum(struct.unpack("Q", os.read(fd, 8))[0] for fd in self._fds)

    def close(self) -> None:
        for fd in self._fds:
            os.close(fd)
        self._fds = []


class HardwareCounter:
    """Instructions and cycles of every thread of the job's processes (threads seen at open time)."""

    source = CounterSource.HARDWARE

    def __init__(self, pids: list[int]) -> None:
        import fcntl

        self._leaders: list[int] = []
        self._fds: list[int] = []
        try:
            for pid in pids:
                for task in Path(f"/proc/{pid}/task").iterdir():
                    leader = _perf_open(_HW_INSTRUCTIONS, int(task.name), -1, leader=True)
                    self._fds.append(leader)
                    self._fds.append(_perf_open(_HW_CPU_CYCLES, int(task.name), leader, leader=False))
                    self._leaders.append(leader)
                    fcntl.ioctl(leader, _IOC_ENABLE, 0)
        except OSError:
            self.close()
            raise

    def read(self) -> tuple[int, int, int]:
        instructions = cycles = 0
        for fd in self._leaders:
            _nr, ins, cyc = struct.unpack("QQQ", os.read(fd, 24))
            instructions += ins
            cycles += cyc
        return instructions, cycles, max(len(self._leaders), 1)

    def went_back(self) -> bool:
        return False  # a hardware counter that wraps reads as no work for one window (sample_between)

    def close(self) -> None:
        for fd in self._fds:
            os.close(fd)
        self._fds, self._leaders = [], []


def hardware_counters_unavailable() -> str | None:
    """Why hardware counters cannot be used here (None when they can): tried on this process."""
    try:
        HardwareCounter([os.getpid()]).close()
    except OSError as e:
        return str(e)
    return None
