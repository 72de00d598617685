"""Bounded, keyed queues: where a stage process files the messages that arrive, whatever their order.

Arriving messages are filed in a :class:`KeyedQueue` under their key (``(step, microbatch)`` on
a stage's data channels, ``(sender, step, index)`` on a group link), so the order in which they
arrive does not matter, and the queue's capacity bounds what a process may hold.
"""

from __future__ import annotations

from typing import Any, Callable, Generic, Hashable, Iterator, TypeVar

from pipeq.wire.errors import ProtocolError

__all__ = ["KeyedQueue"]

T = TypeVar("T")


def _step_microbatch(key: Any) -> str:
    return f"for step {key[0]} microbatch {key[1]}"


class KeyedQueue(Generic[T]):
    """A bounded map ``key -> item``; arrival order does not matter. ``describe(key)`` says which
    message a key is, in errors (default: ``for step s microbatch j``)."""

    __slots__ = ("name", "capacity", "_items", "_describe")

    def __init__(self, name: str, capacity: int, describe: Callable[[Any], str] = _step_microbatch) -> None:
        self.name = name
        self.capacity = capacity
        self._items: dict[Hashable, T] = {}
        self._describe = describe

    def put(self, key: Hashable, item: T) -> None:
        if key in self._items:
            raise ProtocolError(f"{self.name} queue: duplicate message {self._describe(key)}")
        if len(self._items) >= self.capacity:
            raise ProtocolError(
                f"{self.name} queue is full ({self.capacity} messages); a peer is running ahead "
                "of the schedule"
            )
        self._items[key] = item

    def pop(self, key: Hashable) -> T | None:
        return self._items.pop(key, None)

    def discard(self, keep: Callable[[Any], bool]) -> None:
        """Drop every item whose key ``keep`` refuses."""
        for key in [k for k in self._items if not keep(k)]:
            del self._items[key]

    def __contains__(self, key: Hashable) -> bool:
        return key in self._items

    def __iter__(self) -> Iterator[Hashable]:
        return iter(list(self._items))

    def __len__(self) -> int:
        return len(self._items)
