"""Issue 41: the shipped `deploy/slurm/job_submit.lua` on a real Slurm (Debian's 22.05): every job
is held at submission for nodeshare's placement adapter (JobHeldUser, the hold the adapter
releases), and a job in the bypass QOS is scheduled by Slurm as usual."""

from __future__ import annotations

import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest
from slurm_cluster import local_slurm, missing

pytestmark = [pytest.mark.slow, pytest.mark.skipif(missing() is not None, reason=str(missing()))]

LUA = Path(__file__).parents[2] / "deploy" / "slurm" / "job_submit.lua"


def with_job_submit_lua(t: Path) -> None:
    conf = t / "etc" / "slurm.conf"
    text = conf.read_text()
    # ports of its own: another test's Slurm may run on this machine meanwhile
    text = text.replace("SlurmctldPort=16817", "SlurmctldPort=16917").replace("SlurmdPort=16818", "SlurmdPort=16918")
    conf.write_text(text + "JobSubmitPlugins=lua\n")
    shutil.copy(LUA, t / "etc" / "job_submit.lua")


def job(env: dict[str, str], jid: str) -> dict[str, str]:
    out = subprocess.run(["scontrol", "show", "job", jid], env=env, capture_output=True, text=True, check=True).stdout
    return dict(re.findall(r"(\w+)=(\S*)", out))


def wait_for(env: dict[str, str], jid: str, key: str, values: set[str], timeout_s: float = 30) -> dict[str, str]:
    deadline = time.monotonic() + timeout_s
    while True:
        found = job(env, jid)
        if found.get(key) in values or time.monotonic() > deadline:
            return found
        time.sleep(0.2)


def test_job_submit_lua_holds_every_job_but_the_bypass_qos():
    with local_slurm(setup=with_job_submit_lua) as env:
        def sbatch(*args: str) -> str:
            done = subprocess.run(["sbatch", "--parsable", *args, "--wrap", "sleep 2"], env=env, capture_output=True,
                                  text=True)
            assert done.returncode == 0, done.stderr
            return done.stdout.strip().split(";")[0]

        held = sbatch("-J", "placed-by-nodeshare")
        bypass = sbatch("-J", "urgent", "--qos=nodeshare-bypass")
        assert wait_for(env, bypass, "JobState", {"RUNNING", "COMPLETED"})["JobState"] in {"RUNNING", "COMPLETED"}
        first = job(env, held)
        assert first["JobState"] == "PENDING" and first["Reason"] == "JobHeldUser" and first["Priority"] == "0"
        subprocess.run(["scontrol", "release", held], env=env, check=True)  # what the adapter does
        assert wait_for(env, held, "JobState", {"RUNNING", "COMPLETED"})["JobState"] in {"RUNNING", "COMPLETED"}
        for jid in (held, bypass):
            subprocess.run(["scancel", jid], env=env, capture_output=True)
