"""The driver side's one way of waiting for something that has no event to wait on, and every
grace period it waits with, named here with its reason.

:func:`wait_until` polls a condition until it holds or a timeout passes; between two looks it
runs ``between`` (read a socket for up to the time left, drain what the stages sent) or sleeps
:data:`POLL_S`. A grace period is how long the driver waits for something that usually comes
at once but may lag a moment: waiting longer only delays a failure's report, waiting shorter
loses the better message. (The stage side's waits are :meth:`pipeq.wire.inbox.Inbox.wait`'s
spin-then-idle.)
"""

from __future__ import annotations

import time
from typing import Callable

__all__ = ["POLL_S", "ERROR_IN_FLIGHT_S", "SHARD_CAUSE_S", "LOST_REPLICA_DRAIN_S", "EXIT_S", "KILLED_EXIT_S",
           "AGENT_EXIT_S", "AGENT_ABORT_S", "THREAD_STOP_S", "wait_until"]

#: how often a condition with nothing to read between looks is looked at again
POLL_S = 0.05
#: the ERROR a stage sent just before it exited: it names a failure better than the exit, or the
#: gone socket, that revealed it
ERROR_IN_FLIGHT_S = 0.5
#: a shard of a tensor-parallel group fails because another shard was killed: the killed one's
#: sockets close a moment before it is reaped, so the first failure waits this long for its cause
SHARD_CAUSE_S = 0.5
#: what a lost replica's processes sent before they died: read and ignored before it is rebuilt
LOST_REPLICA_DRAIN_S = 0.2
#: stage processes told to EXIT: each leaves at once, unless it is past saving (then it is killed)
EXIT_S = 5.0
#: a SIGKILLed process: the kernel frees it within milliseconds; this long means it is stuck in the
#: kernel (uninterruptible I/O) and is left to it
KILLED_EXIT_S = 5.0
#: a node agent's stages after the driver's EXIT: a normal end (they save nothing more, but may
#: still be flushing a trace) and after a failure (the driver has stopped them already)
AGENT_EXIT_S = 10.0
AGENT_ABORT_S = 2.0
#: a helper thread told to stop (the rendezvous republisher): it looks at its flag this often
THREAD_STOP_S = 2.0


def wait_until(done: Callable[[], object], timeout: float, between: Callable[[float], object] | None = None) -> bool:
    """Look at ``done()`` until it is true (True) or ``timeout`` seconds have passed (False, after
    one last look). ``between(left)``: what to do between two looks, for at most ``left`` seconds
    (default: sleep :data:`POLL_S`, or what is left)."""
    end = time.monotonic() + timeout
    while True:
        if done():
            return True
        left = end - time.monotonic()
        if left <= 0:
            return bool(done())
        if between is not None:
            between(left)
        else:
            time.sleep(min(POLL_S, left))
