"""A newcomer meets no trap (issue 14): what the README's two commands need is declared, a script
that forgets the ``__main__`` guard gets one clear error, and messages say what to do."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest


from strays import gone, wait_no_strays
from launch_util import run_at_once

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository


# ---------------------------------------------------------------- the main script's traps

HEADER = """\
import functools, torch
from torch import nn
import pipeq
"""
RUN = """\
runner = pipeq.PipelineRunner([{first}, nn.Linear(4, 2)], nn.CrossEntropyLoss(),
                              functools.partial(torch.optim.SGD, lr=0.1), microbatches=2,
                              start_method="forkserver")
with runner:
    print("loss", runner.step(torch.randn(4, 4), torch.randint(0, 2, (4,))))
    print("pids", *[w["pid"] for w in runner.stage_processes])
"""
LOCAL = """\
class Local(nn.Module):
    def __init__(self):
        super().__init__()
        self.l = nn.Linear(4, 4)

    def forward(self, x):
        return self.l(x)
"""


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}


def _script(source: str) -> tuple[dict[str, str], list[str]]:
    """A script.py of ``source``, run as ``python script.py``: (files, arguments)."""
    return {"script.py": source}, ["script.py"]


def _scripts() -> dict[str, tuple[dict[str, str], list[str]]]:
    """The first-run scripts the tests below judge: name -> (files to write, python arguments)."""
    run = RUN.format(first="nn.Linear(4, 4)")
    in_function = HEADER + "def main():\n" + textwrap.indent(run, "    ") + "\nmain()\n"
    loss_under_guard = ('if __name__ == "__main__":\n    class MyLoss(nn.CrossEntropyLoss):\n        pass\n'
                        + textwrap.indent(run.replace("nn.CrossEntropyLoss()", "MyLoss()"), "    "))
    guarded = (LOCAL + "Other = None\n\n\ndef main():\n" + textwrap.indent(RUN.format(first="Local()"), "    ")
               + '\n\nif __name__ == "__main__":\n    Other = Local\n    main()\n')
    package = HEADER + LOCAL + 'if __name__ == "__main__":\n' + textwrap.indent(RUN.format(first="Local()"), "    ")
    return {
        "no_guard": _script(HEADER + run),
        "in_function": _script(in_function),
        "stage_under_guard": _script(HEADER + 'if __name__ == "__main__":\n'
                                     + textwrap.indent(LOCAL + RUN.format(first="Local()"), "    ")),
        "loss_under_guard": _script(HEADER + loss_under_guard),
        "package_main": ({"mypkg/__init__.py": "", "mypkg/__main__.py": package}, ["-m", "mypkg"]),
        "guarded": _script(HEADER + guarded),
    }


@pytest.fixture(scope="module")
def first_runs(tmp_path_factory) -> dict[str, subprocess.CompletedProcess]:
    """Every script of _scripts, each in a directory of its own, run at once (each is a fresh
    interpreter importing torch: one after another they would leave a core idle)."""
    argvs, where = {}, {}
    for name, (files, args) in _scripts().items():
        here = tmp_path_factory.mktemp(name)
        for rel, text in files.items():
            (here / rel).parent.mkdir(parents=True, exist_ok=True)
            (here / rel).write_text(text)
        argvs[name], where[name] = [sys.executable, *args], str(here)
    return run_at_once(argvs, timeout=100, cwd=where, env=_env())


def _one_error(r: subprocess.CompletedProcess) -> str:
    """The script failed with exactly one traceback (none from the multiprocessing bootstrap):
    its last line."""
    assert r.returncode == 1, r.stdout + r.stderr
    assert r.stderr.count("Traceback (most recent call last)") == 1, r.stderr
    assert "bootstrapping" not in r.stderr and "spawn.py" not in r.stderr, r.stderr
    return r.stderr.strip().splitlines()[-1]


@pytest.mark.timeout(120)
def test_a_script_without_the_main_guard_gets_one_error_saying_so(first_runs):
    r = first_runs["no_guard"]
    last = _one_error(r)
    assert last.startswith("pipeq.errors.MainScriptError: the pipeline is started at the top level of script.py "
                           "(line 7), outside an 'if __name__ == \"__main__\":' block"), last
    assert "Put the code that builds and runs the runner under" in last
    assert "pids" not in r.stdout  # refused before any stage process started
    assert wait_no_strays() == []


@pytest.mark.timeout(120)
def test_a_runner_started_by_a_function_called_without_the_guard_is_refused_too(first_runs):
    source = _scripts()["in_function"][0]["script.py"]
    last = _one_error(first_runs["in_function"])
    assert f"started at the top level of script.py (line {source.splitlines().index('main()') + 1})" in last, last


@pytest.mark.timeout(120)
def test_a_stage_class_defined_under_the_guard_is_refused_naming_it(first_runs):
    last = _one_error(first_runs["stage_under_guard"])
    assert last == ("pipeq.errors.MainScriptError: stage 0 (Local): Local is defined under 'if __name__ == \"__main__\":' in "
                    "script.py; every stage process runs script.py again without that block, so it cannot "
                    "find Local. Define Local at module level, above the guard (or in a module of its own)")


@pytest.mark.timeout(120)
def test_a_loss_function_defined_under_the_guard_is_refused_naming_it(first_runs):
    last = _one_error(first_runs["loss_under_guard"])
    assert last.startswith("pipeq.errors.MainScriptError: loss_fn: MyLoss is defined under 'if __name__ == \"__main__\":'"), last


@pytest.mark.timeout(120)
def test_a_stage_class_in_a_packages_main_is_refused(first_runs):
    last = _one_error(first_runs["package_main"])
    assert last.startswith("pipeq.errors.MainScriptError: stage 0 (Local): Local is defined in ") and "__main__.py" in last, last
    assert "Define it in another module of the package" in last


@pytest.mark.timeout(120)
def test_a_guarded_script_with_module_level_classes_runs(first_runs):
    """The guard check refuses nothing that works: a class above the guard, the run under it in
    a function, a name bound both above and under the guard."""
    r = first_runs["guarded"]
    assert r.returncode == 0, r.stderr
    assert "loss" in r.stdout
    pids = [int(p) for p in r.stdout.split("pids", 1)[1].split()]
    assert len(pids) == 2
    assert all(gone(pid) for pid in pids)  # the stage processes went with the script
