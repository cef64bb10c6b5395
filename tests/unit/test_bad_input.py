"""Bad input, generated: every bad record is dead-lettered with a reason, the fold never raises,
and the charges of the valid run around it do not change (13,000 bad records in all).

Hypothesis builds batches of bad records of every kind the reliability issue lists and splices
them at random points into a valid two-job run on both accounting topics (node.ipc and
jobs.lifecycle), exactly as the worker and the audit fold them (``process_message``). Over the
examples below that is 10,000+ bad records. Kinds that cannot be refused on arrival are checked
for what they must do instead (a block for a job that never ends is held, never charged).
"""

from __future__ import annotations

import json
from datetime import timedelta

from factories import T0, batch, block, job_event, left
from hypothesis import given, settings
from hypothesis import strategies as st
from power_events import scenario

from nodeshare.schemas import Charge, DeadLetter, JobState, Record, clock_problem, decode_model, encode
from nodeshare.schemas.events import MAX_AHEAD_OF_BROKER_S, SCHEMA_VERSION
from nodeshare.streams.core.accounting import Origin, PricingPolicy, process_message
from nodeshare.streams.core.power.stream import screen

POLICY = PricingPolicy(rate_per_core_hour=2.0)
IPC, LIFE = "node.ipc", "jobs.lifecycle"
BROKER_TS = (T0 + timedelta(hours=3)).timestamp()  # every message was produced after the run's events
EXAMPLES, BATCH = 110, 100  # 11,000 bad records per run of this module

#: the fields of a charge that pricing decides (offsets move when bad records are spliced in)
#: (blocks_ignored is left out: a duplicate block is counted there, by design, and changes no price)
PRICED = ("job_id", "revision", "cores", "run_time_s", "pause_credit_s", "degradation", "degradation_filtered",
          "degradation_unfiltered", "degradation_corrected", "blocks_used", "blocks_rejected", "standard_price",
          "price", "dividend")


def valid_run() -> list[tuple[str, Record]]:
    """Two jobs on one node, four blocks each, both ended: (topic, record) in arrival order."""
    out: list[tuple[str, Record]] = []
    for job, nodes in (("a", ("n1",)), ("b", ("n1",))):
        out.append((LIFE, job_event(job, JobState.STARTED, nodes=nodes)))
        for cycle, (b, d, a) in enumerate([(1.0, 1.4, 1.02), (0.9, 1.2, 0.92), (1.1, 1.3, 1.12), (1.0, 2.0, 1.5)]):
            out.append((IPC, block(b, d, a, job=job, cycle=2 * cycle)))
        out.append((IPC, left(job, "n1", 4, 6)))
        out.append((LIFE, job_event(job, JobState.ENDED, nodes=nodes, run_s=7200)))
    return out


VALID = valid_run()
A_BLOCK = next(r for t, r in VALID if t == IPC)
A_LEFT = next(r for t, r in VALID if r.kind == "job_left_node")
AN_END = next(r for t, r in VALID if r.kind == "job_event" and r.state is JobState.ENDED)


def as_dict(r: Record) -> dict:
    return json.loads(encode(r))


def raw(d: dict) -> bytes:
    return json.dumps(d).encode()


# ---------------------------------------------------------------------------- bad-record strategies
# Each yields (topic, key, value bytes, what the dead letter's reason must mention: one of the
# '|'-separated alternatives, never nothing).

#: what a dead letter of arbitrary bytes says: not JSON, JSON but no object, an object of no known kind
NOT_A_RECORD = "invalid JSON|input should|discriminator|tombstone"

def random_bytes() -> st.SearchStrategy:
    return st.tuples(st.sampled_from([IPC, LIFE]), st.just(b"a"), st.binary(max_size=64),
                     st.just(NOT_A_RECORD))


def truncated_json() -> st.SearchStrategy:
    def cut(rec: Record, frac: float) -> tuple:
        b = encode(rec)
        return (IPC if rec.kind != "job_event" else LIFE, b"a", b[:max(1, int(len(b) * frac))], "JSON")
    return st.builds(cut, st.sampled_from([A_BLOCK, A_LEFT, AN_END]), st.floats(0.0, 0.98))


