"""pipeq: multiprocess pipeline-parallel training for PyTorch over ZeroMQ.

Layers, imports pointing down only::

    runner.py  (PipelineRunner)  ->  driver.py (process mode) | simulated.py (one process)
    worker.py  (event loop)      ->  interpreter.py -> stage.py (compute)
                                 ->  transport.py (ZeroMQ, queues) -> codec.py (bytes)
    schedules.py                     pure: actions as data, validation, dry run
"""

from .errors import CodecError, PipelineError, ScheduleError
from .runner import PipelineRunner
from .schedules import SCHEDULES, format_table

__all__ = ["PipelineRunner", "PipelineError", "ScheduleError", "CodecError", "SCHEDULES", "format_table"]
__version__ = "0.1.0"
