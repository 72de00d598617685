"""Bounded, keyed queues: where a stage files the data messages that arrive, whatever their order.

Arriving data messages are filed in a :class:`KeyedQueue` under ``(step, microbatch)``, so the
order in which they arrive does not matter, and the queue's capacity bounds what a stage may hold.
"""

from __future__ import annotations

from pipeq.wire.errors import ProtocolError
from pipeq.wire.messages import Message

__all__ = ["KeyedQueue"]


class KeyedQueue:
    """A bounded map ``(step, microbatch) -> Message``; arrival order does not matter."""

    __slots__ = ("name", "capacity", "_items")

    def __init__(self, name: str, capacity: int) -> None:
        self.name = name
        self.capacity = capacity
        self._items: dict[tuple[int, int], Message] = {}

    def put(self, msg: Message) -> None:
        key = (msg.step, msg.microbatch)
        if key in self._items:
            raise ProtocolError(f"{self.name} queue: duplicate message for step {key[0]} microbatch {key[1]}")
        if len(self._items) >= self.capacity:
            raise ProtocolError(
                f"{self.name} queue is full ({self.capacity} messages); a peer is running ahead "
                "of the schedule"
            )
        self._items[key] = msg

    def pop(self, step: int, microbatch: int) -> Message | None:
        return self._items.pop((step, microbatch), None)

    def __len__(self) -> int:
        return len(self._items)
