"""The contract: round trips, strict validation naming the field, and JSON Schema drift."""

import json

import pytest
from factories import T0, block, job_event, left

from nodeshare.producers.simulator import SimConfig, simulate
from nodeshare.schemas import (
    BY_NAME,
    TOPIC_OF_RECORD,
    TOPICS,
    DecodeError,
    JobState,
    PowerReading,
    Record,
    ShutterWindow,
    decode,
    encode,
    key_of,
)
from nodeshare.schemas.jsonschema import rendered, schema_dir


def _one_of_each_input() -> list[Record]:
    sim = simulate(SimConfig(nodes=2, jobs=3, seed=1))
    seen: dict[type, Record] = {}
    for e in sim.events:
        seen.setdefault(type(e), e)
    seen[PowerReading] = PowerReading(event_id="p", source="t", event_time=T0, node="n1", processor=0,
                                      available=True, watts=87.5, cap_watts=95.0, instructions=10, interval_s=0.2)
    return list(seen.values())


@pytest.mark.parametrize("record", _one_of_each_input(), ids=lambda r: type(r).__name__)
def test_round_trip_through_the_one_serializer(record):
    spec = TOPIC_OF_RECORD[type(record)]
    assert decode(spec, encode(record)) == record
    assert key_of(record) == str(getattr(record, spec.key_field)).encode()


def test_every_topic_has_a_model_and_a_unique_name():
    assert len({t.name for t in TOPICS}) == len(TOPICS) == 14
    for rt in TOPIC_OF_RECORD:
        assert {"event_id", "schema_version", "source", "event_time"} <= set(rt.model_fields)


def _mutated(record: Record, path: list, value) -> bytes:
    data = json.loads(encode(record))
    target = data
    for p in path[:-1]:
        target = target[p]
    if value is _DELETE:
        del target[path[-1]]
    else:
        target[path[-1]] = value
    return json.dumps(data).encode()


_DELETE = object()


@pytest.mark.parametrize(
    ("record", "topic", "path", "value", "field"),
    [
        (block(1, 2, 1), "node.ipc", ["before", 0, "cycles"], 0, "before.0.cycles"),
        (block(1, 2, 1), "node.ipc", ["during", 0, "cycles"], -5, "during.0.cycles"),
        (block(1, 2, 1), "node.ipc", ["after", 0, "instructions"], -1, "after.0.instructions"),
        (block(1, 2, 1), "node.ipc", ["before", 0, "instructions"], "12", "before.0.instructions"),
        (block(1, 2, 1), "node.ipc", ["before", 0, "instructions"], 1.5, "before.0.instructions"),
        (block(1, 2, 1), "node.ipc", ["k"], 2, "before"),  # K=2 but one sample per region
        (block(1, 2, 1), "node.ipc", ["k"], 10_000, "k"),  # absurd K
        (block(1, 2, 1), "node.ipc", ["counter"], "psychic", "counter"),
        (block(1, 2, 1), "node.ipc", ["schema_version"], 99, "schema_version"),
        (block(1, 2, 1), "node.ipc", ["event_time"], "2026-01-01T00:00:00", "event_time"),  # naive
        (block(1, 2, 1), "node.ipc", ["surprise"], 1, "surprise"),
        (block(1, 2, 1), "node.ipc", ["job_id"], _DELETE, "job_id"),
        (left("j", "n", 1, 1), "node.ipc", ["last_cycle"], -2, "last_cycle"),
        (job_event("j", JobState.ENDED), "jobs.lifecycle", ["state"], "exploded", "state"),
        (job_event("j", JobState.ENDED), "jobs.lifecycle", ["cores"], 0, "cores"),
        (job_event("j", JobState.ENDED), "jobs.lifecycle", ["end_time"], None, "end_time"),
        (job_event("j", JobState.ENDED), "jobs.lifecycle", ["end_time"], "2020-01-01T00:00:00Z", "end_time"),
        (job_event("j", JobState.ENDED), "jobs.lifecycle", ["nodes"], [], "nodes"),
        (job_event("j", JobState.ENDED), "jobs.lifecycle", ["alpha"], 1.5, "alpha"),
    ],
)
def test_invalid_records_are_rejected_naming_the_field(record, topic, path, value, field):
    with pytest.raises(DecodeError) as exc:
        decode(BY_NAME[topic], _mutated(record, path, value))
    assert exc.value.field == field, exc.value


@pytest.mark.parametrize("bad", [b"NaN", b"Infinity", b"-Infinity", b"1e999"])
def test_non_finite_numbers_are_rejected(bad):
    raw = (b'{"kind":"power_reading","event_id":"p","source":"t","event_time":"2026-01-01T00:00:00Z",'
           b'"node":"n1","processor":0,"available":true,"watts":' + bad + b"}")
    with pytest.raises(DecodeError) as exc:
        decode(BY_NAME["node.power"], raw)
    assert exc.value.field == "watts"


def test_unavailable_power_carries_no_numbers():
    ok = PowerReading(event_id="p", source="t", event_time=T0, node="n", processor=1, available=False)
    assert ok.watts is None
    with pytest.raises(ValueError, match="watts"):
        PowerReading(event_id="p", source="t", event_time=T0, node="n", processor=1, available=False, watts=0.0)


def test_shutter_window_lone_job_is_not_paused():
    with pytest.raises(ValueError, match="lone job"):
        ShutterWindow(event_id="w", source="t", event_time=T0, node="n", cycle=1, lone_job="a",
                      paused_jobs=("a", "b"), start=T0, end=T0)


@pytest.mark.parametrize("raw", [b"", b"\x00\xff garbage", b'{"kind": "shutter_block"', b"[]", b"null"])
def test_garbage_is_a_decode_error_not_a_crash(raw):
    with pytest.raises(DecodeError):
        decode(BY_NAME["node.ipc"], raw)


def test_tombstone_is_a_decode_error():
    with pytest.raises(DecodeError, match="empty"):
        decode(BY_NAME["jobs.lifecycle"], None)


def test_json_schema_files_match_the_models():
    """Fails when a model changes without `nodeshare schemas export` being run."""
    files = {p.name: p.read_text() for p in schema_dir().glob("*.schema.json")}
    expected = rendered()
    assert sorted(files) == sorted(expected), "schema files added or missing: run `nodeshare schemas export`"
    drifted = [name for name, text in expected.items() if files[name] != text]
    assert not drifted, f"out of date: {drifted}; run `nodeshare schemas export`"
