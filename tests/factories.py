"""Small builders of valid records for tests."""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

from nodeshare.producers.simulator import SimConfig, simulate
from nodeshare.schemas import (
    TOPIC_OF_RECORD,
    CounterSource,
    IpcSample,
    JobEvent,
    JobLeftNode,
    JobState,
    ShutterBatch,
    ShutterBlock,
    encode,
    key_of,
)
from nodeshare.schemas.events import (
    JobPowerPlan,
    LlcShare,
    NodePlacementState,
    PlacementDecision,
    PowerAction,
    PowerDecision,
    ProcessorCap,
)
from nodeshare.schemas.signing import Signer, Verifier
from nodeshare.sinks.archive import ArchivedEvent, ParquetArchive
from nodeshare.sinks.ledger import Ledger
from nodeshare.streams.core.accounting import Origin, PricingPolicy, as_read_live, fold_messages

#: Prices at the point estimate without the short-sample margin (the factories' blocks are all of
#: 3.2 ms, which would carry it), so tests of the markers, the pause credit and Eq. 1-4 check their
#: arithmetic by hand; pricing at the interval's bound and with the short-sample margin is tested
#: in test_confidence.py, and both audit paths with the margin in test_fast_audit.py.
POLICY = PricingPolicy(rate_per_core_hour=1.5, price_at_bound=False, short_margin=0.0)

T0 = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)
CYCLES = 1_000_000  # per sample: IPC x CYCLES is an exact instruction count for IPCs with <= 6 decimals


def samples(*ipcs: float) -> tuple[IpcSample, ...]:
    return tuple(IpcSample(instructions=round(i * CYCLES), cycles=CYCLES) for i in ipcs)


def block(before: float | tuple[float, ...], during: float | tuple[float, ...], after: float | tuple[float, ...],
          *, job: str = "j1", node: str = "n1", cycle: int = 0) -> ShutterBlock:
    b, d, a = (x if isinstance(x, tuple) else (x,) for x in (before, during, after))
    return ShutterBlock(
        event_id=f"blk-{job}-{node}-{cycle}", source="test", event_time=T0 + timedelta(seconds=cycle),
        job_id=job, node=node, cycle=cycle, k=len(b), sample_us=3200, counter=CounterSource.SIMULATED,
        before=samples(*b), during=samples(*d), after=samples(*a),
    )


def batch(*blocks: ShutterBlock, seq: int = 0) -> ShutterBatch:
    """The blocks (of one job on one node, K alike) as one schema-3 batch, timed at the last one."""
    first, last = blocks[0], blocks[-1]

    def columns(region: str) -> dict[str, tuple[int, ...]]:
        samples = [s for b in blocks for s in getattr(b, region)]
        return {f: tuple(getattr(s, f) for s in samples) for f in ("instructions", "cycles", "threads")}

    return ShutterBatch.model_validate({
        "event_id": f"bat-{first.job_id}-{first.node}-{first.cycle}-{len(blocks)}", "source": "test",
        "event_time": last.event_time, "job_id": first.job_id, "node": first.node, "seq": seq, "k": first.k,
        "sample_us": first.sample_us, "counter": first.counter, "cycle": tuple(b.cycle for b in blocks),
        "before": columns("before"), "during": columns("during"), "after": columns("after")})


def left(job: str, node: str, blocks_sent: int, last_cycle: int, at_s: float = 3600, alone_us: int = 0) -> JobLeftNode:
    return JobLeftNode(event_id=f"left-{job}-{node}", source="test", event_time=T0 + timedelta(seconds=at_s),
                       job_id=job, node=node, blocks_sent=blocks_sent, last_cycle=last_cycle, alone_us=alone_us)


def job_event(job: str, state: JobState, *, nodes: tuple[str, ...] = ("n1",), cores: int = 16,
              run_s: float = 3600, user: str = "alice", account: str = "physics") -> JobEvent:
    ran = state is not JobState.SUBMITTED
    ended = state in (JobState.ENDED, JobState.FAILED)
    return JobEvent(
        event_id=f"job-{job}-{state.value}", source="test",
        event_time=T0 + timedelta(seconds=run_s if ended else 0), job_id=job, state=state, user=user,
        account=account, program="lammps", cores=cores, nodes=nodes if ran else (), submit_time=T0,
        start_time=T0 if ran else None, end_time=T0 + timedelta(seconds=run_s) if ended else None,
    )


