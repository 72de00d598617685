"""A newcomer meets no trap, checked without running a script: what the code imports is declared, the guard's rules, job and schedule messages that say what to do, the README's names."""

from __future__ import annotations

import ast
import configparser
import os
import re
import sys
import textwrap

import pytest
import torch
from torch import nn

import pipeq
from pipeq.control import main_guard as options
from pipeq import schedules


ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository
#: import name -> distribution name, where they differ
DISTRIBUTION = {"zmq": "pyzmq", "sklearn": "scikit-learn"}


# ---------------------------------------------------------------- what the code imports is declared

def _requirements() -> tuple[set[str], dict[str, set[str]]]:
    """(install_requires, extras) of setup.cfg, as distribution names."""
    cfg = configparser.ConfigParser()
    cfg.read(os.path.join(ROOT, "setup.cfg"))

    def names(value: str) -> set[str]:
        return {re.split(r"[<>=!~\[; ]", line.strip())[0].lower() for line in value.splitlines()
                if line.strip() and not line.strip().startswith("#")}

    extras = {k: names(v) for k, v in cfg["options.extras_require"].items()}
    return names(cfg["options"]["install_requires"]), extras


def _python_files(top: str) -> list[str]:
    """Every .py file under ``top``, in its subfolders too."""
    return sorted(os.path.join(d, f) for d, _, files in os.walk(top) for f in files if f.endswith(".py"))


