"""``auto_memory_limit``: how much memory each stage process may hold, for ``schedule="auto"``.

A limit is given in bytes (an integer, or a string with a unit: ``"8GiB"``, ``"512 MiB"``,
``"1.5GB"``; binary units are powers of 2, decimal ones powers of 10), or as a fraction of the
device (a float in (0, 1], or ``"80%"``). :func:`parse` checks it when the run is configured;
:func:`per_process` turns it into bytes for each stage process once the devices are known. A
fraction is of the device's whole memory (a CUDA device's ``total_memory``; on the CPU the host's
physical memory), shared equally by the run's processes on that device: 0.8 of a 80 GB GPU that
two processes share leaves each 32 GB.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any, Sequence

from pipeq.schedules.memory import size

__all__ = ["MemoryLimitError", "MemoryLimit", "parse", "check_setting", "device_bytes", "per_process"]

UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
         "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_FORM = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*|%)\s*$", re.IGNORECASE)
_HOW = ('give bytes (an integer, or a string such as "8GiB", "512MiB", "1.5GB") or a fraction of the '
        'device (a float in (0, 1], or a string such as "80%")')


class MemoryLimitError(ValueError):
    """No schedule fits ``auto_memory_limit`` (or the limit cannot be applied to this run)."""


@dataclass(frozen=True)
class MemoryLimit:
    """A parsed limit: ``bytes`` per process, or a ``fraction`` of the device (one of the two)."""

    bytes: int | None = None
    fraction: float | None = None

    def __str__(self) -> str:
        return size(self.bytes) if self.bytes is not None else f"{100 * self.fraction:g}% of the device"


def parse(value: Any) -> MemoryLimit:
    """``value`` as a :class:`MemoryLimit`; a ``ValueError`` naming the setting and the forms it takes."""
    bad = ValueError(f"auto_memory_limit={value!r}: {_HOW}")
    if isinstance(value, bool):
        raise bad
    if isinstance(value, int):
        if value <= 0:
            raise bad
        return MemoryLimit(bytes=value)
    if isinstance(value, float):
        if not 0 < value <= 1:
            raise ValueError(f"auto_memory_limit={value!r}: a float is a fraction of the device, in (0, 1]; "
                             'for bytes give an integer or a string such as "8GiB"')
        return MemoryLimit(fraction=value)
    if not isinstance(value, str) or not (m := _FORM.match(value)):
        raise bad
    number, unit = float(m.group(1)), m.group(2).lower()
    if unit == "%":
        return parse(number / 100)
    if unit not in UNITS or number <= 0:
        raise bad
    return MemoryLimit(bytes=int(number * UNITS[unit]))


def check_setting(value: Any, auto: bool, placement: Any) -> None:
    """The setting checked against the run (its ``schedule`` is ``"auto"``; its ``placement``
    lets auto profile the stages in one process), when the run is configured."""
    parse(value)
    if not auto:
        raise ValueError(f"auto_memory_limit={value!r} is for schedule='auto', which chooses the schedule by "
                         "it; this run's schedule is given")
    if placement.data_parallel > 1 or placement.tensor_parallel > 1:
        from pipeq.compat import refusal

        said = ", ".join(f"{name}={getattr(placement, name)}" for name in ("data_parallel", "tensor_parallel")
                         if getattr(placement, name) > 1)
        raise ValueError(f"auto_memory_limit={value!r} with {said}: " + refusal("auto-limit-parallel").message())


def device_bytes(device: str) -> int:
    """The whole memory of ``device``: a CUDA device's ``total_memory``, or the host's physical memory."""
    import torch

    dev = torch.device(device)
    if dev.type == "cuda":
        return int(torch.cuda.get_device_properties(dev.index or 0).total_memory)
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def per_process(limit: MemoryLimit, devices: Sequence[str]) -> list[int]:
    """The bytes each process may hold, given each process's device (``devices[p]``): the limit
    itself, or its fraction of the device divided among the processes that share the device."""
    if limit.bytes is not None:
        return [limit.bytes] * len(devices)
    assert limit.fraction is not None
    sharing = {d: sum(1 for e in devices if e == d) for d in devices}
    return [int(limit.fraction * device_bytes(d) / sharing[d]) for d in devices]

