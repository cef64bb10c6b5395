"""Issue 41: the root agent opens a job's progress file as a hostile file. A symbolic link (to a
root-only file), a FIFO (which hung the agent), a file of another user, a path the job's user
cannot open: refused, logged once, and the job stays on the node, measured without progress. A
huge file costs a bounded read; a file truncated under the agent reads as no work."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from unit.test_agent import FakeSource, agent_on

from nodeshare.producers.agent.jobs import LocalJob
from nodeshare.producers.agent.processes import identity
from nodeshare.producers.agent.progress import COUNTER, ApplicationCounter, ProgressFile, ProgressRefused, open_progress

NOBODY = 65534
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root: the job runs as another user")


@pytest.fixture
def site() -> Iterator[Path]:
    """A directory every user may traverse (pytest's own is its owner's only), as a site's are."""
    base = Path(tempfile.mkdtemp(prefix="nodeshare-site-"))
    base.chmod(0o755)
    yield base
    shutil.rmtree(base)


@pytest.fixture
def user_job(site: Path) -> Iterator[tuple[LocalJob, Path]]:
    """A job of user ``nobody`` (a process running as that user) and its progress directory."""
    home = site / "home"
    home.mkdir()
    os.chown(home, NOBODY, NOBODY)
    proc = subprocess.Popen(["sleep", "60"], user=NOBODY, group=NOBODY)
    try:
        p = identity(proc.pid)
        assert p is not None
        yield LocalJob("j1", frozenset({p}), progress=home / "progress"), home
    finally:
        proc.kill()
        proc.wait()


def root_only_secret(tmp_path: Path) -> Path:
    vault = tmp_path / "vault"
    vault.mkdir(mode=0o700)
    secret = vault / "shadow"
    secret.write_bytes(COUNTER.pack(0x5EC12E7) + b"root only")
    secret.chmod(0o600)
    return secret


def rescan_twice(tmp_path: Path, job: LocalJob, caplog: pytest.LogCaptureFixture) -> tuple[bool, list[str]]:
    """Two rescans of an agent with this one job: whether it got a counter, and the warnings."""
    agent = agent_on(tmp_path, FakeSource({job.job_id: job}, {}))
    try:
        with caplog.at_level(logging.WARNING, logger="nodeshare.agent"):
            agent.rescan()
            agent.rescan()
        assert job.job_id in agent.jobs  # still on the node: paused, charged for its run time
        return job.job_id in agent.counters, [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    finally:
        agent.close()


@as_root
def test_a_link_to_a_root_only_file_is_refused_and_logged_once(tmp_path, site, user_job, caplog):
    job, home = user_job
    (home / "progress").symlink_to(root_only_secret(site))
    os.lchown(home / "progress", NOBODY, NOBODY)
    counted, warnings = rescan_twice(tmp_path, job, caplog)
    assert not counted
    assert len(warnings) == 1 and "symbolic link" in warnings[0], warnings


@as_root
def test_a_linked_directory_the_user_cannot_open_is_not_opened(site, user_job):
    """The open runs with the job's user's file access: a file behind a root-only directory,
    though its own owner is the user, is out of reach as it is for the user."""
    _job, home = user_job
    secret = root_only_secret(site)
    os.chown(secret, NOBODY, NOBODY)  # even a file the user owns, if the user cannot get to it
    (home / "linked").symlink_to(secret.parent)
    with pytest.raises(ProgressRefused, match="Permission denied"):
        open_progress(home / "linked" / "shadow", NOBODY, NOBODY)


def test_a_fifo_does_not_hang_the_agent(tmp_path, caplog):
    """A FIFO in the progress file's place: the open does not wait for a writer (O_NONBLOCK), and
    the file is refused (not a regular file). The rescan runs in a thread with a deadline; a hung
    one is released by opening the FIFO's other end."""
    proc = subprocess.Popen(["sleep", "60"])
    fifo = tmp_path / "progress"
    os.mkfifo(fifo)
    try:
        p = identity(proc.pid)
        assert p is not None
        job = LocalJob("j1", frozenset({p}), progress=fifo)
        result: list[tuple[bool, list[str]]] = []
        worker = threading.Thread(target=lambda: result.append(rescan_twice(tmp_path, job, caplog)), daemon=True)
        worker.start()
        worker.join(timeout=20)
        hung = worker.is_alive()
        if hung:  # release the agent's blocked open, so the test process does not keep a stuck thread
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
            worker.join(timeout=5)
        assert not hung, "the agent hung opening a FIFO"
        counted, warnings = result[0]
        assert not counted and len(warnings) == 1 and "not a regular file" in warnings[0], warnings
    finally:
        proc.kill()
        proc.wait()


def test_a_file_of_another_user_is_refused(tmp_path, caplog):
    proc = subprocess.Popen(["sleep", "60"])  # the job runs as this test's user
    try:
        p = identity(proc.pid)
        assert p is not None
        ProgressFile(tmp_path / "progress").close()
        if os.geteuid() == 0:
            os.chown(tmp_path / "progress", NOBODY, NOBODY)
            job_uid = 0
        else:  # not root: the file is ours, and the job is said to be another user's
            job_uid = os.geteuid() + 1
        with pytest.raises(ProgressRefused, match="owned by uid"):
            ApplicationCounter(tmp_path / "progress", [proc.pid], uid=job_uid)
        if os.geteuid() == 0:
            counted, warnings = rescan_twice(tmp_path, LocalJob("j1", frozenset({p}), progress=tmp_path / "progress"),
                                             caplog)
            assert not counted and len(warnings) == 1 and "owned by uid" in warnings[0], warnings
    finally:
        proc.kill()
        proc.wait()


def test_a_huge_file_costs_a_bounded_read_and_truncation_reads_as_no_work(tmp_path):
    huge = tmp_path / "progress"
    with huge.open("wb") as f:
        f.write(COUNTER.pack(1234))
        f.truncate(2**40)  # 1 TiB, sparse
    counter = ApplicationCounter(huge)
    assert counter.read()[0] == 1234
    os.truncate(huge, 0)  # the job truncates it under the agent: no SIGBUS, the last count stays
    assert counter.read()[0] == 1234
    huge.write_bytes(COUNTER.pack(1300))
    assert counter.read()[0] == 1300
    counter.close()


def test_a_file_not_yet_written_is_tried_again_silently(tmp_path, caplog):
    proc = subprocess.Popen(["sleep", "60"])
    try:
        p = identity(proc.pid)
        assert p is not None
        job = LocalJob("j1", frozenset({p}), progress=tmp_path / "progress")
        (tmp_path / "progress").write_bytes(b"\0\0")  # shorter than a counter
        counted, warnings = rescan_twice(tmp_path, job, caplog)
        assert not counted and warnings == []
        assert open_progress(tmp_path / "absent", os.geteuid()) is None
    finally:
        proc.kill()
        proc.wait()
