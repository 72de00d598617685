"""pipeq: multiprocess pipeline-parallel training for PyTorch over ZeroMQ.

The folders are the layers; imports point down only (tests/unit/test_layers.py checks it)::

    control plane  launch/     pipeq launch: cli.py, job files (job/keys.py: the one table of keys),
                               the training loop (trainer.py, loop.py...), node agents (agent.py)
                   control/    runner.py (PipelineRunner), config.py (RunConfig: every setting, built
                               and checked once), checks.py, ties.py, batching.py, streaming.py,
                               stage_inputs.py; process mode: driver.py, startup.py, supervisor.py,
                               processes.py, rendezvous.py, trace_collector.py
                   trace/      report.py, plot.py: reading traces
    event loop     runtime/    worker.py (one per stage process; batch_command.py: what a command
                               carries), interpreter.py (runs a stage's actions), simulated.py (every
                               stage in one process), executors.py, links.py (a stage process's
                               replicas and tie peers); a process of several stages: group.py (its
                               event loop), chunks.py (its actions, handed over in memory);
                               faults.py (PIPEQ_FAULT: failures injected on purpose)
    compute        schedules/  pure: actions as data, the schedule policy protocol (protocol.py), the
                               registry, lowering, dry runs, bounds; placement.py (virtual stages);
                               zero_bubble.py, zb_h2.py, interleaved.py, zbv.py, dualpipe.py
                   research/   plug-in schedules with their executors: interlock/, async1f1b/, al/
                   stage/      one stage's forward, backward (whole or split: backprop.py) and step;
                               numerics, microbatches, lr, what a stage says of itself (info.py),
                               tied weights: declared (tie_groups.py), their gradients (ties.py)
                   parallel/   data parallelism (replicas), tensor parallelism (shards), tied
                               weights' exchange between stage processes (ties.py)
                   checkpoint/ global names, snapshots, atomic writes, re-splitting
                   models/     ready-made staged models (ResNets with auxiliary heads)
                   split/      pipeq.split: a whole model cut into stages, traced (torch.export and
                               torch.distributed.pipelining's splitter) or by module names; tied weights
                   trace/      format.py: the trace file every stage's timeline is written in
                   balance.py (pipeq.balance: an optimal split of an nn.Sequential),
                   testing.py (stages of known cost)
    transport      wire/       ZeroMQ links (stage, control, replica and tie: group, shard), shared memory, lanes,
                               security, sockets; inbox_group.py (a process's stages' inboxes drained as one)
    codec          wire/       codec.py (bytes), messages.py (kinds, Message), control.py (typed
                               command and reply payloads; fields.py: what each field must be),
                               keys.py, netif.py;
                   errors.py, tree.py (nested values)
"""

import importlib
import importlib.abc
import importlib.util
import sys
from typing import TYPE_CHECKING, Any

from pipeq.errors import CodecError, MainScriptError, PipelineError, ScheduleError, install_excepthook
from pipeq.schedules import SCHEDULES, format_table
from pipeq import research  # noqa: F401  (registers the research schedules)

if TYPE_CHECKING:  # what __getattr__ imports on first use, for type checkers and the API reference
    from pipeq import balance, split
    from pipeq.control.runner import PipelineRunner
    from pipeq.launch.job.recipe import Recipe

__all__ = ["PipelineRunner", "Recipe", "balance", "split", "PipelineError", "MainScriptError", "ScheduleError", "CodecError",
           "SCHEDULES", "format_table"]
__version__ = "0.1.0"

install_excepthook()  # an uncaught stage error's first line is the error (pipeq.errors.excepthook)

# Imported on first use: ``import pipeq`` stays light (no torch), so that ``pipeq launch`` can start
# its fork server before it imports torch itself (pipeq.forkserver).
# ``balance`` and ``split`` are the modules pipeq.balance and pipeq.split, callable as their main
# functions (see there).
_LAZY = {"PipelineRunner": ("control.runner", "PipelineRunner"), "Recipe": ("launch.job", "Recipe"),
         "rendezvous": ("control.rendezvous", None), "balance": ("balance", None),
         "split": ("split", None)}


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
