"""LLC ways and memory bandwidth per job through Linux resctrl (Intel RDT: CAT and MBA), always
given back.

Where the kernel offers resctrl (mounted at ``/sys/fs/resctrl``), each job placed with a cache
share gets a group ``nodeshare-<job>`` whose ``schemata`` holds its way mask (``L3:<id>=<mask>``
per cache domain) and MBA percentage (``MB:<id>=<percent>``), and whose ``tasks`` holds its
processes (one PID per write, as the kernel takes them). Removing the group gives its processes
back to the default group, i.e. the whole cache: that is the restore. The groups this agent made
are said to the watchdog before they exist, so they are removed on every exit path, by the
watchdog if the agent is killed, and at the next start (every ``nodeshare-*`` group left).

The kernel's rules for a mask are read from ``info/L3``: ``cbm_mask`` (the ways) and
``min_cbm_bits`` (the fewest ways a mask may hold; 1 when the file is absent). Processes without a
share live in the default group (the mount's root): ``set_default`` narrows its ``L3`` line to the
ways no job booked, so they stay out of the jobs' ways, and ``remove_all`` writes back the line it
had when the agent started (every exit path the agent runs; after a SIGKILL, the next start finds
the groups the dead run left and gives the default group every way again).

Outside a resctrl mount (a test tree with the kernel's layout) a directory cannot be removed
with files in it, so the files the kernel would drop with the group go first.
"""

from __future__ import annotations

import errno
import logging
import os
import re
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the watchdog imports this module: it stays free of the schemas and numpy
    from nodeshare.streams.core.placement.resctrl import Setting

log = logging.getLogger(__name__)

RESCTRL = Path("/sys/fs/resctrl")
PREFIX = "nodeshare-"


class ResctrlUnavailable(RuntimeError):
    """The kernel offers no resctrl here (or not the part needed); the message says what is missing."""


def _resctrl_mounts() -> list[Path]:
    try:
        lines = Path("/proc/self/mounts").read_text().splitlines()
    except OSError:
        return []
    return [Path(f[1]) for f in (line.split() for line in lines) if len(f) > 2 and f[2] == "resctrl"]


def remove_group(path: Path) -> bool:
    """Remove one resctrl group; False when it could not be (logged). A group already gone is removed."""
    try:
        os.rmdir(path)
        return True
    except FileNotFoundError:
        return True
    except OSError as exc:
        on_mount = any(m == path or m in path.parents for m in _resctrl_mounts())
        if exc.errno != errno.ENOTEMPTY or on_mount:
            log.error("could not remove resctrl group %s: %s", path, exc)
            return False
    for f in path.iterdir():  # a plain directory standing for a group: drop what the kernel would
        f.unlink()
    os.rmdir(path)
    return True


def _ids(line: str) -> list[int]:
    return [int(part.split("=")[0]) for part in line.split(":", 1)[1].split(";") if "=" in part]


class Resctrl:
    """Writes per-job groups under ``root``; ``on_groups`` hears of every group before it is made."""

    def __init__(self, root: Path = RESCTRL, on_groups: Callable[[list[str]], None] | None = None) -> None:
        self.root = root
        self.on_groups = on_groups
        schemata = root / "schemata"
        mask = root / "info" / "L3" / "cbm_mask"
        if not schemata.exists() or not mask.exists():
            raise ResctrlUnavailable(f"no resctrl with L3 CAT at {root} (mount -t resctrl resctrl {root}, on a "
                                     "processor with RDT)")
        lines = schemata.read_text().split()
        self.cache_ids = next((_ids(line) for line in lines if line.startswith("L3:")), [])
        self.mb_ids = next((_ids(line) for line in lines if line.startswith("MB:")), [])
        self.total_ways = int(mask.read_text().strip(), 16).bit_length()
        min_bits = root / "info" / "L3" / "min_cbm_bits"
        self.min_bits = int(min_bits.read_text().strip()) if min_bits.exists() else 1
        left = any(p.is_dir() for p in root.glob(PREFIX + "*"))  # a dead run's groups: it narrowed the default
        l3 = next((line for line in lines if line.startswith("L3:")), "")
        whole = "L3:" + ";".join(f"{i}={(1 << self.total_ways) - 1:x}" for i in self.cache_ids)
        self.default_l3 = whole if left else l3  # the default group's line to write back at exit
        self.default_mask: int | None = None  # what set_default wrote last (None: the line above)
        self.default_narrowed = left  # the default line differs from default_l3 (set_default wrote it)
        self.groups: dict[str, Path] = {}
        self.settings: dict[str, Setting] = {}
        self.members: dict[str, set[int]] = {}  # PIDs written to each group (their children join by fork)

    def group(self, job_id: str) -> Path:
        return self.root / (PREFIX + re.sub(r"[^\w.-]", "_", job_id))

    def _tell(self) -> None:
        if self.on_groups is not None:
            self.on_groups(sorted(str(p) for p in self.groups.values()))

    def apply(self, job_id: str, setting: Setting, pids: Iterable[int]) -> None:
        """Give ``job_id``'s processes ``setting``: its group made (said first), schemata written
        when it changed, every PID not yet written added (a process gone meanwhile is skipped). The
        agent calls this at every rescan: a job whose processes did not change costs no file I/O."""
        path = self.group(job_id)
        if job_id not in self.groups:
            self.groups[job_id] = path
            self._tell()
            path.mkdir(exist_ok=True)
        if self.settings.get(job_id) != setting:
            (path / "schemata").write_text(setting.schemata(self.cache_ids, self.mb_ids))
            self.settings[job_id] = setting
        written = self.members.setdefault(job_id, set())
        for pid in sorted(set(pids) - written):
            try:
                with (path / "tasks").open("a") as f:
                    f.write(f"{pid}\n")
            except ProcessLookupError:
                pass
            written.add(pid)  # written or gone: either way not again

    def remove(self, job_id: str) -> None:
        path = self.groups.get(job_id)
        if path is not None and remove_group(path):
            del self.groups[job_id]
            self.settings.pop(job_id, None)
            self.members.pop(job_id, None)
            self._tell()

    def jobs(self) -> list[str]:
        return sorted(self.groups)

    def set_default(self, mask: int) -> None:
        """Narrow the default group to ``mask`` on every cache domain (written only when it changed)."""
        if mask != self.default_mask:
            (self.root / "schemata").write_text("L3:" + ";".join(f"{i}={mask:x}" for i in self.cache_ids) + "\n")
            self.default_mask = mask
            self.default_narrowed = True

    def restore_default(self) -> bool:
        """The default group's ways as they were at start; False when the kernel refused (logged)."""
        try:
            (self.root / "schemata").write_text(self.default_l3 + "\n")
        except OSError as exc:
            log.error("could not give the default resctrl group its ways back (%s): %s", self.default_l3, exc)
            return False
        self.default_mask = None
        self.default_narrowed = False
        return True

    def remove_all(self) -> int:
        """Every group this agent made, and any ``nodeshare-*`` group a dead run left; how many."""
        if self.default_narrowed and self.default_l3:
            self.restore_default()  # first: the processes of the groups removed below get every way
        paths = set(self.groups.values()) | {p for p in self.root.glob(PREFIX + "*") if p.is_dir()}
        removed = sum(remove_group(p) for p in sorted(paths))
        self.groups = {j: p for j, p in self.groups.items() if p.exists()}
        self.settings = {j: s for j, s in self.settings.items() if j in self.groups}
        self.members = {j: m for j, m in self.members.items() if j in self.groups}
        self._tell()
        return removed
