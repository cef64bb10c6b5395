"""Replay a demo run's archive into fresh topics under a new worker and sinks (integration tests)."""

from __future__ import annotations

import uuid
from pathlib import Path

from nodeshare.demo import DemoResult, running_pipeline
from nodeshare.producers.replay import replay
from nodeshare.schemas import Charge
from nodeshare.sinks.ledger import Ledger


def replayed_ledger(run: DemoResult, workdir: Path, prefix: str = "r") -> dict[tuple[str, int], Charge]:
    """Every charge the replayed archive yields, by (job, revision), under the run's settings (its
    site secret included) on topics and groups of their own."""
    tag = uuid.uuid4().hex[:8]
    fresh = run.settings.model_copy(update={"topic_prefix": f"{prefix}{tag}.", "app_id": f"nodeshare-{prefix}{tag}"})
    with running_pipeline(fresh, workdir) as pipeline:
        report = replay(run.archive, fresh)
        assert report.events == run.events_archived
        pipeline.wait(len(run.charges), report.events, 120, lambda *_: None)
    with Ledger(pipeline.ledger_path, read_only=True) as rebuilt:
        return {(c.job_id, c.revision): c for c in rebuilt.charges()}
