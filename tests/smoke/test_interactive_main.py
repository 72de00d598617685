"""Runs where people try things (issue 30): a script piped in with ``python -`` and a notebook
kernel, whose ``__main__`` has no file the stage processes could run again. What it defines (here
a stage class) reaches them by value, and the run trains as from a script."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from doc_blocks import python_blocks
from strays import gone

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository

#: the README's example as it is, and then the pids of its stage processes (gone with the runner)
SCRIPT = python_blocks("README.md")[0].code + 'print("pids", *[w["pid"] for w in runner.stage_processes])\n'


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
            "PIPEQ_START_METHOD": "forkserver"}  # one torch import fewer than spawn's for the stages


def _trained(out: str) -> None:
    """Five finite, falling losses printed, and the stage processes gone with their runner."""
    losses = [float(line.split("loss")[1]) for line in out.splitlines() if line.startswith("step ")]
    assert len(losses) == 5 and all(0 < v < 10 for v in losses) and losses[-1] < losses[0], out
    pids = [int(p) for p in out.split("pids", 1)[1].split()]
    assert len(pids) == 3
    assert all(gone(pid) for pid in pids), "a stage process outlived its runner"


@pytest.mark.timeout(90)
def test_a_script_piped_through_stdin_trains(tmp_path):
    """``python - < train.py``: the stages do not run ``<stdin>`` again (FileNotFoundError before),
    and get the script's stage class by value. (With the fork server, one torch import fewer than
    spawn's; both prepare a stage's ``__main__`` alike: tests/unit/test_main_by_value.py.)"""
    r = subprocess.run([sys.executable, "-"], input=SCRIPT, cwd=tmp_path,
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
    nb.cells = [nbformat.v4.new_code_cell(SCRIPT)]
    client = nbclient.NotebookClient(nb, timeout=60, kernel_name="python3",
                                     resources={"metadata": {"path": str(tmp_path)}})
    client.execute(env=_env())  # raises CellExecutionError, with the cell's traceback, on any error
    out = "".join(o.get("text", "") for o in nb.cells[0].outputs if o.get("name") == "stdout")
    _trained(out)