def wrong_type() -> st.SearchStrategy:
    fields = [("cycle", IPC, A_BLOCK), ("k", IPC, A_BLOCK), ("node", IPC, A_BLOCK), ("blocks_sent", IPC, A_LEFT),
              ("cores", LIFE, AN_END), ("state", LIFE, AN_END), ("end_time", LIFE, AN_END),
              ("before", IPC, A_BLOCK), ("event_time", IPC, A_BLOCK)]
    values = st.one_of(st.text(max_size=5), st.lists(st.integers(), max_size=2), st.booleans(), st.none(),
                       st.dictionaries(st.text(max_size=3), st.integers(), max_size=2))

    def put(choice: tuple, value: object) -> tuple:
        name, topic, rec = choice
        d = as_dict(rec)
        if isinstance(value, str) or d[name] == value:
            value = [value]  # a list is never a valid value of these fields (a string may be)
        d[name] = value
        return (topic, b"a", raw(d), name)
    return st.builds(put, st.sampled_from(fields), values)


def non_finite() -> st.SearchStrategy:
    def put(where: str, token: str) -> tuple:
        d = as_dict(A_BLOCK)
        text = json.dumps(d).replace(f'"{where}": {d[where]}', f'"{where}": {token}')
        return (IPC, b"a", text.encode(), where)
    return st.builds(put, st.sampled_from(["cycle", "k", "sample_us"]), st.sampled_from(["NaN", "Infinity",
                                                                                          "-Infinity", "1e999"]))


def bad_counts() -> st.SearchStrategy:
    """Negative or zero cycles, negative instructions, absurd K, K that does not match the samples."""
    def put(region: str, field: str, value: int) -> tuple:
        d = as_dict(A_BLOCK)
        d[region][0][field] = value
        return (IPC, b"a", raw(d), region)
    counts = st.builds(put, st.sampled_from(["before", "during", "after"]),
                       st.sampled_from(["cycles", "instructions", "threads"]), st.integers(-10**12, -1))
    zero_cycles = st.builds(put, st.sampled_from(["before", "during", "after"]), st.just("cycles"), st.just(0))

    def k(value: int) -> tuple:
        d = as_dict(A_BLOCK)
        d["k"] = value
        return (IPC, b"a", raw(d), "k")
    return st.one_of(counts, zero_cycles, st.builds(k, st.one_of(st.integers(-5, 0), st.integers(2, 10**9))))


def unknown_version() -> st.SearchStrategy:
    def put(rec: Record, v: int) -> tuple:
        d = as_dict(rec)
        d["schema_version"] = v
        return (IPC if rec.kind != "job_event" else LIFE, b"a", raw(d), "schema version")
    return st.builds(put, st.sampled_from([A_BLOCK, A_LEFT, AN_END]),
                     st.one_of(st.integers(SCHEMA_VERSION + 1, 10**6), st.integers(-10, 0)))


def wrong_clock() -> st.SearchStrategy:
    """Timestamps far in the future of the broker's, or before 2000."""
    def put(rec: Record, shift_s: float) -> tuple:
        d = as_dict(rec)
        d["event_time"] = (rec.event_time + timedelta(seconds=shift_s)).isoformat()
        return (IPC if rec.kind != "job_event" else LIFE, b"a", raw(d), "clock")
    ahead = st.floats(4 * 3600 + MAX_AHEAD_OF_BROKER_S, 1e9)  # past the broker's timestamp + skew
    back = st.floats(-1.5e9, -8.5e8)  # 1978 - 1999
    return st.builds(put, st.sampled_from([A_BLOCK, A_LEFT, AN_END]), st.one_of(ahead, back))


def key_mismatch() -> st.SearchStrategy:
    """A key that is not the record's job, on both input topics (blocks, markers, lifecycle events)."""
    def put(rec: Record, key: bytes) -> tuple:
        return (IPC if rec.kind != "job_event" else LIFE, key, encode(rec), "key")
    return st.builds(put, st.sampled_from([A_BLOCK, A_LEFT, AN_END]),
                     st.binary(max_size=8).filter(lambda k: k != b"a"))


