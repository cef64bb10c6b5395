"""Prometheus metrics of the stream worker, the sinks, the node agent and the demo (prometheus-client).

Each process serves its own registry on ``NODESHARE_METRICS_PORT`` (off when unset), bound to
``NODESHARE_METRICS_ADDR`` (loopback by default). Label values are bounded sets: topics of the
catalog and dead-letter kinds, never raw reasons or job ids. Each process also exports
prometheus-client's process metrics: ``process_cpu_seconds_total`` is the agent's CPU (its
overhead on the node), ``process_resident_memory_bytes`` its memory.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram, start_http_server

EVENTS_IN = Counter("nodeshare_events_in_total", "Input messages consumed", ["topic"])
EVENTS_OUT = Counter("nodeshare_events_out_total", "Messages published", ["topic"])
DEAD_LETTERS = Counter("nodeshare_dead_letters_total", "Input refused, by kind", ["kind"])
SHUTTER_BLOCKS = Counter("nodeshare_shutter_blocks_total",
                         "Shutter blocks counted (accepted or rejected by Alg. 4) or refused (bad, duplicate, late)",
                         ["verdict"])
CHARGES_EMITTED = Counter("nodeshare_charges_emitted_total", "Charge revisions published by the stream worker")
PROCESSING_SECONDS = Histogram("nodeshare_processing_seconds", "Time to apply one input message",
                               buckets=(0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0))
REFETCHED = Counter("nodeshare_messages_refetched_total",
                    "Input messages the stream skipped that the worker read back from the broker", ["agent"])
POWER_DECISIONS = Counter("nodeshare_power_decisions_total", "Power decisions published, by action", ["action"])
SINK_ROWS = Counter("nodeshare_sink_rows_total", "Messages made durable by a sink", ["sink"])
SINK_COMMITS_FAILED = Counter("nodeshare_sink_commits_failed_total",
                              "Offset commits of durable batches the broker refused (the batch is read again "
                              "and absorbed), by sink and Kafka error", ["sink", "error"])
LEDGER_ROWS = Counter("nodeshare_ledger_rows_total", "New ledger rows (redelivered charges excluded)")
DIVERGENT_CHARGES = Counter("nodeshare_ledger_divergent_charges_total",
                            "Copies of a (job, revision) that differ from the ledger's row (dead-lettered, never kept)")
# Ended jobs the worker's charge fold has not charged: a node's block stream is awaited (its agent's
# JobLeftNode, or a NodeDown record for a node lost for good: `nodeshare nodes down`)
JOBS_AWAITING_NODES = Gauge("nodeshare_jobs_awaiting_nodes",
                            "Ended jobs held in the charge fold until every node they ran on closes its block stream "
                            "(JobLeftNode or NodeDown), in the partitions this worker folds")
JOBS_AWAITING_OLDEST = Gauge("nodeshare_jobs_awaiting_nodes_oldest_seconds",
                             "Seconds since the end (its terminal event's end_time, against this host's clock) of "
                             "the longest-waiting such job; 0 when none waits. Hours: a node is likely lost")
# The node agent (producers/agent)
SPOOL_EVENTS = Gauge("nodeshare_agent_spool_events", "Events in the agent's spool not yet acknowledged by the broker")
SPOOL_BYTES = Gauge("nodeshare_agent_spool_bytes", "Bytes in the agent's spool not yet acknowledged by the broker")
SPOOL_MAX_BYTES = Gauge("nodeshare_agent_spool_max_bytes",
                        "The spool's limit (--spool-max-mb): past it, shutters are skipped and events refused")
SHUTTER_SECONDS = Histogram("nodeshare_agent_shutter_seconds", "How long one shutter kept the co-runners paused",
                            buckets=(0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0))
POWER_CAPS = Counter("nodeshare_agent_power_caps_total",
                     "Power limits the agent wrote, by outcome (applied, restored, refused)", ["outcome"])
RESCTRL = Counter("nodeshare_agent_resctrl_total",
                  "Per-job resctrl groups (LLC ways, memory bandwidth) the agent set, by outcome (applied, removed, "
                  "refused)", ["outcome"])
SLURM_PLACEMENTS = Counter("nodeshare_slurm_placements_total",
                           "Placement and gating power decisions the Slurm adapter handled, by outcome (applied, "
                           "kept_held, kept_suspended, skipped, undecodable, refused), and held jobs it released "
                           "with no decision (released_unplaced)",
                           ["outcome"])
SHUTTERS_SKIPPED = Counter("nodeshare_agent_shutters_skipped_total", "Shutters not taken, by reason", ["reason"])
AGENT_BLOCKS_DROPPED = Counter("nodeshare_agent_blocks_dropped_total",
                               "Shutters taken whose block was not sent, by reason (counter_went_back: the lone "
                               "job's application count read lower than before, or could not be read)", ["reason"])
AGENT_BLOCKS_DROPPED.labels("counter_went_back")  # exported at 0 from the start: the first drop is an increase

LEDGER_LAST_ROW = Gauge("nodeshare_ledger_last_row_timestamp_seconds",
                        "Unix time the ledger sink last inserted a new charge row (0: none since it started)")
CONSUMER_LAG = Gauge("nodeshare_consumer_lag_messages",
                     "Messages in the consumer's assigned partitions not yet consumed (measured every 30 s), by "
                     "consumer: accounting (the worker's charge fold), ledger, archive (the sinks)", ["consumer"])
SLURM_HOOK_EVENTS = Counter("nodeshare_slurm_hook_events_total",
                            "Slurm hook files the lifecycle source read, by outcome: published, refused "
                            "(unreadable or invalid: moved to bad/ with the reason)", ["outcome"])

#: How often a consumer loop measures its lag (one watermark request per assigned partition).
LAG_INTERVAL_S = 30.0


def report_lag(consumer: object, name: str, positions: dict[tuple[str, int], int], timeout_s: float = 1.0) -> None:
    """Set ``nodeshare_consumer_lag_messages{consumer=name}``: each assigned partition's high watermark
    minus the next offset the loop will read (``positions``), summed. Called from the consumer
    loop's own thread between batches: librdkafka's statistics callback, served inside rebalance
    callbacks, aborted the worker (confluent-kafka's CallState assertion). A broker that does not
    answer leaves the gauge as it was."""
    from confluent_kafka import KafkaException, TopicPartition

    lag = 0
    try:
        for (topic, partition), position in positions.items():
            _, high = consumer.get_watermark_offsets(  # type: ignore[attr-defined]
                TopicPartition(topic, partition), timeout=timeout_s)
            lag += max(0, high - position)
    except KafkaException:
        return
    CONSUMER_LAG.labels(name).set(lag)


#: Dead-letter kinds: the label values of DEAD_LETTERS.
DECODE, KEY_MISMATCH, CLOCK, REJECTED, FORGED = "decode", "key_mismatch", "clock", "rejected", "forged"


def serve(port: int | None, addr: str = "127.0.0.1") -> bool:
    """Start the metrics endpoint of this process if a port is configured."""
    if port is None:
        return False
    start_http_server(port, addr=addr)
    return True


#: The audit's result, written by ``nodeshare audit --metrics-file`` for node_exporter's textfile
#: collector (a registry of its own: only these go into the file).
AUDIT_METRICS = (
    ("nodeshare_audit_ok", "1 when the last audit found nothing wrong, else 0"),
    ("nodeshare_audit_mismatches", "Charges of the last audit that differ from their recomputation (columns included)"),
    ("nodeshare_audit_missing_charges",
     "Ended jobs without a charge in the last audit, plus charges the archive yields that the ledger lacks"),
    ("nodeshare_audit_chain_ok", "1 when the last audit found the ledger's hash chain intact"),
    ("nodeshare_audit_charges_checked", "Charges the last audit recomputed"),
    ("nodeshare_audit_last_run_timestamp_seconds", "Unix time the last audit finished"),
)


def write_audit_metrics(path: str, values: dict[str, float]) -> None:
    """Write the audit's gauges (``AUDIT_METRICS``) to ``path`` in the text exposition format,
    atomically (prometheus-client writes a temporary file and renames it)."""
    from prometheus_client import CollectorRegistry, write_to_textfile

    registry = CollectorRegistry()
    for name, doc in AUDIT_METRICS:
        Gauge(name, doc, registry=registry).set(values[name])
    write_to_textfile(path, registry)
