"""Job files for tests that launch in this process (not a test module): a tiny job of
launch_jobs.py's functions, written where a test wants it, and ``pipeq launch`` of it."""

from __future__ import annotations

import os

from launch_util import SUPPORT

#: the MLP job of launch_jobs.py (stages, data, evaluation); a test adds its own keys
MLP = """\
stages = "launch_jobs:mlp_stages"
loss = "torch.nn:CrossEntropyLoss"
optimizer = "torch.optim:SGD"
optimizer_args = { lr = 0.1 }
data = "launch_jobs:train_batches"
eval_data = "launch_jobs:heldout"
microbatches = 2
"""
#: the same job with momentum and 4 microbatches (the job-schedule and streaming tests')
MLP_MOMENTUM = MLP.replace("{ lr = 0.1 }", "{ lr = 0.1, momentum = 0.9 }").replace("microbatches = 2", "microbatches = 4")


def write(directory, text: str, name: str = "job") -> str:
    """``text`` as the job file ``directory/name.toml``; its path."""
    path = os.path.join(str(directory), f"{name}.toml")
    with open(path, "w") as f:
        f.write(text)
    return path


def launch_code(job: str, *args: str) -> int:
    """``pipeq launch job`` in this process, from tests/support/; its exit code."""
    from pipeq.launch.cli import main as pipeq_main

    cwd = os.getcwd()
    os.chdir(SUPPORT)  # launch_jobs.py is found through the job's search path (the current folder)
    try:
        return pipeq_main(["launch", job, "--quiet", "--threads-per-stage", "1", *args])
    finally:
        os.chdir(cwd)


def launch(job: str, *args: str) -> None:
    assert launch_code(job, *args) == 0