def replays_of_valid_events() -> st.SearchStrategy:
    """Duplicate event ids re-sent at a new offset, a job ended twice, blocks out of order and
    after the job left its node: valid bytes, refused by the account's rules."""
    reasons = {"shutter_block": "out of order|after the job left", "job_left_node": "already left",
               "job_event": "duplicate terminal event"}

    def dup(i: int) -> tuple:
        topic, rec = [(t, r) for t, r in VALID if r.kind != "job_event" or r.state is JobState.ENDED][i]
        return (topic, rec.job_id.encode(), encode(rec), reasons[rec.kind])
    return st.builds(dup, st.integers(0, 11))


def resent_batches_with_bad_rows() -> st.SearchStrategy:
    """An agent restarted and re-sent a job's blocks in a batching of its own, with a bad row among
    them (negative or zero count, a count past 2**53, no thread): spliced in after the job's last
    block, so every row is refused, each with its index, and none is counted twice."""
    def put(job: str, at: int, region: str, field: str, value: int) -> tuple:
        blocks = [r for t, r in VALID if t == IPC and r.kind == "shutter_block" and r.job_id == job]
        d = as_dict(batch(*blocks, seq=7))
        bad = as_dict(batch(*blocks[:1]))
        bad[region][field][0] = value
        d["cycle"].insert(at, 2 * at + 1)  # a cycle the job never sent: refused for its bad value, not its order
        for r in ("before", "during", "after"):
            for f in ("instructions", "cycles", "threads"):
                d[r][f].insert(at, bad[r][f][0])
        return (IPC, job.encode(), raw(d), f"{len(blocks) + 1} of {len(blocks) + 1} blocks refused")
    bad_value = st.one_of(
        st.tuples(st.just("instructions"), st.integers(-10**12, -1)),
        st.tuples(st.sampled_from(["cycles", "threads"]), st.integers(-10**12, 0)),
        st.tuples(st.sampled_from(["instructions", "cycles"]), st.integers(2**53, 2**62)))
    return st.builds(lambda job, at, region, fv: put(job, at, region, *fv), st.sampled_from(["a", "b"]),
                     st.integers(0, 3), st.sampled_from(["before", "during", "after"]), bad_value)


BAD = st.one_of(random_bytes(), truncated_json(), wrong_type(), non_finite(), bad_counts(), unknown_version(),
                wrong_clock(), key_mismatch(), replays_of_valid_events(), resent_batches_with_bad_rows())


def fold(messages: list[tuple[str, bytes | None, bytes | None]]) -> tuple[dict, list[DeadLetter], list[Charge]]:
    """What the worker does with these messages, in order, on partition 0 of each topic."""
    states: dict[bytes | None, bytes] = {}
    offsets = {IPC: 0, LIFE: 0}
    letters: list[DeadLetter] = []
    charges: list[Charge] = []
    for topic, key, value in messages:
        origin = Origin(topic, 0, offsets[topic])
        offsets[topic] += 1
        new, out, _ = process_message(states.get(key), origin, key, value, BROKER_TS, POLICY)
        if new is not None:
            states[key] = new
        letters += [decode_model(DeadLetter, o.value) for o in out if o.topic == "dlq"]
        charges += [decode_model(Charge, o.value) for o in out if o.topic == "ledger.charges"]
    return states, letters, charges


def priced(charges: list[Charge]) -> dict[tuple[str, int], tuple]:
    return {(c.job_id, c.revision): tuple(getattr(c, f) for f in PRICED) for c in charges}


CLEAN = fold([(t, r.job_id.encode(), encode(r)) for t, r in VALID])


def test_the_valid_run_alone_is_charged_and_clean():
    _, letters, charges = CLEAN
    assert not letters and sorted((c.job_id, c.revision) for c in charges) == [("a", 0), ("b", 0)]
    assert all(c.blocks_used == 3 and c.blocks_rejected == 1 and c.dividend > 0 for c in charges)


