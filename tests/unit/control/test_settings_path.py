"""One settings path: a run's settings are a :class:`pipeq.RunConfig`, each setting's default is
declared once (its field in the RunConfig or one of its parts), and what a stage process is told
is derived from the RunConfig in one place.

The test walks every RunConfig field (into its parts) and looks for a default of that setting
everywhere else one could be written: the job-file keys (``KEYS``), the ``Job`` they fill, the
runner's signature, the ``StageSettings`` and ``WorkerConfig`` a stage process is told. Each must
read the dataclass's, never declare its own. Starts no process."""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import os

import pytest
import torch

import pipeq
from pipeq.control import config
from pipeq.control.config import RunConfig, setting_default
from pipeq.launch.job.keys import KEYS, LAUNCH_DEFAULTS
from pipeq.launch.job.recipe import Recipe
from pipeq.launch.job.spec import Job
from pipeq.runtime import config as runtime_config
from pipeq.stage.numerics import Numerics

PACKAGE = os.path.dirname(pipeq.__file__)
#: RunConfig's fields that are no setting anyone gives, with why.
NOT_SETTINGS = {"auto": "schedule='auto' sets it; the runner settles the schedule at its first step"}


def settings() -> dict[str, tuple[type, dataclasses.Field]]:
    """Every setting: RunConfig's own fields and its parts' (walked into), by name, with the
    dataclass that declares it."""
    out: dict[str, tuple[type, dataclasses.Field]] = {}
    for f in dataclasses.fields(RunConfig):
        part = f.default_factory if dataclasses.is_dataclass(f.default_factory) else None
        if part is not None:
            for g in dataclasses.fields(part):
                assert g.name not in out, f"{g.name} is declared by {out[g.name][0].__name__} and {part.__name__}"
                out[g.name] = (part, g)
        elif f.name not in NOT_SETTINGS:
            out[f.name] = (RunConfig, f)
    return out


def _default(f: dataclasses.Field):
    return f.default if f.default_factory is dataclasses.MISSING else f.default_factory()


def _job_field_values() -> dict[str, str]:
    """The Job's fields as spec.py writes them: name -> the source of its default ("" for none)."""
    tree = ast.parse(open(os.path.join(PACKAGE, "launch", "job", "spec.py")).read())
    job = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Job")
    return {s.target.id: ast.unparse(s.value) if s.value is not None else ""
            for s in job.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)}


def declarations(name: str, owner: type, f: dataclasses.Field) -> list[str]:
    """Where a default of setting ``name`` is written: its dataclass field, and anywhere else that
    declares one of its own instead of reading that field's."""
    where = [f"{owner.__name__}.{name}"]
    key = KEYS.get(name)
    if key is not None and not key.setting:
        where.append(f"KEYS[{name!r}] = {key.default!r}")
    if key is not None and key.setting and name not in LAUNCH_DEFAULTS and key.default is not setting_default(name):
        where.append(f"KEYS[{name!r}] = {key.default!r}, not the field's")
    job = _job_field_values()
    if name in job and job[name] != f"field_of({name!r})":
        where.append(f"Job.{name} = {job[name]}")
    shown = inspect.signature(pipeq.PipelineRunner).parameters[name].default
    if shown != _default(f) or type(shown) is not type(_default(f)):
        where.append(f"PipelineRunner's signature: {name}={shown!r}")
    return where


@pytest.mark.parametrize("name", sorted(settings()))
def test_each_setting_default_is_declared_once_in_its_dataclass(name):
    owner, f = settings()[name]
    assert f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING, name
    assert setting_default(name) == _default(f)
    assert declarations(name, owner, f) == [f"{owner.__name__}.{name}"]


def test_the_walk_finds_every_setting_the_runner_takes():
    params = inspect.signature(pipeq.PipelineRunner).parameters
    assert set(settings()) == {f.name for f in config.setting_fields()} | {"schedule", "microbatches"}
    assert set(settings()) <= set(params)


def test_every_job_key_that_is_a_setting_reads_its_default():
    """A key named as a setting is marked a setting (its default read from the RunConfig field, or
    pipeq launch's own, with why), and a key marked a setting is one."""
    named = {name for name in KEYS if name in settings()}
    marked = {name for name, key in KEYS.items() if key.setting}
    assert named == marked
    for name in named:
        if name in LAUNCH_DEFAULTS:
            value, why = LAUNCH_DEFAULTS[name]
            assert KEYS[name].default is value and value != setting_default(name) and why, name
        else:
            assert KEYS[name].default is setting_default(name), name
    assert set(LAUNCH_DEFAULTS) <= named


