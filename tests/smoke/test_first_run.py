"""A newcomer meets no trap (issue 14): what the README's two commands need is declared, a script
that forgets the ``__main__`` guard gets one clear error, and messages say what to do."""

from __future__ import annotations

import ast
import configparser
import os
import re
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from torch import nn

import pipeq
from pipeq.control import options
from pipeq import schedules

from strays import wait_no_strays
from launch_util import run_at_once

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
    print("pids", *[w["pid"] for w in runner._backend.worker_info])
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
    assert all(_gone(pid) for pid in pids)  # the stage processes went with the script


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
        args = ["schedule", name, "--stages", "2", "--microbatches", "2"] + (["--distance", "1"] if name == "nwise" else [])
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


# ---------------------------------------------------------------- the README says what is true

def test_readme_names_checkpoint_directories_as_they_are():
    from pipeq import checkpoint

    readme = open(os.path.join(ROOT, "README.md")).read()
    assert "step-N/" not in readme
    assert os.path.basename(checkpoint.checkpoint_dir("x", 50)) + "/" in readme
