"""The local demo: the whole pipeline on one machine, from simulated nodes to an audited ledger."""

from __future__ import annotations

import shutil
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

import pyarrow as pa
import pyarrow.parquet as pq

from nodeshare.deploy.broker import broker_for
from nodeshare.deploy.processes import start_worker, stop_process
from nodeshare.deploy.topics import create_topics
from nodeshare.producers.kafka_producer import EventProducer
from nodeshare.producers.simulator import JobTruth
from nodeshare.runtime.config import Settings
from nodeshare.runtime.consumer import run_in_thread
from nodeshare.schemas import Charge, Record, ShutterWindow
from nodeshare.schemas.catalog import NODE_SHUTTER
from nodeshare.sinks.archive import ArchiveSink
from nodeshare.sinks.audit import AuditReport, audit
from nodeshare.sinks.ledger import Ledger, LedgerSink
from nodeshare.streams.worker.cursor import unconsumed, worker_groups

Progress = Callable[[str, int, int], None]  # (stage, done, total)


def complaints(log_path: Path, last: int = 3) -> str:
    """The last ``last`` warnings and errors of a log, for a message that names the log: whoever
    reads the message (a CI run's report) may not have the file."""
    try:
        lines = log_path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    said = [line.strip() for line in lines if "WARNING" in line or "ERROR" in line][-last:]
    return "".join(f"\n  {line[:300]}" for line in said)


class DemoError(RuntimeError):
    pass


Send = Callable[[list[Record]], None]


#: A simulated cluster for the pipeline: it hands its events to ``send`` (in batches, in
#: event-time order per key) as it makes them, reports progress, and returns the ground truth
#: of the jobs that ended. See :func:`from_events` and :func:`nodeshare.scenarios.source`.
Source = Callable[[Send, Progress], list[JobTruth]]


class Scenario(Protocol):
    """A whole simulated run in memory (both simulators' ``Simulation`` fit)."""

    events: list[Record]
    truth: list[JobTruth]


def from_events(sim: Scenario, every: int = 500) -> Source:
    """A source that publishes a finished simulation's events."""
    def run(send: Send, report: Progress) -> list[JobTruth]:
        total = len(sim.events)
        for i in range(0, total, every):
            send(sim.events[i:i + every])
            report("publishing events", min(total, i + every), total)
        return sim.truth
    return run


@dataclass
class DemoResult:
    settings: Settings  # as the run used them (bootstrap, topic prefix, app id)
    bootstrap: str
    broker: str
    events_published: int
    events_archived: int
    jobs_ended: int
    charges: list[Charge]
    audit: AuditReport
    ledger: Path
    archive: Path
    truth: Path | None
    elapsed_s: float

    def as_dict(self) -> dict[str, Any]:
        return {
            "bootstrap": self.bootstrap,
            "broker": self.broker,
            "events_published": self.events_published,
            "events_archived": self.events_archived,
            "jobs_ended": self.jobs_ended,
            "charges": len(self.charges),
            "audit_mismatches": len(self.audit.mismatches) + len(self.audit.missing_in_ledger),
            "audit": self.audit.as_dict(),
            "total_standard_price": sum(c.standard_price for c in self.charges),
            "total_price": sum(c.price for c in self.charges),
            "total_dividend": sum(c.dividend for c in self.charges),
            "ledger": str(self.ledger),
            "archive": str(self.archive),
            "truth": str(self.truth) if self.truth else None,
            "elapsed_s": round(self.elapsed_s, 2),
        }


def write_truth(truth: list[JobTruth], path: Path) -> None:
    """Ground truth goes to its own file; nothing on the pricing path reads it."""
    rows = [asdict(t) for t in truth]
    table = pa.Table.from_pylist([{**r, "nodes": list(r["nodes"])} for r in rows])
    pq.write_table(table, path)


