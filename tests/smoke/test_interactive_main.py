"""Runs where people try things (issue 30): a script piped in with ``python -`` and a notebook
kernel, whose ``__main__`` has no file the stage processes could run again. What it defines (here
a stage class) reaches them by value, and the run trains as from a script."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository

#: the README's example, small: a stage class defined in __main__, two steps, one thread a stage
SCRIPT = """\
import functools, torch
from torch import nn
import pipeq


class Doubled(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 4)

    def forward(self, x):
        return self.lin(x) * 2


stages = [nn.Sequential(nn.Linear(16, 8), nn.ReLU()), Doubled()]

if __name__ == "__main__":
    runner = pipeq.PipelineRunner(stages, loss_fn=nn.CrossEntropyLoss(),
                                  optimizer=functools.partial(torch.optim.SGD, lr=0.1), microbatches=2,
                                  threads_per_stage=1, start_method={start_method!r})
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    with runner:
        for _ in range(2):
            print("loss", runner.step(x, y))
        print("pids", *[w["pid"] for w in runner._backend.worker_info])
"""


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}


def _gone(pid: int, timeout: float = 10.0) -> bool:
    """Process ``pid`` has exited (a zombie waiting for its reaper counts)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return True
        except OSError:
            return True
        time.sleep(0.05)
    return False


def _trained(out: str) -> None:
    """Two finite losses printed, and the stage processes gone with their runner."""
    losses = [float(line.split()[1]) for line in out.splitlines() if line.startswith("loss ")]
    assert len(losses) == 2 and all(0 < v < 10 for v in losses), out
    pids = [int(p) for p in out.split("pids", 1)[1].split()]
    assert len(pids) == 2
    assert all(_gone(pid) for pid in pids), "a stage process outlived its runner"


@pytest.mark.timeout(90)
def test_a_script_piped_through_stdin_trains(tmp_path):
    """``python - < train.py``: the stages do not run ``<stdin>`` again (FileNotFoundError before),
    and get the script's stage class by value. (With the fork server, one torch import fewer than
    spawn's; both prepare a stage's ``__main__`` alike: tests/unit/test_main_by_value.py.)"""
    r = subprocess.run([sys.executable, "-"], input=SCRIPT.format(start_method="forkserver"), cwd=tmp_path,
                       env=_env(), capture_output=True, text=True, timeout=80)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    _trained(r.stdout)


@pytest.mark.timeout(90)
def test_a_notebook_cell_defining_a_stage_class_trains(tmp_path):
    """A real kernel (nbclient): a cell defines the stage class and trains two steps in stage
    processes (classes defined in a cell could not be unpickled by them before)."""
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(SCRIPT.format(start_method="forkserver"))]
    client = nbclient.NotebookClient(nb, timeout=60, kernel_name="python3",
                                     resources={"metadata": {"path": str(tmp_path)}})
    client.execute(env=_env())  # raises CellExecutionError, with the cell's traceback, on any error
    out = "".join(o.get("text", "") for o in nb.cells[0].outputs if o.get("name") == "stdout")
    _trained(out)
