"""pipeq: multiprocess pipeline-parallel training for PyTorch over ZeroMQ.

The public API is this package's ``__all__`` and that of the public modules below it:
:mod:`pipeq.schedules`, :mod:`pipeq.research`, :mod:`pipeq.split`, :mod:`pipeq.balance`,
:mod:`pipeq.checkpoint`, :mod:`pipeq.trace`, :mod:`pipeq.models.resnet` and :mod:`pipeq.testing`
(docs/reference/api.md documents each of their names; pipeq.launch.reference.FRONTS lists them).
Everything else is pipeq's own and may change. ``import pipeq`` imports no torch and changes
nothing outside pipeq (see docs/architecture.md).

The folders are the layers; imports point down only (tests/unit/test_layers.py checks it, and
docs/architecture.md lists every module with its job)::

    control plane  launch/     pipeq launch: cli.py, job files (job/keys.py: the one table of keys),
                               the training loop (trainer.py, loop.py...), node agents (agent.py)
                   control/    runner.py (PipelineRunner, a facade over collaborators: lifecycle.py,
                               feed.py, streaming.py, state.py, snapshots.py, reports.py,
                               shape_check.py, assembly.py), config.py (RunConfig: every setting, built and checked
                               once), checks.py, ties.py; process mode: driver.py, startup.py,
                               processes.py (what each stage process is told, from the RunConfig),
                               supervisor.py, rendezvous.py, trace_collector.py
                   trace/      report.py, plot.py, advice.py: reading traces
    event loop     runtime/    a stage process holds v >= 1 stages (its chunks): worker.py (its
                               entry), loop.py (its event loop), interpreter.py (its actions, over
                               every chunk; requests.py: what it asks of the loop), config.py (what
                               it is told), links.py (replicas and tie peers); simulated.py (every
                               planned process in one, on the same interpreter), backend.py (the
                               Backend protocol), executors.py, faults.py (failures on purpose)
    compute        schedules/  pure: actions as data, the schedule policy protocol (protocol.py), the
                               registry, lowering, dry runs, bounds; placement.py (virtual stages);
                               zero_bubble.py (ZB-H1, ZB-H2, ZBV), interleaved.py, dualpipe.py
                   research/   plug-in schedules with their executors: interlock/, async1f1b/, al/
                   stage/      one stage's compute: executor.py (the forward) and its collaborators,
                               backprop.py (the backward, whole or split), step.py (the optimizer
                               step), state.py; numerics, microbatches, lr, info.py (what a stage
                               says of itself), tied weights: declared (tie_groups.py), their
                               gradients (ties.py); transfer.py (the one ordered sum)
                   parallel/   one mesh per stage (mesh.py: replicate x shard x tp, torch process
                               groups), its layers on a stage's compute (layers.py): replicas'
                               sums (data.py, membership.py when one is lost), FSDP2 (fsdp.py),
                               tensor parallelism (tensor.py); tied weights' exchange (ties.py)
                   checkpoint/ global names, snapshots, atomic writes, re-splitting, export
                   models/     ready-made staged models (ResNets with auxiliary heads)
                   split/      pipeq.split: a whole model cut into stages, traced (torch.export and
                               torch.distributed.pipelining's splitter) or by module names; tied weights
                   trace/      format.py: the trace file every stage's timeline is written in
                   balance.py (pipeq.balance: an optimal split of an nn.Sequential),
                   testing.py (stages of known cost), compat.py (the one table of what does not
                   run together, and why)
    transport      wire/       a process's transport (transport.py) and its one receiving loop
                               (inbox.py); each stage's receiving and sending halves (stage_inbox.py,
                               stage_link.py); links to the driver, tie peers and shards;
                               shared memory, lanes, sockets, security
    codec          wire/       codec.py (bytes), messages.py (kinds, Message), control.py (typed
                               command and reply payloads; fields.py: what each field must be),
                               keys.py, netif.py;
                   errors.py, tree.py (nested values), lazy.py (names imported on first use)
"""

from typing import TYPE_CHECKING

from pipeq.errors import CodecError, MainScriptError, PipelineError, ScheduleError
from pipeq.schedules import SCHEDULES, format_table
from pipeq import research  # noqa: F401  (registers the research schedules in pipeq.schedules.SCHEDULES)
from pipeq.lazy import lazy_getattr

if TYPE_CHECKING:  # what __getattr__ imports on first use, for type checkers and the API reference
    from pipeq import balance, split
    from pipeq.control.config import FaultConfig, NumericsConfig, PlacementConfig, RunConfig, WireConfig
    from pipeq.control.rendezvous import Rendezvous
    from pipeq.control.reports import StageMemory
    from pipeq.control.runner import PipelineRunner
    from pipeq.launch.csv_schedule import from_csv, to_csv
    from pipeq.launch.job.load import load_job
    from pipeq.launch.job.recipe import Recipe
    from pipeq.launch.job.spec import Job
    from pipeq.stage.executor import StageExecutor
    from pipeq.stage.info import StageInfo, Tie, info_of, set_info
    from pipeq.stage.lr_schedulers import LRSchedule
    from pipeq.stage.microbatch import Microbatches

#: The public API: this package's names, and the public subpackages' (docs/reference/api.md
#: documents them all; the folders below them are pipeq's own, and may change).
__all__ = [
    "PipelineRunner", "Microbatches", "StageMemory", "RunConfig", "NumericsConfig", "WireConfig", "FaultConfig", "PlacementConfig",
    "StageInfo", "Tie", "set_info", "info_of", "LRSchedule", "StageExecutor",
    "split", "balance", "Recipe", "Job", "load_job", "Rendezvous", "from_csv", "to_csv",
    "SCHEDULES", "format_table", "PipelineError", "MainScriptError", "ScheduleError", "CodecError",
]
__version__ = "0.1.0"

# Imported on first use: ``import pipeq`` stays light (no torch), so that ``pipeq launch`` can start
# its fork server before it imports torch itself (pipeq.control.forkserver). Name -> (module, the
# name there; None: the module itself). ``balance`` and ``split`` are the modules pipeq.balance and
# pipeq.split, callable as their main functions (see there).
_LAZY: dict[str, tuple[str, str | None]] = {
    "PipelineRunner": ("pipeq.control.runner", "PipelineRunner"),
    "StageMemory": ("pipeq.control.reports", "StageMemory"),
    **{name: ("pipeq.control.config", name) for name in
       ("RunConfig", "NumericsConfig", "WireConfig", "FaultConfig", "PlacementConfig")},
    **{name: ("pipeq.stage.info", name) for name in ("StageInfo", "Tie", "set_info", "info_of")},
    "LRSchedule": ("pipeq.stage.lr_schedulers", "LRSchedule"),
    "Microbatches": ("pipeq.stage.microbatch", "Microbatches"),
    "StageExecutor": ("pipeq.stage.executor", "StageExecutor"),
    "Recipe": ("pipeq.launch.job.recipe", "Recipe"), "Job": ("pipeq.launch.job.spec", "Job"),
    "load_job": ("pipeq.launch.job.load", "load_job"),
    "Rendezvous": ("pipeq.control.rendezvous", "Rendezvous"),
    "from_csv": ("pipeq.launch.csv_schedule", "from_csv"), "to_csv": ("pipeq.launch.csv_schedule", "to_csv"),
    "balance": ("pipeq.balance", None), "split": ("pipeq.split", None),
}
__getattr__ = lazy_getattr(__name__, _LAZY, globals())


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