def build(tmp: Path, *, batch: int = 400, partitions: int = 1, jobs: int = 8) -> tuple[Path, Path, int]:
    """Archive a simulated run as the archive sink would, and price it into a ledger."""
    sim = simulate(SimConfig(nodes=4, jobs=jobs, seed=5))
    return archive_records(tmp, sim.events, batch=batch, partitions=partitions)


def archive_records(tmp: Path, records: list, *, batch: int = 400, partitions: int = 1,
                    signer: Signer | None = None, verifier: Verifier | None = None) -> tuple[Path, Path, int]:
    """Archive records on their topics' partitions (Kafka's default partitioner: murmur2 of the
    key; one partition: all on 0), as the archive sink would, and price them into a ledger with
    the reference fold. A record is a model (signed by ``signer`` when given) or raw (topic, key,
    value[, auth]); with ``verifier``, the fold takes records from allowed signers only, as a
    worker given the site secret does."""
    from aiokafka.partitioner import murmur2

    offsets: dict[tuple[str, int], int] = {}
    rows: dict[str, list[ArchivedEvent]] = {}
    for i, rec in enumerate(records):
        auth = None
        if isinstance(rec, tuple):
            topic, key, value, *signed = rec
            auth = signed[0] if signed else None
        else:
            topic, key, value = TOPIC_OF_RECORD[type(rec)].name, key_of(rec), encode(rec)
            if signer is not None:
                auth = signer.header(topic, key, value, signer.identity_for(
                    rec.kind, getattr(rec, "node", None), getattr(rec, "operator", None)))
        p = 0 if partitions == 1 or key is None else (murmur2(key) & 0x7FFFFFFF) % partitions
        off = offsets[(topic, p)] = offsets.get((topic, p), -1) + 1
        # the broker's timestamp: when the record was produced (its event time; raw bytes: T0)
        when = rec.event_time if not isinstance(rec, tuple) else T0
        rows.setdefault(topic, []).append(ArchivedEvent(topic, p, off, round(when.timestamp() * 1000) + i, key,
                                                        value, auth))
    archive = ParquetArchive(tmp / "archive")
    for topic, evs in rows.items():
        for start in range(0, len(evs), batch):
            archive.write(topic, evs[start:start + batch])
    msgs = as_read_live((Origin(e.kafka_topic, e.partition, e.offset,
                                None if verifier is None else verifier.signer(e.kafka_topic, e.key, e.value, e.auth)),
                         e.key, e.value, e.timestamp_ms / 1000)
                        for t in ("node.ipc", "jobs.lifecycle") for e in rows.get(t, []))
    charges = fold_messages(msgs, POLICY)
    with Ledger(tmp / "ledger.duckdb") as ledger:
        ledger.append([(c, encode(c), 0, i) for i, c in enumerate(charges)])
    return tmp / "archive", tmp / "ledger.duckdb", len(charges)


def profile_csv(path: Path, *names: str) -> Path:
    """An LLC-profile CSV shaped like llc_profiles_spec.csv: per program, IPC rising and bandwidth
    falling with ways (1 + w/100 and 3000 - 100 w MB/s), stall share 0.3 at ways 2-4, 7.5 refs/kinstr."""
    rows = ["BENCH,NR_WAYS,ipc,bandwidth_mbps,stalls_l3_miss,llcrpki"]
    rows += [f"{n},{w},{1.0 + w / 100},{3000 - w * 100},{0.3 if w in (2, 3, 4) else 0.1},7.5"
             for n in names for w in range(1, 12)]
    path.write_text("\n".join(rows) + "\n")
    return path


def alone_from_lifecycle(events: list) -> dict[tuple[str, str], float]:
    """Seconds each (job, node) ran with no other job on the node, worked out from the lifecycle
    events alone (start and end times, nodes): what the markers' alone_us should say."""
    runs = [(e.job_id, e.nodes, e.start_time, e.end_time) for e in events
            if isinstance(e, JobEvent) and e.state in (JobState.ENDED, JobState.FAILED)]
    out: dict[tuple[str, str], float] = {}
    for job, nodes, start, end in runs:
        for node in nodes:
            others = sorted((s, t) for j, ns, s, t in runs if j != job and node in ns and s < end and t > start)
            alone, at = 0.0, start
            for s, t in others:  # the gaps between the other jobs' runs, within this one's
                if s > at:
                    alone += (s - at).total_seconds()
                at = max(at, t)
            if end > at:
                alone += (end - at).total_seconds()
            out[(job, node)] = alone
    return out


# --------------------------------------------------------------------------- power decisions and powercap