class Pipeline:
    """A stream worker and both sinks running against one broker (see ``running_pipeline``)."""

    def __init__(self, settings: Settings, out: Path) -> None:
        self.settings = settings
        self.out = out
        self.ledger_path, self.archive_path = out / "ledger.duckdb", out / "archive"
        self.worker = start_worker(settings, out / "worker", out / "worker.log")
        self.stop = threading.Event()
        self.dead_letters = EventProducer(settings, client_id="nodeshare-ledger-dlq")
        self.ledger_sink = LedgerSink(settings, self.ledger_path, dead_letters=self.dead_letters)
        self.archive_sink = ArchiveSink(settings, self.archive_path)
        self.threads = [run_in_thread(self.ledger_sink, self.stop, "ledger-sink"),
                        run_in_thread(self.archive_sink, self.stop, "archive-sink")]

    def wait_for_decisions(self, timeout_s: float, report: Progress) -> None:
        """Until the worker has handled everything it reads, the decision makers' logs included:
        charges complete before the power and placement managers have folded their last records,
        and stopping the worker then would leave decisions unmade. Two checks in a row, since a
        handled record may still produce one (a final estimate routed to the placement log)."""
        groups = worker_groups(self.settings)
        deadline = time.monotonic() + timeout_s
        quiet = 0
        while quiet < 2:
            left = unconsumed(self.settings, groups)
            report("waiting for decisions", 0 if left else 1, 1)
            quiet = quiet + 1 if left == 0 else 0
            if quiet < 2 and time.monotonic() > deadline:
                raise DemoError(f"the stream worker still had {left} messages to handle after {timeout_s:.0f} s; "
                                f"see {self.out / 'worker.log'}")

    def wait(self, charges: int, archived: int, timeout_s: float, report: Progress, windows: int = 0) -> None:
        """Until the ledger holds ``charges`` rows and has read ``windows`` shutter windows for its
        co-runner counts, and the archive holds ``archived`` events, or fail."""
        deadline = time.monotonic() + timeout_s
        while True:
            report("waiting for charges", self.ledger_sink.rows_inserted, charges)
            if (self.ledger_sink.rows_inserted >= charges and self.archive_sink.messages_written >= archived
                    and self.ledger_sink.shutter_messages >= windows):
                return
            if self.worker.poll() is not None:
                log = self.out / "worker.log"
                raise DemoError(f"the stream worker exited with {self.worker.returncode}; see {log}")
            for t in self.threads:
                if t.errors:
                    raise DemoError(f"{t.name} failed: {t.errors[0]}")
            if time.monotonic() > deadline:
                raise DemoError(
                    f"timed out after {timeout_s:.0f} s with {self.ledger_sink.rows_inserted}/{charges} charges and "
                    f"{self.archive_sink.messages_written}/{archived} events archived; see {self.out / 'worker.log'}"
                    + complaints(self.out / "worker.log"))
            time.sleep(0.2)

    def close(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(30)
        stop_process(self.worker)
        self.dead_letters.close()


@contextmanager
def running_pipeline(settings: Settings, out: Path) -> Iterator[Pipeline]:
    """Create the topics, start a stream worker and both sinks writing under ``out``; stop them on exit."""
    create_topics(settings)
    pipeline = Pipeline(settings, out)
    try:
        yield pipeline
    finally:
        pipeline.close()


def clean_outputs(out: Path) -> None:
    """Remove what an earlier run left in ``out`` (the demo owns that directory)."""
    for stale in (out / "ledger.duckdb", out / "ledger.duckdb.wal", out / "archive", out / "worker",
                  out / "truth.parquet"):
        if stale.is_dir():
            shutil.rmtree(stale)
        elif stale.exists():
            stale.unlink()
    out.mkdir(parents=True, exist_ok=True)


def run_demo(settings: Settings, source: Source, out: Path, *, timeout_s: float = 180.0,
             progress: Progress | None = None, truth: bool = True,
             extra_inputs: Sequence[tuple[str, bytes | None, bytes | None]
                                    | tuple[str, bytes | None, bytes | None, bytes | None]] = ()) -> DemoResult:
    """Run the pipeline on a simulated cluster's events and audit the result.

    The source publishes while the worker and sinks already run, so a long simulation is never
    held in memory. The ground truth goes to ``out/truth.parquet`` for experiments
    (``truth=False``: nowhere; the charges do not change, which a test checks). ``extra_inputs``
    are raw (catalog topic, key, value[, auth]) messages published before the simulation, e.g.
    malformed bytes that must end in the dead-letter topic; an ``auth`` is sent as the signature
    header (b"": none) instead of the producer's own (``schemas.signing``).
    """
    report = progress or (lambda stage, done, total: None)
    t0 = time.monotonic()
    out = out.resolve()
    clean_outputs(out)
    external = settings.bootstrap is not None

    with broker_for(settings.bootstrap, out) as bootstrap:
        run_id = f"demo-{int(time.time())}"
        s = settings.model_copy(update={
            "bootstrap": bootstrap,
            # On a shared broker a run gets topics and groups of its own; the bundled one is fresh anyway.
            "topic_prefix": f"{settings.topic_prefix}{run_id}." if external else settings.topic_prefix,
            "app_id": f"{settings.app_id}-{run_id}" if external else settings.app_id,
        })
        with running_pipeline(s, out) as pipeline:
            with EventProducer(s, client_id="nodeshare-simulator") as producer:
                for topic, key, value, *auth in extra_inputs:
                    producer.send_raw(s.topic(topic), key, value, auth=auth[0] if auth else None)
                published = 0
                windows = sum(extra[0] == NODE_SHUTTER.name for extra in extra_inputs)

                def send(batch: list[Record]) -> None:
                    nonlocal published, windows
                    producer.send_all(batch)
                    published += len(batch)
                    windows += sum(isinstance(r, ShutterWindow) for r in batch)

                ended = source(send, report)
            pipeline.wait(len(ended), published + len(extra_inputs), timeout_s, report, windows)
            report("waiting for charges", pipeline.ledger_sink.rows_inserted, len(ended))
            pipeline.wait_for_decisions(timeout_s, report)
    truth_path = out / "truth.parquet" if truth else None
    if truth_path is not None:
        write_truth(ended, truth_path)
    report("auditing", 0, 1)
    result = audit(pipeline.archive_path, pipeline.ledger_path, s.policy(), verifier=s.verifier())
    report("auditing", 1, 1)
    with Ledger(pipeline.ledger_path, read_only=True) as ledger:
        charges = ledger.charges()
    return DemoResult(
        settings=s, bootstrap=bootstrap, broker="configured" if external else "bundled tansu",
        events_published=published, events_archived=pipeline.archive_sink.messages_written,
        jobs_ended=len(ended), charges=charges, audit=result, ledger=pipeline.ledger_path,
        archive=pipeline.archive_path, truth=truth_path, elapsed_s=time.monotonic() - t0,
    )


def publish(settings: Settings, sim: Scenario, report: Progress) -> None:
    """Publish a finished simulation's events (tests that drive their own workers use this)."""
    with EventProducer(settings, client_id="nodeshare-simulator") as producer:
        from_events(sim)(producer.send_all, report)
