"""A stage process's settings in the OS: its name, its cores and threads, its timers, its parent.

Linux only where it says so (prctl through libc); elsewhere each is a no-op.
"""

from __future__ import annotations

import ctypes
import os
import signal
from typing import Sequence

import torch

__all__ = ["die_with_parent", "tight_timers", "set_name", "can_watch", "pin_cpu"]


def die_with_parent() -> None:
    """Linux: get SIGKILL when the process that started us exits (no orphans)."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:  # not glibc/Linux: the heartbeat thread's parent watch still applies
        pass


def tight_timers() -> None:
    """Linux: wake this process's timed waits (a stage's sleeps, poll time-outs) on time, not up
    to 50 us late (the default timer slack, which lets the kernel batch wake-ups)."""
    try:
        ctypes.CDLL("libc.so.6").prctl(29, 1, 0, 0, 0)  # PR_SET_TIMERSLACK: 1 ns
    except OSError:
        pass


def set_name(name: str) -> None:
    """Linux: the process's name in ps -o comm and top (its first 15 bytes)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME
    except OSError:
        pass


def can_watch(pid: int) -> bool:
    """Whether this kernel gives pidfds, with which the heartbeat thread sees the driver exit."""
    try:
        os.close(os.pidfd_open(pid or os.getppid()))  # type: ignore[attr-defined]
        return True
    except (AttributeError, OSError):
        return False


def pin_cpu(cores: Sequence[int], threads: int) -> None:
    """Pin this process to ``cores`` (all, when empty) and run torch on ``threads`` threads."""
    if cores and hasattr(os, "sched_setaffinity"):
        try:
            os.sched_setaffinity(0, cores)
        except OSError:
            pass
    torch.set_num_threads(max(1, threads))
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:  # already set (e.g. torch used before we got here)
        pass
