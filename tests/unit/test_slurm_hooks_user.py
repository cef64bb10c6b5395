"""Issue 41: the Slurm hooks under a non-root SlurmUser. `install-hooks --owner USER` makes the
events directory the user's (group: the Slurm source's), so an event lands; a hook that cannot
write its event says why (syslog through `logger`, a log file, stderr) instead of exiting 0 in
silence. The hooks run here as a real non-root user (Debian's `slurm`, else `nobody`)."""

from __future__ import annotations

import grp
import os
import pwd
import shutil
import stat
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from nodeshare.cli import app
from nodeshare.producers.slurm import read_hook_file
from nodeshare.producers.slurm_hooks import install_hooks

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a hook as another user")


def slurm_user() -> pwd.struct_passwd:
    for name in ("slurm", "nobody"):
        try:
            return pwd.getpwnam(name)
        except KeyError:
            continue
    pytest.skip("no non-root user to run the hooks as")


@pytest.fixture
def site() -> Iterator[Path]:
    """A tree a non-root user can traverse (pytest's is root's only), with a `logger` that records."""
    base = Path(tempfile.mkdtemp(prefix="nodeshare-slurm-"))
    base.chmod(0o755)
    (base / "bin").mkdir()
    fake = base / "bin" / "logger"
    fake.write_text(f'#!/bin/sh\nprintf "%s\\n" "$*" >> {base}/syslog\n')
    fake.chmod(0o755)
    (base / "syslog").touch()
    (base / "syslog").chmod(0o666)
    yield base
    shutil.rmtree(base)


def run_hook(hook: Path, user: pwd.struct_passwd, site: Path, job: str = "42") -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(hook)], user=user.pw_uid, group=user.pw_gid, extra_groups=[], cwd=site,
                          env={"PATH": f"{site}/bin:/usr/bin:/bin", "SLURM_JOB_ID": job}, capture_output=True,
                          text=True, timeout=30)


def test_with_owner_the_event_of_a_non_root_slurm_user_lands(site):
    user = slurm_user()
    lines = install_hooks(site / "hooks", site / "spool" / "events", owner=user.pw_name)
    events = site / "spool" / "events"
    st = events.stat()
    assert st.st_uid == user.pw_uid and stat.S_IMODE(st.st_mode) == 0o2770
    done = run_hook(lines["PrologSlurmctld"], user, site)
    assert done.returncode == 0 and done.stderr == ""
    [written] = [p for p in events.iterdir() if not p.name.startswith(".")]
    assert read_hook_file(written).env["SLURM_JOB_ID"] == "42"
    fst = written.stat()
    assert stat.S_IMODE(fst.st_mode) == 0o640 and fst.st_gid == st.st_gid  # the source's group reads it
    assert (site / "syslog").read_text() == ""


def test_a_hook_that_cannot_write_its_event_logs_why(site):
    """The issue's case: events directory root's 0755, hooks as SlurmUser: Permission denied."""
    user = slurm_user()
    lines = install_hooks(site / "hooks", site / "spool" / "events")  # no --owner: root's directory
    done = run_hook(lines["PrologSlurmctld"], user, site)
    assert done.returncode == 0  # a failing PrologSlurmctld would hold the job
    assert not [p for p in (site / "spool" / "events").iterdir()]
    said = (site / "syslog").read_text()
    assert "-t nodeshare-slurm-hook" in said and "job 42 is lost" in said and "Permission denied" in said, said
    assert f"running as {user.pw_name}" in said
    assert "job 42 is lost" in done.stderr


def test_the_hooks_log_file_gets_the_failure_when_syslog_does_not(site):
    user = slurm_user()
    lines = install_hooks(site / "hooks", site / "spool" / "events", owner=user.pw_name)
    (site / "bin" / "logger").write_text("#!/bin/sh\nexit 1\n")  # no syslog daemon
    (site / "spool" / "events").chmod(0o500)  # say, a full or broken file system
    done = run_hook(lines["JobCompLoc"], user, site, job="43")
    assert done.returncode == 0
    log = (site / "spool" / "slurm-hooks.log").read_text()
    assert "jobcomp hook: the event of job 43 is lost" in log, log


def test_install_hooks_owner_on_the_command_line(site):
    user = slurm_user()
    result = CliRunner().invoke(app, ["slurm", "install-hooks", "--hooks-dir", str(site / "hooks"),
                                      "--events-dir", str(site / "ev"), "--owner", user.pw_name])
    assert result.exit_code == 0, result.output
    assert (site / "ev").stat().st_uid == user.pw_uid
    assert (site / "slurm-hooks.log").stat().st_uid == user.pw_uid
    groups = {g.gr_gid for g in grp.getgrall()} | {user.pw_gid}
    assert (site / "ev").stat().st_gid in groups
    bad = CliRunner().invoke(app, ["slurm", "install-hooks", "--hooks-dir", str(site / "hooks"),
                                   "--events-dir", str(site / "ev"), "--owner", "no-such-user-41"])
    assert bad.exit_code == 2 and "no user" in bad.output
