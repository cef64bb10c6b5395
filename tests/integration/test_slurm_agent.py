"""A real Slurm 22.05 (single node, node sharing on), two real jobs that share the node and count
their progress, the node agent shuttering them, the Slurm source publishing their lifecycle, and
the pipeline charging each. Skipped only where Slurm cannot run (not root, or not installed:
deploy/local.sh test installs it from Debian when it can)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from slurm_cluster import (
    accounting_missing,
    lifecycle_source,
    local_slurm,
    missing,
    run_agent_until_idle,
    wait_running,
)

from nodeshare.demo import running_pipeline
from nodeshare.deploy.topics import create_topics
from nodeshare.producers.slurm_hooks import install_hooks
from nodeshare.runtime.config import Settings
from nodeshare.schemas import JobState
from nodeshare.sinks.audit import audit
from nodeshare.sinks.ledger import Ledger

pytestmark = [pytest.mark.integration, pytest.mark.slow,
              pytest.mark.skipif(missing() is not None, reason=str(missing()))]


def test_two_slurm_jobs_sharing_a_node_are_shuttered_and_charged(settings: Settings, tmp_path: Path) -> None:
    hooks = install_hooks(tmp_path / "hooks", tmp_path / "events")
    assert hooks["JobCompLoc"].parent == (tmp_path / "hooks").resolve()
    progress = tmp_path / "progress"
    progress.mkdir()
    create_topics(settings)
    settings = settings.model_copy(update={"standard_units": "tres"})  # the site bills Slurm's billing TRES

    def bill_cpus_thrice(t: Path) -> None:  # the partition bills TRES (issue 42, item 7): billing = 3 x cpu
        conf = t / "etc" / "slurm.conf"
        conf.write_text(conf.read_text().replace("OverSubscribe=FORCE:2",
                                                 'OverSubscribe=FORCE:2 TRESBillingWeights="CPU=3.0"'))
    accounting = accounting_missing() is None  # slurmdbd on MariaDB (deploy/local.sh test installs it)
    with local_slurm(tmp_path / "hooks", bill_cpus_thrice, accounting=accounting) as env:
        job_env = {**env, "NODESHARE_PROGRESS_DIR": str(progress)}
        ids = []
        for kind in ("stream", "compute"):
            submit = subprocess.run(
                ["sbatch", "--parsable", "-n", "1", "-J", kind, "-o", str(tmp_path / f"{kind}.out"),
                 "--wrap", f"{sys.executable} -m nodeshare workload --kind {kind} --seconds 8"],
                env=job_env, capture_output=True, text=True, check=True)
            ids.append(submit.stdout.strip().split(";")[0])
        wait_running(env, ids)  # both at once: the node is shared
        with lifecycle_source(settings, tmp_path / "events", env) as published:
            agent = run_agent_until_idle(env, settings.as_env(), tmp_path / "spool.db", progress)
            # the stream worker starts once the jobs have ended (see SHUTTER): it then reads it all
            with running_pipeline(settings, tmp_path / "run") as pipeline:
                pipeline.wait(charges=2, archived=0, timeout_s=90, report=lambda *_: None)
        # each charge into Slurm's accounting record of the job (issue 42, item 7): sacctmgr modify job,
        # which needs slurmdbd; --print shows the commands
        def export(*args: str) -> subprocess.CompletedProcess[str]:
            return subprocess.run([sys.executable, "-m", "nodeshare", "charges", "export", "--to", "slurm",
                                   "--ledger", str(pipeline.ledger_path), *args],
                                  env={**env, "NODESHARE_CONFIG": ""}, capture_output=True, text=True, timeout=120)
        exported, printed = export(), export("--print")
        sacct = subprocess.run(["sacct", "-n", "-X", "-P", "-j", ",".join(ids), "-o",
                                "JobID,Account,AllocTRES,ElapsedRaw,AdminComment"],
                               env=env, capture_output=True, text=True).stdout if accounting else ""
    print(agent.stdout.strip())
    assert published and published[0] >= 6  # submitted, started and ended for each job
    with Ledger(pipeline.ledger_path, read_only=True) as ledger:
        charges = {c.job_id: c for c in ledger.charges()}
    assert charges.keys() == set(ids)
    for c in charges.values():
        print(f"job {c.job_id} ({c.program}): {c.blocks_used} blocks used, {c.blocks_rejected} rejected, "
              f"degradation {c.degradation:.3f} "
              f"(Alg. 4 {c.degradation_filtered:.3f}, unfiltered {c.degradation_unfiltered:.3f}), "
              f"run {c.run_time_s:.0f} s, paused {c.pause_credit_s:.3f} s")
        assert c.final_state is JobState.ENDED and c.cores == 1 and c.user == "root"
        # the standard price bills Slurm's own billing TRES (3 for 1 CPU here), what sreport counts
        assert (c.partition, c.billing_units, c.billing_weights) == ("debug", 3.0, "slurm")
        assert c.standard_price == pytest.approx(settings.rate_per_core_hour * 3.0 * c.run_time_s / 3600)
        assert c.blocks_used + c.blocks_rejected >= 10
        # slowed, not stopped. Not a tighter bound: on these two loaded cores one job of a run measured
        # 0.962 (process clock, stop 48's CI) and 0.862 (task clock, Alg. 4 accepting 4 of 26 blocks;
        # 2026-11-26) where other runs measure 0.02-0.09; issue 36 holds the finding
        assert 0.0 <= c.degradation < 1.0
        assert 0.0 < c.pause_credit_s < 0.15 * c.run_time_s
    assert {c.program for c in charges.values()} == {"stream", "compute"}
    for i, c in charges.items():
        assert (f"sacctmgr -i modify job where JobID={i} set 'AdminComment=nodeshare:rev=0 charged={c.price:.4f} "
                f"sop={c.standard_price:.4f}") in printed.stdout
        assert "billing_units=3" in printed.stdout
    if not accounting:  # no slurmdbd: sacctmgr's own reason, in one line
        print(f"Slurm accounting not tested: {accounting_missing()}")
        assert exported.returncode == 1 and "not running a supported accounting_storage plugin" in exported.stderr
        return
    assert exported.returncode == 0 and "2 of 2 jobs' charges written" in exported.stdout, exported.stderr
    # Slurm's accounting holds each price, and the standard price is what Slurm's usage counts: its
    # billing TRES x elapsed seconds (sreport -T billing sums these records once rolled up), x L / 3600
    rows = {r.split("|")[0]: r.split("|") for r in sacct.splitlines()}
    print(sacct)
    for i, c in charges.items():
        _, _, tres, elapsed, comment = rows[i]
        assert comment.startswith(f"nodeshare:rev=0 charged={c.price:.4f} sop={c.standard_price:.4f}")
        assert "billing=3" in tres.split(",")
        assert c.standard_price == pytest.approx(settings.rate_per_core_hour * 3 * int(elapsed) / 3600, rel=1e-12)
    assert audit(pipeline.archive_path, pipeline.ledger_path, settings.policy()).ok
    assert not os.listdir(tmp_path / "events")  # every hook file became an acknowledged event
