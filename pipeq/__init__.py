"""pipeq: multiprocess pipeline-parallel training for PyTorch over ZeroMQ.

Layers, imports pointing down only::

    cli.py -> launch.py (pipeq launch: job.py files, checkpoints, metrics) | agent.py (node r > 0)
    runner.py  (PipelineRunner)  ->  driver.py (process mode) | simulated.py (one process)
                                     rendezvous.py (multi-host: TCPStore, placement)
    worker.py  (event loop)      ->  interpreter.py -> stage.py (compute)
                                 ->  transport.py (ZeroMQ, queues) -> codec.py (bytes)
    schedules.py                     pure: actions as data, validation, dry run
    checkpoint.py                    files: global names, re-split across stage counts
"""

from . import rendezvous
from .errors import CodecError, PipelineError, ScheduleError
from .job import Recipe
from .runner import PipelineRunner
from .schedules import SCHEDULES, format_table

__all__ = ["PipelineRunner", "Recipe", "PipelineError", "ScheduleError", "CodecError", "SCHEDULES", "format_table"]
__version__ = "0.1.0"
