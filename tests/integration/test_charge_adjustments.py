"""Issue 42, item 5 on a real broker: `nodeshare charges void|adjust|restore` publishes the
operator's request on jobs.lifecycle, the real worker prices it as the job's next revision, the
ledger chains it and the archive keeps it, so the audit recomputes every revision."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from factories import block, job_event, left

from nodeshare.demo import running_pipeline
from nodeshare.producers.kafka_producer import EventProducer
from nodeshare.runtime.config import Settings
from nodeshare.schemas import JobState
from nodeshare.sinks.audit import audit
from nodeshare.sinks.ledger import Ledger

pytestmark = pytest.mark.integration


def test_an_operator_voids_adjusts_and_restores_a_charge_through_the_pipeline(settings: Settings,
                                                                              tmp_path: Path) -> None:
    job = "adjusted-1"
    records = [block(1.0, 2.0, 1.0, job=job, cycle=0), block(0.8, 1.0, 0.82, job=job, cycle=1), left(job, "n1", 2, 1),
               job_event(job, JobState.STARTED), job_event(job, JobState.ENDED)]
    env = {**os.environ, "NODESHARE_CONFIG": "", **settings.as_env()}
    with running_pipeline(settings, tmp_path / "run") as pipeline:
        with EventProducer(settings, client_id="test-adjustments") as producer:
            producer.send_all(records)
            producer.flush(30)
        pipeline.wait(charges=1, archived=len(records), timeout_s=90, report=lambda *_: None)

        def charges(*args: str) -> subprocess.CompletedProcess[str]:
            return subprocess.run([sys.executable, "-m", "nodeshare", "charges", *args,
                                   "--ledger", str(pipeline.ledger_path)],
                                  env=env, capture_output=True, text=True, timeout=90)

        unknown = charges("void", "no-such-job", "--reason", "typo")
        assert unknown.returncode == 2 and "has no charge in" in unknown.stderr
        nothing = charges("restore", job, "--reason", "nothing to undo")
        assert nothing.returncode == 2 and "has no adjustment to restore" in nothing.stderr

        void = charges("void", job, "--reason", "node n1 had a faulty DIMM")
        assert void.returncode == 0, void.stderr
        assert re.search(r"void published at jobs\.lifecycle:\d+:2 by ", void.stdout), void.stdout
        pipeline.wait(charges=2, archived=len(records) + 1, timeout_s=90, report=lambda *_: None)
        again = charges("void", job, "--reason", "said twice")
        assert again.returncode == 2 and "is already voided" in again.stderr
        adjust = charges("adjust", job, "--price", "0.25", "--reason", "half of the run was lost")
        assert adjust.returncode == 0, adjust.stderr
        pipeline.wait(charges=3, archived=len(records) + 2, timeout_s=90, report=lambda *_: None)
        restore = charges("restore", job, "--reason", "the DIMM was fine")
        assert restore.returncode == 0, restore.stderr
        pipeline.wait(charges=4, archived=len(records) + 3, timeout_s=90, report=lambda *_: None)
        listed = charges("-j", job, "-o", "Revision,Charged,Adjustment,Credit,RevisionReason", "-P")
        assert listed.returncode == 0, listed.stderr
    with Ledger(pipeline.ledger_path, read_only=True) as ledger:
        plain, void_row, adjusted, restored = sorted(ledger.charges(), key=lambda c: c.revision)
        assert ledger.verify_chain().ok
    assert plain.price > 0.25 and void_row.price == 0.0 and adjusted.price == 0.25 and restored.price == plain.price
    assert void_row.adjustment is not None and void_row.adjustment.reason == "node n1 had a faulty DIMM"
    assert void_row.revision_reason.startswith("voided by ")
    lines = listed.stdout.splitlines()
    assert lines[0] == "Revision|Charged|Adjustment|Credit|RevisionReason"
    assert lines[2].startswith("1|0.0000|void|") and lines[3].startswith("2|0.2500|adjust|")
    report = audit(pipeline.archive_path, pipeline.ledger_path, settings.policy())
    assert report.ok and report.matches == 4, report.as_dict()
