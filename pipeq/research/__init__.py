"""Research schedules, each a plug-in with its own executor: interlocking backprop, asynchronous 1F1B, Associated Learning.

They plug into the core through the schedule policy protocol
(:class:`pipeq.schedules.SchedulePolicy`) alone: importing this package registers them by name
in :data:`pipeq.schedules.SCHEDULES` and offers their classes as ``pipeq.schedules.Interlock``,
``AsyncOneFOneB`` and ``AssociatedLearning``. Nothing outside this package names them.
"""

import functools

from pipeq.research.al.schedule import AssociatedLearning
from pipeq.research.async1f1b.schedule import AsyncCursor, AsyncOneFOneB
from pipeq.research.interlock import routing as interlock
from pipeq.research.interlock.schedule import INTERLOCK, Interlock
from pipeq.schedules.registry import NeedsOptions, register

__all__ = ["Interlock", "AsyncOneFOneB", "AsyncCursor", "AssociatedLearning", "INTERLOCK"]

_EXPORTS = {"Interlock": Interlock, "INTERLOCK": INTERLOCK, "AsyncOneFOneB": AsyncOneFOneB, "AsyncCursor": AsyncCursor,
            "AssociatedLearning": AssociatedLearning, "trained_by": interlock.trained_by,
            "sends_down": interlock.sends_down, "receives": interlock.receives, "sends_early": interlock.sends_early}
for _kind in ("global", "local", "pairwise"):
    register(_kind, Interlock(_kind), exports=_EXPORTS)
register("nwise", NeedsOptions("nwise", "distance", "pipeq.schedules.Interlock('nwise', distance=d)",
                               functools.partial(Interlock, "nwise"), takes_aux_heads=True,
                               job_example='{ name = "nwise", distance = 2 }'))
register("async", AsyncOneFOneB())
register("al", AssociatedLearning())
