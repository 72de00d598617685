"""Associated Learning (Kao and Chen, Neural Computation 2021; Wu et al., ICLR 2022): local losses, messages that flow forward only.

The schedule (:class:`AssociatedLearning`) is imported with :mod:`pipeq.research`; the layers,
builders and executor (torch) when first named here (``pipeq.research.al.build_al``, which
``pipeq.al.build_al`` also names).
"""

import importlib
from typing import Any

from pipeq.research.al.schedule import AssociatedLearning

__all__ = ["AssociatedLearning", "ALExecutor", "ALLayer", "ALModel", "LabelEmbedding", "LastHiddenBridge",
           "LSTMLayer", "PooledBridge", "TokenEmbedding", "TransformerLayer", "build_al", "build_al_lstm",
           "build_al_transformer"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        value = getattr(importlib.import_module("pipeq.research.al.executor"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'pipeq.research.al' has no attribute {name!r}")
