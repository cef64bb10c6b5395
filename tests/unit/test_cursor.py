"""The stream worker's cursor: messages faust skipped are read back, in order, exactly once."""

from __future__ import annotations

import asyncio

import pytest

from nodeshare.runtime.config import Settings
from nodeshare.streams.core.accounting import Message, Origin
from nodeshare.streams.worker import cursor as cursor_module
from nodeshare.streams.worker.cursor import Cursor

TOPIC = "node.ipc"


def _msg(offset: int, partition: int = 0) -> Message:
    return (Origin(TOPIC, partition, offset), b"j", f"v{offset}".encode(), 0.0)


@pytest.fixture
def broker(monkeypatch: pytest.MonkeyPatch) -> dict[str, object]:
    """The partition's content and committed offset as the broker would answer them (the cursor's
    two reads); records which ranges were read back."""
    state: dict[str, object] = {"log": [_msg(o) for o in range(100)], "committed": 0, "reads": []}

    def read_range(settings, topic, partition, start, stop, timeout_s=60.0, verifier=None):
        state["reads"].append((start, stop))  # type: ignore[attr-defined]
        return [m for m in state["log"] if start <= m[0].offset < stop]  # type: ignore[attr-defined]

    def committed_offsets(settings, positions):
        return {p: state["committed"] for p in positions}

    monkeypatch.setattr(cursor_module, "read_range", read_range)
    monkeypatch.setattr(cursor_module, "committed_offsets", committed_offsets)
    return state


def _run(deliveries: list[int], broker: dict[str, object], start: int = 0, committed: int | None = None,
         ) -> tuple[list[int], Cursor]:
    handled: list[int] = []

    async def handle(m: Message) -> None:
        handled.append(m[0].offset)

    async def go() -> Cursor:
        c = Cursor(Settings.model_construct(bootstrap="unused:9092"), "job-accounting", handle)
        c.start(TOPIC, 0, start)
        for offset in deliveries:
            async with c.lock:
                await c.deliver(_msg(offset))
        if committed is not None:
            broker["committed"] = committed
            await c.tail()
        return c

    return handled, asyncio.run(go())


def test_contiguous_delivery_reads_nothing_back(broker: dict[str, object]) -> None:
    handled, c = _run([0, 1, 2, 3], broker)
    assert handled == [0, 1, 2, 3]
    assert broker["reads"] == [] and c.refetched == 0


def test_skipped_offsets_are_read_back_before_the_message(broker: dict[str, object]) -> None:
    """The measured faust behaviour: after a restart, 3 then 40 were delivered; 4..39 were acked unseen."""
    handled, c = _run([3, 40, 41], broker, start=3)
    assert handled == [3, *range(4, 40), 40, 41]
    assert broker["reads"] == [(4, 40)] and c.refetched == 36


def test_redelivered_messages_are_dropped(broker: dict[str, object]) -> None:
    """After a rebalance faust re-sends from the committed offset: already handled here, so skipped."""
    handled, _ = _run([0, 1, 2, 1, 2, 3], broker)
    assert handled == [0, 1, 2, 3]


def test_skipped_tail_is_found_from_the_committed_offset(broker: dict[str, object]) -> None:
    """Nothing comes after the skipped messages, but the group committed past them."""
    handled, c = _run([0, 1], broker, committed=10)
    assert handled == list(range(10))
    assert c.next[(TOPIC, 0)] == 10 and c.refetched == 8


def test_tail_does_nothing_when_the_agent_is_ahead(broker: dict[str, object]) -> None:
    handled, c = _run([0, 1, 2], broker, committed=2)
    assert handled == [0, 1, 2] and broker["reads"] == [] and c.next[(TOPIC, 0)] == 3


def test_forgotten_partitions_are_not_repaired(broker: dict[str, object]) -> None:
    """After a rebalance the partition may belong to another worker: no tail read until it is started again."""
    handled: list[int] = []

    async def handle(m: Message) -> None:
        handled.append(m[0].offset)

    async def go() -> None:
        c = Cursor(Settings.model_construct(bootstrap="unused:9092"), "job-accounting", handle)
        c.start(TOPIC, 0, 0)
        c.forget()
        broker["committed"] = 50
        assert await c.tail() == 0
        assert not c.knows(TOPIC, 0)

    asyncio.run(go())
    assert handled == [] and broker["reads"] == []
