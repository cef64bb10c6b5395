"""The one serializer: JSON, for every topic, the archive, the ledger and the worker's state."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ValidationError

from .catalog import TOPIC_OF_RECORD, TopicSpec, adapter


class DecodeError(ValueError):
    """Bytes that are not a valid record of the topic. ``field`` names the offending field."""

    def __init__(self, reason: str, field: str | None = None) -> None:
        super().__init__(f"{field}: {reason}" if field else reason)
        self.reason = reason
        self.field = field


def encode(record: BaseModel) -> bytes:
    return record.model_dump_json().encode()


def decode(spec: TopicSpec, raw: bytes | None) -> Any:
    """Validate raw bytes as the topic's value model, or raise DecodeError naming the field."""
    if raw is None:
        raise DecodeError("empty message (tombstone) on a topic that carries records")
    try:
        return adapter(spec).validate_json(raw)
    except ValidationError as exc:
        raise _as_decode_error(exc) from None


def decode_model(model: type[BaseModel], raw: bytes) -> Any:
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        raise _as_decode_error(exc) from None


def _as_decode_error(exc: ValidationError) -> DecodeError:
    err = exc.errors(include_url=False)[0]
    # Drop discriminator tags (e.g. 'shutter_block') so the location reads as a field path.
    loc = [str(p) for p in err.get("loc", ()) if not (isinstance(p, str) and p in _KIND_TAGS)]
    field = ".".join(loc) or None
    if err["type"] == "json_invalid":
        return DecodeError(f"invalid JSON: {err['msg']}")
    msg = err["msg"].removeprefix("Value error, ")
    if field is None and ": " in msg and msg.split(": ", 1)[0].isidentifier():
        field, msg = msg.split(": ", 1)  # model-level checks name their field as 'field: why'
    return DecodeError(msg, field)


#: The discriminator tags of every record type, derived from the catalog.
_KIND_TAGS = frozenset(rt.model_fields["kind"].default for rt in TOPIC_OF_RECORD)
