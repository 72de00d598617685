"""The tensor-parallel job file (T=2 over three stages) and ``pipeq launch`` of it in this process."""

from __future__ import annotations

import os

from launch_util import SUPPORT

JOB = """\
stages = "launch_jobs:mlp_stages"
loss = "torch.nn:CrossEntropyLoss"
optimizer = "torch.optim:SGD"
optimizer_args = { lr = 0.1, momentum = 0.9 }
data = "launch_jobs:train_batches"
microbatches = 4
steps = 6
seed = 0
tensor_parallel = 2
tp_plan = [{ "0" = "colwise" }, { "0" = "rowwise" }, {}]
"""


def _launch(job: str, out: str, *args: str) -> list[str]:
    return ["launch", job, "--quiet", "--threads-per-stage", "1", "--out", out, *args]


def _in_tests(argv: list[str]) -> int:
    """``pipeq launch`` in this process, from tests/support/ (where the job's modules are)."""
    from pipeq.launch.cli import main

    cwd = os.getcwd()
    os.chdir(SUPPORT)
    try:
        return main(argv)
    finally:
        os.chdir(cwd)