def test_a_job_with_defaults_runs_the_runner_defaults_but_where_launch_sets_its_own():
    """The Job's run configuration, every key left at its default, is a runner's default one but for
    LAUNCH_DEFAULTS and the start method (``pipeq launch`` forks stages from its fork server)."""
    job = Job(recipe=Recipe(stages="m:stages", loss="m:loss", optimizer="m:opt"), data="m:data")
    got = job.run_config()
    want = RunConfig(fault=config.FaultConfig(step_timeout=LAUNCH_DEFAULTS["step_timeout"][0]),
                     placement=config.PlacementConfig(start_method="forkserver"))
    assert got == want
    assert dataclasses.replace(got, placement=RunConfig().placement, fault=RunConfig().fault) == RunConfig()


def test_the_runner_keywords_and_from_kwargs_declare_no_defaults():
    """``RunConfig.from_kwargs()`` and a runner built without settings get the dataclass defaults."""
    assert RunConfig.from_kwargs() == RunConfig()
    assert RunConfig.from_kwargs(None, None, trace=None) == RunConfig()
    stages = [torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)]
    runner = pipeq.PipelineRunner(stages, torch.nn.MSELoss(), functools.partial(torch.optim.SGD, lr=0.1),
                                  mode="simulated")
    assert runner.config == RunConfig(placement=config.PlacementConfig(mode="simulated"))


def test_what_a_stage_process_is_told_declares_no_defaults():
    for kind in (runtime_config.StageSettings, runtime_config.WorkerConfig, runtime_config.ChunkConfig):
        with_default = [f.name for f in dataclasses.fields(kind)
                        if f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING]
        assert with_default == [], kind.__name__


def test_the_wire_takes_the_run_settings_it_needs_without_a_default_of_its_own():
    """spin, max_message_mb, shm_slots and tcp_security reach the transport from the run's
    settings: its classes take them as arguments with no default (once, a transport's spin
    defaulted to 0.0 while the run's was 0.01)."""
    import inspect

    from pipeq.wire.security import WireAuth
    from pipeq.wire.shm import ShmConfig
    from pipeq.wire.stage_inbox import StageInbox
    from pipeq.wire.transport import ProcessTransport

    for cls in (ProcessTransport, StageInbox):
        params = inspect.signature(cls).parameters
        assert [n for n in ("spin_s", "max_frame_bytes") if params[n].default is not inspect.Parameter.empty] == [], cls
    fields = {f.name: f for f in dataclasses.fields(ShmConfig)} | {f.name: f for f in dataclasses.fields(WireAuth)}
    assert [n for n in ("slots", "max_bytes", "mode") if fields[n].default is not dataclasses.MISSING] == []


def test_the_default_numerics_are_plain():
    """The stages' ``Numerics()`` is plain computation (no option on); the run's defaults are that."""
    assert RunConfig().numerics_for(3) == Numerics()


class _Calls(ast.NodeVisitor):
    """The calls of a module, each with the function it is written in (the innermost def)."""

    def __init__(self, module: str) -> None:
        self.module, self.where, self.calls = module, ["<module>"], []

    def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        self.where.append(node.name)
        self.generic_visit(node)
        self.where.pop()

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_Call(self, node: ast.Call) -> None:
        called = getattr(node.func, "id", None) or getattr(node.func, "attr", None)
        self.calls.append((called, f"{self.module}:{self.where[-1]}"))
        self.generic_visit(node)


@functools.cache
def _calls() -> list[tuple[str | None, str]]:
    """Every call in pipeq/: (the name called, "module:function" it is written in)."""
    out = []
    for root, _, files in os.walk(PACKAGE):
        for file in sorted(f for f in files if f.endswith(".py")):
            path = os.path.join(root, file)
            calls = _Calls(os.path.relpath(path, PACKAGE)[:-3].replace(os.sep, "."))
            calls.visit(ast.parse(open(path).read()))
            out += calls.calls
    return out


def _constructed_in(name: str) -> list[str]:
    """Every place in pipeq/ that calls ``name(...)``: "module:function"."""
    return [where for called, where in _calls() if called == name]


def test_a_stage_process_is_told_what_one_place_derives():
    """RunSetup.stage_settings is the only maker of a StageSettings, worker_configs of a WorkerConfig."""
    assert _constructed_in("StageSettings") == ["control.processes:stage_settings"]
    assert _constructed_in("WorkerConfig") == ["control.processes:worker_configs"]
