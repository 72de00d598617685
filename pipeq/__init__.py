"""pipeq: multiprocess pipeline-parallel training for PyTorch over ZeroMQ.

Layers, imports pointing down only (tests/test_layers.py checks it)::

    control plane  cli.py -> launch.py (pipeq launch: job.py files, checkpoints, metrics)
                             agent.py (node r > 0 of a multi-host run)
                   runner.py (PipelineRunner) -> options.py (checks), batching.py (microbatches,
                             loss weights) -> driver.py (process mode: supervisor.py watches
                             failures, tracing.py collects traces, processes.py starts stages,
                             rendezvous.py meets other hosts) | simulated.py (one process)
                   report.py, plot.py (reading traces)
    event loop     worker.py (one per stage process) -> interpreter.py (runs a stage's actions)
    compute        schedules.py, actions.py, dryrun.py (pure: actions as data, lowering, dry run),
                   executors.py -> stage.py, interlock.py, asyncpipe.py, al.py (forward, backward,
                   step), checkpoint.py (global names), dataparallel.py, trace.py (the trace format),
                   balance.py (pipeq.balance: per-layer costs measured, an optimal split into stages)
    transport      transport.py (ZeroMQ sockets, keyed queues; the only user of the codec)
    codec          codec.py (bytes), messages.py (kinds, Message), errors.py, netif.py
"""

import importlib
import importlib.abc
import importlib.util
import sys
from typing import Any

from pipeq.errors import CodecError, MainScriptError, PipelineError, ScheduleError
from pipeq.schedules import SCHEDULES, format_table

__all__ = ["PipelineRunner", "Recipe", "balance", "PipelineError", "MainScriptError", "ScheduleError", "CodecError",
           "SCHEDULES", "format_table"]
__version__ = "0.1.0"

# Imported on first use: ``import pipeq`` stays light (no torch), so that ``pipeq launch`` can start
# its fork server before it imports torch itself (pipeq.forkserver).
# ``balance`` is the module pipeq.balance, callable as its function balance() (see there).
_LAZY = {"PipelineRunner": ("control.runner", "PipelineRunner"), "Recipe": ("launch.job", "Recipe"),
         "rendezvous": ("control.rendezvous", None), "balance": ("balance", None)}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'pipeq' has no attribute {name!r}")
    module, attr = _LAZY[name]
    value = importlib.import_module(f"pipeq.{module}")
    value = getattr(value, attr) if attr else value
    globals()[name] = value
    return value


#: Modules that moved into the packages, by their earlier names: ``import pipeq.al`` (and job
#: files naming ``pipeq.resnet:stages``) get the module where it lives now.
MOVED = {
    "al": "research.al", "al_models": "research.al.models", "interlock": "research.interlock.executor",
    "asyncpipe": "research.async1f1b.executor", "resnet": "models.resnet", "rendezvous": "control.rendezvous",
    "evaluation": "control.evaluation", "job": "launch.job", "report": "trace.report", "plot": "trace.plot",
    "lr_schedulers": "stage.lr_schedulers", "microbatch": "stage.microbatch", "numerics": "stage.numerics",
    "dataparallel": "parallel.data", "tensorpar": "parallel.tensor", "actions": "schedules.actions",
    "dryrun": "schedules.dryrun", "bounds": "schedules.bounds", "shm": "wire.shm", "keys": "wire.keys",
}


class _Moved(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds ``pipeq.<earlier name>`` as the module it names now (the same module object)."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name.startswith("pipeq.") and name[6:] in MOVED:
            return importlib.util.spec_from_loader(name, self)
        return None

    def create_module(self, spec: Any) -> Any:
        return importlib.import_module("pipeq." + MOVED[spec.name[6:]])

    def exec_module(self, module: Any) -> None:
        pass


if not any(isinstance(f, _Moved) for f in sys.meta_path):
    sys.meta_path.append(_Moved())
