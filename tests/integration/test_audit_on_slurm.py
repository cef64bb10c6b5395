"""The audit on a Dask cluster whose workers are Slurm jobs (dask-jobqueue's SLURMCluster, the
recipe of docs/audit.md) on the real Slurm 22.05 the suite starts: two worker jobs run on the
node, and the report equals the single process's, field by field. Skipped only where Slurm cannot
run (see slurm_cluster.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from factories import POLICY, build
from slurm_cluster import local_slurm, missing

from nodeshare.sinks.archive import ParquetArchive
from nodeshare.sinks.audit import audit
from nodeshare.sinks.fast_audit import plan_chunks

pytestmark = [pytest.mark.integration, pytest.mark.slow,
              pytest.mark.skipif(missing() is not None, reason=str(missing()))]


def test_dask_workers_started_as_slurm_jobs_audit_as_one_process(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    from dask_jobqueue import SLURMCluster
    from distributed import Client

    archive, ledger, n = build(tmp_path, partitions=4, jobs=16)
    single = audit(archive, ledger, POLICY)
    with local_slurm() as env:
        monkeypatch.setenv("SLURM_CONF", env["SLURM_CONF"])  # sbatch, squeue and scancel find this Slurm
        with SLURMCluster(cores=1, processes=1, memory="450MB", walltime="00:10:00", queue="debug",
                          python=sys.executable, log_directory=str(tmp_path / "worker-logs"),
                          scheduler_options={"dashboard_address": ":0"}) as cluster:
            cluster.scale(jobs=2)
            with Client(cluster) as client:
                client.wait_for_workers(2, timeout=120)
                jobs = subprocess.run(["squeue", "-h", "-o", "%j %T"], env=env, capture_output=True, text=True,
                                      check=True).stdout.split("\n")
                assert sum(line.endswith("RUNNING") for line in jobs) == 2, jobs  # the workers are Slurm jobs
                calls: list[tuple[int, int, int]] = []
                spread = audit(archive, ledger, POLICY, client=client, progress=lambda *a: calls.append(a))
    assert spread.as_dict() == single.as_dict() and single.ok and single.charges_checked == n
    # two chunks per worker slot (as many as the archive's row groups allow), each reported done once
    tasks = len(plan_chunks(ParquetArchive(archive), 4))
    assert tasks > 1 and [(d, t) for d, t, _ in calls] == [(i + 1, tasks) for i in range(tasks)]
