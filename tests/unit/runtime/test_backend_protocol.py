"""Both backends implement pipeq.runtime.backend.Backend: every member of the protocol, each
method with the protocol's parameters (names, kinds, defaults), types and return type; and the
runner's collaborators type against the protocol, not against Any. Starts no process."""

from __future__ import annotations

import ast
import functools
import inspect
import os
import typing

import pytest
import torch
from torch import nn

from pipeq.control.config import RunConfig
from pipeq.control.driver import ProcessBackend
from pipeq.control.processes import RunSetup
from pipeq.stage.numerics import Numerics
from pipeq.runtime.backend import Backend
from pipeq.runtime.simulated import SimulatedBackend
from pipeq.stage.spec import StageSpec

SGD = functools.partial(torch.optim.SGD, lr=0.1)
BACKENDS = [ProcessBackend, SimulatedBackend]


def protocol_members() -> tuple[list[str], list[str], list[str]]:
    """The protocol's methods, properties and data attributes, by name."""
    methods = [n for n, v in vars(Backend).items() if inspect.isfunction(v) and not n.startswith("_")]
    properties = [n for n, v in vars(Backend).items() if isinstance(v, property)]
    data = [n for n in Backend.__annotations__ if n not in methods and n not in properties]
    return methods, properties, data


def test_the_protocol_holds_what_the_backends_share():
    methods, properties, data = protocol_members()
    assert len(methods) == 18 and properties == ["failing"] and data == ["step_lrs"]
    assert {"submit", "result", "predict", "get_state", "restore", "take_snapshots"} <= set(methods)


def _hints(fn) -> dict[str, typing.Any]:
    return typing.get_type_hints(fn)


@pytest.mark.parametrize("cls", BACKENDS, ids=lambda c: c.__name__)
def test_every_method_has_the_protocols_signature(cls):
    methods, _, _ = protocol_members()
    for name in methods:
        impl = inspect.getattr_static(cls, name, None)
        assert inspect.isfunction(impl), f"{cls.__name__} has no method {name}"
        want, got = inspect.signature(getattr(Backend, name)), inspect.signature(impl)
        shape = [(p.name, p.kind, p.default) for p in want.parameters.values()]
        assert [(p.name, p.kind, p.default) for p in got.parameters.values()] == shape, \
            f"{cls.__name__}.{name}{got} is not Backend.{name}{want}"
        assert _hints(impl) == _hints(getattr(Backend, name)), f"{cls.__name__}.{name}: other types"


@pytest.mark.parametrize("cls", BACKENDS, ids=lambda c: c.__name__)
def test_every_property_is_one_of_the_same_type(cls):
    _, properties, _ = protocol_members()
    for name in properties:
        impl = inspect.getattr_static(cls, name, None)
        assert isinstance(impl, property), f"{cls.__name__}.{name} is not a property"
        assert _hints(impl.fget) == _hints(getattr(Backend, name).fget), f"{cls.__name__}.{name}"


def test_every_data_attribute_is_set_by_each_backend():
    _, _, data = protocol_members()
    process = ProcessBackend([b""] * 2, RunSetup(RunConfig(microbatches=2), Numerics(), None))
    simulated = SimulatedBackend([StageSpec(nn.Linear(2, 2), SGD, None), StageSpec(nn.Linear(2, 2), SGD,
                                                                                     nn.MSELoss())], "1f1b")
    for backend in (process, simulated):
        for name in data:
            assert name in vars(backend), f"{type(backend).__name__} sets no {name}"
            assert isinstance(vars(backend)[name], typing.get_origin(Backend.__annotations__[name]) or object)


COLLABORATORS = ["control/runner.py", "control/lifecycle.py", "control/feed.py", "control/streaming.py",
                 "control/state.py", "control/snapshots.py", "control/assembly.py"]


@pytest.mark.parametrize("module", COLLABORATORS)
def test_the_runner_and_its_collaborators_type_their_backend_as_the_protocol(module):
    """No ``backend: Any`` (or ``_backend: Any``), no parameter ``backend`` without a type: every
    name holding a backend is annotated ``Backend`` (or ``Backend | None`` until it is built)."""
    import pipeq

    src = open(os.path.join(os.path.dirname(pipeq.__file__), module)).read()
    untyped = []
    for node in ast.walk(ast.parse(src)):
        target = annotation = None
        if isinstance(node, ast.AnnAssign):
            target, annotation = node.target, node.annotation
        elif isinstance(node, ast.arg):
            target, annotation = node, node.annotation
        name = getattr(target, "attr", None) or getattr(target, "id", None) or getattr(target, "arg", None)
        if name in ("backend", "_backend") and (annotation is None and isinstance(node, ast.arg)
                                                or annotation is not None and "Backend" not in ast.unparse(annotation)):
            untyped.append(f"{name}: {ast.unparse(annotation) if annotation is not None else '(none)'}")
    assert untyped == []