@settings(max_examples=EXAMPLES, deadline=None, derandomize=True)
@given(st.lists(st.tuples(BAD, st.floats(0.0, 1.0)), min_size=BATCH, max_size=BATCH))
def test_bad_records_are_dead_lettered_and_change_no_charge(batch):
    valid = [(t, r.job_id.encode(), encode(r)) for t, r in VALID]
    # splice each bad record in at a random point; replays of valid events go after their original
    stream: list[tuple[float, int, tuple]] = [(i / len(valid), 0, m) for i, m in enumerate(valid)]
    for n, ((topic, key, value, _), at) in enumerate(batch):
        after = next((i for i, m in enumerate(valid) if m[2] == value), -1)
        at = max(at, (after + 0.5) / len(valid)) if after >= 0 else at
        if b'"shutter_batch"' in value[:400]:  # a re-sent batch: after its job's last block, before it leaves
            last = max(i for i, (t, k, v) in enumerate(valid) if k == key and b'"shutter_block"' in v)
            at = (last + 0.5) / len(valid)
        stream.append((at, 1 + n, (topic, key, value)))
    messages = [m for _, _, m in sorted(stream, key=lambda e: (e[0], e[1]))]

    _, letters, charges = fold(messages)  # never raises

    assert priced(charges) == priced(CLEAN[2])  # the same charges, once each (duplicates are re-sent copies)
    assert len({(c.job_id, c.revision) for c in charges}) == 2
    # every bad record, and nothing else, is dead-lettered, once, with a reason that says why
    offsets = {IPC: 0, LIFE: 0}
    expected: dict[tuple[str, int], str] = {}
    for _, n, (topic, _key, _value) in sorted(stream, key=lambda e: (e[0], e[1])):
        if n:
            expected[(topic, offsets[topic])] = batch[n - 1][0][3]
        offsets[topic] += 1
    got = {(dl.origin_topic, dl.origin_offset): dl for dl in letters}
    assert len(got) == len(letters) and got.keys() == expected.keys()
    for where, must_say in expected.items():
        dl = got[where]
        said = f"{dl.field} {dl.reason}".lower()
        assert must_say and any(alt.lower() in said for alt in must_say.split("|")), (must_say, dl.field, dl.reason)
        if "blocks refused" in must_say:  # each refused row named: the bad one for its value, the rest as copies
            assert len(dl.rows) == int(must_say.split()[0]) and sum("order" in r.reason for r in dl.rows) == 4


def test_a_block_for_a_job_that_never_ends_is_held_not_charged():
    stray = block(1.0, 2.0, 1.0, job="ghost", cycle=0)
    states, letters, charges = fold([(IPC, b"ghost", encode(stray))] + [(t, r.job_id.encode(), encode(r))
                                                                         for t, r in VALID])
    assert not letters and b"ghost" in states  # kept: its end event may still come
    assert priced(charges) == priced(CLEAN[2])


def test_clock_rules_by_hand():
    rec = A_BLOCK  # event_time T0 + 0 s
    t0 = rec.event_time.timestamp()
    assert clock_problem(rec, t0 - MAX_AHEAD_OF_BROKER_S + 1) is None  # within the skew
    assert "ahead of the broker" in (clock_problem(rec, t0 - MAX_AHEAD_OF_BROKER_S - 1) or "")
    assert clock_problem(rec, 0.0) is None  # no broker timestamp: nothing to compare with
    old = rec.model_copy(update={"event_time": rec.event_time.replace(year=1999)})
    assert "before 2000-01-01" in (clock_problem(old, 0.0) or "")


# ---------------------------------------------------------------------------- node.power, cluster.inventory

POWER, INVENTORY = "node.power", "cluster.inventory"
A_READING = next(r for r in scenario() if r.kind == "power_reading")
AN_INVENTORY = next(r for r in scenario() if r.kind == "node_inventory")
POWER_TS = (A_READING.event_time + timedelta(hours=3)).timestamp()  # produced after the readings