def _third_party(path: str) -> dict[str, bool]:
    """The third-party modules a file imports -> whether at module level (else only lazily)."""
    tree = ast.parse(open(path).read())
    top_level = {id(n) for st in tree.body for n in ast.walk(st)
                 if not isinstance(st, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}
    local = {os.path.basename(f)[:-3] for d in ("tests", "examples", "bench")
             for f in _python_files(os.path.join(ROOT, d))}  # the repository's own scripts, imported from their folders
    out: dict[str, bool] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            mods = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            mods = [node.module]
        else:
            continue
        for m in mods:
            top = m.split(".")[0]
            if top in sys.stdlib_module_names or top in local or top in ("pipeq", "examples"):
                continue
            out[top] = out.get(top, False) or id(node) in top_level
    return out


def test_everything_pipeq_uses_is_declared():
    required, extras = _requirements()
    optional = set().union(*extras.values())
    for path in _python_files(os.path.join(ROOT, "pipeq")):
        f = os.path.relpath(path, os.path.join(ROOT, "pipeq"))
        used = _third_party(path)
        if ".numpy()" in open(path).read():  # torch's numpy bridge needs numpy; torch does not require it
            used["numpy"] = True
        for mod, eager in used.items():
            dist = DISTRIBUTION.get(mod, mod)
            if eager:
                assert dist in required, f"pipeq/{f} needs {mod}: add {dist} to install_requires"
            else:
                assert dist in required | optional, f"pipeq/{f} imports {mod}: declare {dist} (an extra will do)"


def _readme_extras() -> set[str]:
    """The extras the README's install block installs with the package."""
    readme = open(os.path.join(ROOT, "README.md")).read()
    block = readme.split("## Install", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    found = re.search(r"pip install -e \"?\.\[([\w,]+)\]\"?", block)
    assert found, f"no 'pip install -e .[...]' in the README's install block:\n{block}"
    return set(found.group(1).split(","))


def test_the_readmes_two_commands_need_only_what_its_install_line_installs():
    required, extras = _requirements()
    installed = required | {"torch"} | set().union(*(extras[e] for e in _readme_extras()))
    files = [os.path.join(ROOT, "examples", "train_digits.py")]  # python examples/train_digits.py
    files += _python_files(os.path.join(ROOT, "tests"))  # python -m pytest
    for path in files:
        for mod in _third_party(path):
            dist = DISTRIBUTION.get(mod, mod)
            assert dist in installed, f"{os.path.relpath(path, ROOT)} imports {mod}, which the README's install does not bring"


def test_the_digits_examples_say_which_extra_they_need(monkeypatch):
    _, extras = _requirements()
    assert "scikit-learn" in extras["examples"]
    monkeypatch.setitem(sys.modules, "sklearn", None)  # as on a machine without it
    monkeypatch.setitem(sys.modules, "sklearn.datasets", None)
    from examples import digits_job, train_digits

    with pytest.raises(ModuleNotFoundError, match=r"pip install -e '\.\[examples\]'"):
        train_digits.load_digits()
    digits_job._digits.cache_clear()
    with pytest.raises(ModuleNotFoundError, match=r"pip install -e '\.\[examples\]'"):
        digits_job._digits()


def test_guard_lines_and_bindings():
    tree = ast.parse(textwrap.dedent("""\
        import os as o
        A = 1
        def f(): pass
        try:
            class B: pass
        except ImportError as err:
            pass
        for C in (): pass
        if __name__ == "__main__":
            class D: pass
            A = 2
            E = 3
        if "__main__" != __name__:
            F = 4
        else:
            G = 5
        """))
    outside, inside = set(), set()
    options._bindings(tree.body, False, (outside, inside))
    assert outside == {"o", "A", "f", "B", "err", "C", "F"}
    assert inside == {"D", "A", "E", "G"}
    assert options._guarded_lines(tree) == [(10, 12), (16, 16)]


# ---------------------------------------------------------------- job files: did you mean, an integer

def _job(tmp_path, extra: str) -> str:
    path = tmp_path / "job.toml"
    path.write_text('stages = "a:b"\nloss = "c:d"\noptimizer = "e:f"\ndata = "g:h"\nsteps = 2\n' + extra)
    return str(path)


def test_a_typod_job_key_gets_a_did_you_mean(tmp_path):
    from pipeq.launch.job import load_job

    with pytest.raises(ValueError) as info:
        load_job(_job(tmp_path, "microbatchs = 4\n"))
    assert str(info.value).endswith("unknown key(s) ['microbatchs']; did you mean 'microbatches'?")
    with pytest.raises(ValueError) as info:  # nothing close: the known keys
        load_job(_job(tmp_path, "zzz = 4\n"))
    assert "unknown key(s) ['zzz']; known keys: [" in str(info.value) and "'microbatches'" in str(info.value)


@pytest.mark.parametrize("extra, want", [
    ('microbatches = "4"\n', "microbatches must be an integer, got '4'"),
    ("out = 3\n", "out must be a string, got 3"),
    ("optimizer_args = 0.1\n", "optimizer_args must be a table, got 0.1"),
    ('heartbeat_timeout = "x"\n', "heartbeat_timeout must be an integer or a float, got 'x'"),
    ('schedule = "pairwse"\n', "schedule: unknown name 'pairwse'; did you mean 'pairwise'?"),
    ('schedule = { name = "nwise", distanse = 2 }\n',
     "schedule 'nwise': unknown option(s) ['distanse']; did you mean 'distance'?"),
])
def test_job_value_errors_read_as_english(tmp_path, extra, want):
    from pipeq.launch.job import load_job

    with pytest.raises(ValueError) as info:
        load_job(_job(tmp_path, extra))
    assert want in str(info.value)


# ---------------------------------------------------------------- schedule names and the distance

def test_every_schedule_name_is_in_pipeq_schedules():
    assert "nwise" in pipeq.SCHEDULES
    assert set(pipeq.SCHEDULES) >= {"1f1b", "fill-drain", "gpipe", "global", "local", "pairwise", "nwise",
                                    "async", "al"}
    want = r"schedule 'nwise' needs its distance: schedule=pipeq\.schedules\.Interlock\('nwise', distance=d\)"
    with pytest.raises(ValueError, match=want):
        schedules.get_schedule("nwise")
    with pytest.raises(ValueError, match=want):
        schedules.build("nwise", 3, 2)
    with pytest.raises(ValueError, match=want):
        pipeq.PipelineRunner([nn.Linear(2, 2)], nn.MSELoss(), torch.optim.SGD, "nwise", mode="simulated")


def test_a_schedules_option_given_to_the_runner_says_where_it_belongs():
    import functools

    def make(**kw):
        return pipeq.PipelineRunner([nn.Linear(2, 2), nn.Linear(2, 2)], nn.MSELoss(),
                                    functools.partial(torch.optim.SGD, lr=0.1), "pairwise", mode="simulated", **kw)

    with pytest.raises(ValueError, match=r"distance is an option of the schedule, not of the runner: pass "
                                         r"schedule=pipeq\.schedules\.Interlock\('nwise', distance=2\)"):
        make(distance=2)
    with pytest.raises(ValueError, match=r"warmup is an option of the schedule.*AsyncOneFOneB\(warmup=3\)"):
        make(warmup=3)


def test_cli_nwise_names_its_distance_flag(capsys):
    from pipeq.launch.cli import main

    assert main(["schedule", "nwise", "--stages", "3", "--microbatches", "2"]) == 2
    assert "schedule nwise needs its distance: --distance D, an integer >= 1" in capsys.readouterr().err
    assert main(["schedule", "nwise", "--distance", "0", "--stages", "3", "--microbatches", "2"]) == 2
    assert "got --distance 0" in capsys.readouterr().err
    assert main(["schedule", "nwise", "--distance", "2", "--stages", "3", "--microbatches", "2"]) == 0
    assert capsys.readouterr().out.startswith("nwise(d=2): 3 stages x 2 microbatches")
    for name in pipeq.SCHEDULES:  # every registered name is a choice of the command
        args = ["schedule", name, "--stages", "2", "--microbatches", "4"] + (["--distance", "1"] if name == "nwise" else [])
        assert main(args) == 0, capsys.readouterr().err


# ---------------------------------------------------------------- pictures of plans are in plan units

def test_a_plans_picture_is_in_plan_units_not_ms():
    pytest.importorskip("matplotlib")
    from pipeq.trace import plot
    from pipeq.trace import format as trace

    fig = plot.draw_trace(trace.planned_trace("1f1b", 3, 4, backward_cost=2), steps="all")
    ax = fig.axes[0]
    assert "ms" not in ax.get_xlabel().split() and "plan time units" in ax.get_xlabel()
    assert "a backward 2" in ax.get_xlabel()
    timeline = schedules.dry_run(schedules.build("1f1b", 3, 4), cost={schedules.Op.BACKWARD: 2})
    end = max(t + (2 if a.op is schedules.Op.BACKWARD else 1) for row in timeline for t, a in row)
    assert end == 19  # pipeq schedule 1f1b --stages 3 --microbatches 4: 19 slots
    assert ax.get_xlim()[1] == pytest.approx(end * 1.01)  # the axis counts slots (1 ms each underneath)
    run = trace.planned_trace("1f1b", 2, 2)
    del run["otherData"]["planned"]  # as a traced run
    assert plot.time_axis(trace.trace_from_dict(run))[1] == "time (ms from the first event drawn)"


# ---------------------------------------------------------------- examples leave tracked files alone

def test_trace_schedules_writes_outside_docs_by_default():
    from examples import trace_schedules

    out = os.path.abspath(trace_schedules.parse_args([]).out)
    assert not out.startswith(os.path.join(ROOT, "docs")), out
    assert os.path.abspath(trace_schedules.parse_args(["--out", "docs"]).out) == os.path.abspath("docs")


# ---------------------------------------------------------------- the docs say what is true

def test_the_docs_name_checkpoint_directories_as_they_are():
    from pipeq import checkpoint

    readme = open(os.path.join(ROOT, "docs", "guides", "checkpoints.md")).read()
    assert "step-N/" not in readme
    assert os.path.basename(checkpoint.checkpoint_dir("x", 50)) + "/" in readme