def power_plan(job: str, *caps: tuple[str, int, float]) -> JobPowerPlan:
    return JobPowerPlan(job_id=job, budget_watts=sum(w for _, _, w in caps),
                        caps=tuple(ProcessorCap(node=n, processor=p, cap_watts=w) for n, p, w in caps))


def power_decision(job: str, action: PowerAction, mine: JobPowerPlan | None = None,
             updates: tuple[JobPowerPlan, ...] = ()) -> PowerDecision:
    return PowerDecision(event_id=f"{job}-{action}", source="test", event_time=T0, job_id=job, action=action,
                         plan=mine, running_updates=updates, machine_budget_watts=1000.0,
                         machine_allocated_watts=0.0)


def powercap_tree(root: Path, packages: int = 2, limit_uw: int = 125_000_000, max_uw: int = 150_000_000) -> Path:
    """The kernel's layout of /sys/class/powercap for ``packages`` RAPL package domains."""
    for p in range(packages):
        d = root / f"intel-rapl:{p}"
        d.mkdir(parents=True)
        for name, value in (("name", f"package-{p}"), ("energy_uj", "0"), ("max_energy_range_uj", "262143328850"),
                            ("constraint_0_name", "long_term"), ("constraint_0_power_limit_uw", str(limit_uw)),
                            ("constraint_0_max_power_uw", str(max_uw)), ("constraint_0_time_window_us", "976")):
            (d / name).write_text(value + "\n")
        (root / f"intel-rapl:{p}:0").mkdir()  # a sub-domain (core): never written
    return root


def limit(root: Path, p: int) -> int:
    """A package's limit. A plain file is truncated before it is written (sysfs is not), so a read
    racing the agent's write can see it empty: read again."""
    for _ in range(200):
        if text := (root / f"intel-rapl:{p}" / "constraint_0_power_limit_uw").read_text():
            return int(text)
        time.sleep(0.005)
    raise AssertionError(f"intel-rapl:{p}'s limit stayed empty")


# --------------------------------------------------------------------------- placement decisions and resctrl


def placement(job: str, nodes: tuple[str, ...], ways: int | None = None, gbps: float | None = None,
              action: str = "place") -> PlacementDecision:
    from nodeshare.schemas.events import PlacementAction

    return PlacementDecision(event_id=f"p-{job}-{action}-{nodes}", source="test", event_time=T0, job_id=job,
                             action=PlacementAction(action), policy="sns", nodes=nodes,
                             cores_per_node=1 if nodes else None, llc_ways=ways, bandwidth_gbps=gbps, reason="test")


def node_shares(node: str, *shares: tuple[str, int, float | None], by: str = "test") -> NodePlacementState:
    """``decisions.placement.nodes``' record of ``node``: (job, ways, bandwidth in GB/s or None) each."""
    return NodePlacementState(event_id=f"shares-{node}-{by}", source="test", event_time=T0, node=node,
                              shares=tuple(LlcShare(job_id=j, ways=w, bandwidth_gbps=g) for j, w, g in shares),
                              decided_by=by)


def resctrl_tree(root: Path, ways: int = 11, caches: int = 2, mba: bool = True) -> Path:
    """The kernel's layout of /sys/fs/resctrl: the default group's schemata and tasks, info/L3."""
    (root / "info" / "L3").mkdir(parents=True)
    (root / "info" / "L3" / "cbm_mask").write_text(f"{(1 << ways) - 1:x}\n")
    lines = ["L3:" + ";".join(f"{i}={(1 << ways) - 1:x}" for i in range(caches))]
    if mba:
        lines.append("MB:" + ";".join(f"{i}=100" for i in range(caches)))
    (root / "schemata").write_text("\n".join(lines) + "\n")
    (root / "tasks").write_text("1\n")
    return root


def scan_order(rows):
    """A relation of node.ipc rows (job, node, offset, cycle or a batch's cycles) in exactly this scan order."""
    def cycles(c):
        return list(c) if isinstance(c, tuple) else [c]

    values = ", ".join(f"({i}, '{'shutter_batch' if isinstance(c, tuple) else 'shutter_block'}', '{j}', '{n}', {o}, "
                       f"{cycles(c)}::BIGINT[])" for i, (j, n, o, c) in enumerate(rows))
    return f'(SELECT kind, job_id, node, "offset", l_cycle FROM (VALUES {values}) t(i, kind, job_id, node, ' \
           f'"offset", l_cycle) ORDER BY i)'