def power_bad() -> st.SearchStrategy:
    def topic_of(rec: Record) -> str:
        return POWER if rec.kind == "power_reading" else INVENTORY

    def mutate(rec: Record, how: str, junk: bytes, frac: float, version: int, shift: float) -> tuple:
        d = as_dict(rec)
        if how == "bytes":
            return (topic_of(rec), junk, NOT_A_RECORD)
        if how == "truncated":
            b = encode(rec)
            return (topic_of(rec), b[:max(1, int(len(b) * frac))], "JSON")
        if how == "version":
            d["schema_version"] = version
            return (topic_of(rec), raw(d), "schema version")
        if how == "clock":
            d["event_time"] = (rec.event_time + timedelta(seconds=shift)).isoformat()
            return (topic_of(rec), raw(d), "clock")
        if rec.kind == "power_reading":  # numbers on an unavailable reading, negative watts, NaN
            d.update({"negative": {"watts": -1.0}, "unavailable": {"available": False, "watts": 50.0}}.get(how, {}))
            text = raw(d) if how != "nan" else raw(d).replace(b'"processor": ', b'"processor": NaN, "x": ')
            return (POWER, text, "watts" if how != "nan" else "processor")
        d["cores"] = {"negative": -4, "unavailable": "many", "nan": 0}[how]
        return (INVENTORY, raw(d), "cores")

    versions = st.one_of(st.integers(SCHEMA_VERSION + 1, 10**6), st.integers(-10, 0))
    shifts = st.one_of(st.floats(4 * 3600 + MAX_AHEAD_OF_BROKER_S, 1e9), st.floats(-1.5e9, -8.5e8))
    return st.builds(mutate, st.sampled_from([A_READING, AN_INVENTORY]),
                     st.sampled_from(["bytes", "truncated", "version", "clock", "negative", "unavailable", "nan"]),
                     st.binary(max_size=48), st.floats(0.0, 0.98), versions, shifts)


@settings(max_examples=40, deadline=None, derandomize=True)
@given(st.lists(power_bad(), min_size=50, max_size=50))
def test_bad_power_and_inventory_input_is_dead_lettered_by_the_router(batch):
    """The power router screens node.power and cluster.inventory (2,000 bad records here); the
    valid records pass, so the power manager folds exactly what it would without them."""
    for offset, (topic, value, must_say) in enumerate(batch):
        dl = screen(topic, 0, offset, b"node", value, POWER_TS)
        assert dl is not None, value[:80]
        assert (dl.origin_topic, dl.origin_offset) == (topic, offset) and dl.reason
        said = f"{dl.field} {dl.reason}".lower()
        assert must_say and any(alt.lower() in said for alt in must_say.split("|")), (must_say, dl.field, dl.reason)
    for rec in scenario():
        topic = {"power_reading": POWER, "node_inventory": INVENTORY}.get(rec.kind, LIFE)
        assert screen(topic, 0, 0, b"k", encode(rec), POWER_TS) is None  # valid input and lifecycle pass


def test_a_wrong_clock_on_a_power_reading_keeps_it_off_the_power_log():
    late = A_READING.model_copy(update={"event_time": A_READING.event_time + timedelta(days=2)})
    dl = screen(POWER, 1, 7, b"n", encode(late), late.event_time.timestamp() - 2 * 86400)
    assert dl is not None and dl.field == "event_time" and "ahead of the broker" in dl.reason
    assert screen(POWER, 1, 7, b"n", encode(late), late.event_time.timestamp()) is None


def test_dead_letters_re_sent_after_a_worker_restart_are_counted_once():
    """A restarted worker re-applies what it had not committed and dead-letters it again: `dlq
    show` counts each refused input once and says how many copies it saw. (Mutation: counting
    every record in `total` fails here.)"""
    from nodeshare.schemas import DeadLetter, encode
    from nodeshare.sinks.analysis.inspect import DeadLetterSummary

    def dl(offset: int, reason: str) -> bytes:
        return encode(DeadLetter(event_id=f"dl-{offset}-{reason}", source="test", event_time=T0,
                                 origin_topic="node.ipc", origin_partition=1, origin_offset=offset, reason=reason,
                                 value_b64="e30="))

    summary = DeadLetterSummary()
    for value in (dl(5, "decode"), dl(9, "key_mismatch"), dl(5, "decode"), b"not a dead letter"):
        summary.add(value, first=10)
    assert (summary.total, summary.resent, summary.undecodable) == (2, 1, 1)
    assert summary.by_reason == {"decode": 1, "key_mismatch": 1} and len(summary.first) == 2
    assert summary.as_dict()["resent"] == 1
