"""Research schedules, each a plug-in with its own executor: interlocking backprop, asynchronous 1F1B, Associated Learning.

They plug into the core through the schedule policy protocol
(:class:`pipeq.schedules.SchedulePolicy`) alone: importing this package registers them by name
in :data:`pipeq.schedules.SCHEDULES` (pipeq's own registry: ``import pipeq`` imports this
package, so ``"pairwise"`` or ``"al"`` work as schedule names) and offers their classes as
``pipeq.schedules.Interlock``, ``AsyncOneFOneB`` and ``AssociatedLearning``. Nothing outside this
package names them.

Its public names: the schedules (:class:`Interlock`, :class:`AsyncOneFOneB`,
:class:`AssociatedLearning`), interlocking's gradient routing (:func:`trained_by`,
:func:`sends_down`, :func:`receives`, :func:`sends_early`: with distance d, stage k's main module
is trained by the loss L_t(k), t(k) = min(k + d, N - 1), and stage k sends down the gradients of
the losses the stages below it are trained by), and Associated Learning's layers, builders,
one-process inference module and executor (:class:`ALLayer`, :func:`build_al`, :class:`ALModel`,
:class:`ALExecutor`...: torch, imported when first named here).
"""

import functools
from typing import TYPE_CHECKING

from pipeq.lazy import lazy_getattr
from pipeq.research.al.schedule import AssociatedLearning
from pipeq.research.async1f1b.schedule import AsyncCursor, AsyncOneFOneB
from pipeq.research.interlock.routing import receives, sends_down, sends_early, trained_by
from pipeq.research.interlock.schedule import INTERLOCK, Interlock
from pipeq.schedules.registry import NeedsOptions, register

if TYPE_CHECKING:  # what __getattr__ imports on first use, for type checkers and the API reference
    from pipeq.research.al.executor import ALExecutor
    from pipeq.research.al.models import (ALLayer, ALModel, LabelEmbedding, LastHiddenBridge, LSTMLayer,
                                          PooledBridge, TokenEmbedding, TransformerLayer, build_al, build_al_lstm,
                                          build_al_transformer, masked_mean)

#: Associated Learning's model code (torch), imported on first use: name -> its module.
_LAZY: dict[str, tuple[str, str | None]] = {**{name: ("pipeq.research.al.models", name) for name in (
    "ALLayer", "ALModel", "LabelEmbedding", "LastHiddenBridge", "LSTMLayer", "PooledBridge", "TokenEmbedding",
    "TransformerLayer", "build_al", "build_al_lstm", "build_al_transformer", "masked_mean")},
    "ALExecutor": ("pipeq.research.al.executor", "ALExecutor")}

__all__ = ["Interlock", "INTERLOCK", "AsyncOneFOneB", "AsyncCursor", "AssociatedLearning",
           "trained_by", "sends_down", "receives", "sends_early",
           "ALLayer", "build_al", "build_al_lstm", "build_al_transformer", "ALModel", "LabelEmbedding",
           "TokenEmbedding", "PooledBridge", "LSTMLayer", "LastHiddenBridge", "TransformerLayer", "masked_mean",
           "ALExecutor"]


__getattr__ = lazy_getattr(__name__, _LAZY, globals())


_EXPORTS = {"Interlock": Interlock, "INTERLOCK": INTERLOCK, "AsyncOneFOneB": AsyncOneFOneB, "AsyncCursor": AsyncCursor,
            "AssociatedLearning": AssociatedLearning, "trained_by": trained_by, "sends_down": sends_down,
            "receives": receives, "sends_early": sends_early}
for _kind in ("global", "local", "pairwise"):
    register(_kind, Interlock(_kind), exports=_EXPORTS)
register("nwise", NeedsOptions("nwise", "distance", "pipeq.schedules.Interlock('nwise', distance=d)",
                               functools.partial(Interlock, "nwise"), takes_aux_heads=True,
                               job_example='{ name = "nwise", distance = 2 }'))
register("async", AsyncOneFOneB())
register("al", AssociatedLearning())
