"""One transport interface: :class:`pipeq.wire.transport.Transport` is what the event loop talks
through, and every transport it is given implements it with the same parameters: the process's
own (``ProcessTransport``), the tensor-parallel shards' views of it (``LeadTransport``,
``FollowerTransport``) and the tests' in-process wire (``inproc.StageEnd``)."""

from __future__ import annotations

import inspect
import types

import pytest

from inproc import StageEnd
from pipeq.runtime.loop import EventLoop
from pipeq.wire.shard_link import FollowerTransport, LeadTransport
from pipeq.wire.transport import ProcessTransport, Transport

METHODS = sorted(n for n, v in vars(Transport).items() if callable(v) and not n.startswith("_"))


def _parameters(fn) -> list[str]:
    return list(inspect.signature(fn).parameters)


def test_the_protocol_is_what_the_event_loop_calls():
    source = inspect.getsource(inspect.getmodule(EventLoop))
    called = sorted({n for n in METHODS if f"transport.{n}(" in source})
    assert called == METHODS, "the Transport protocol names exactly what the event loop calls"
    assert inspect.signature(EventLoop.__init__).parameters["transport"].annotation in ("Transport", Transport)


@pytest.mark.parametrize("cls", [ProcessTransport, StageEnd, LeadTransport, FollowerTransport])
def test_every_transport_has_each_method_with_the_protocols_parameters(cls):
    inner = types.SimpleNamespace(**{n: getattr(ProcessTransport, n) for n in METHODS}, addresses=None,
                                  device_payloads=False)
    made = cls(inner, None) if cls in (LeadTransport, FollowerTransport) else None
    for name in METHODS:
        own = getattr(made, name, None) if made is not None else getattr(cls, name, None)
        assert own is not None, f"{cls.__name__} has no {name}"
        want = _parameters(getattr(Transport, name))
        got = _parameters(own)
        if inspect.ismethod(own) or (made is not None and name not in vars(cls)):
            got = ["self", *got] if got[:1] != ["self"] else got
        assert got == want, f"{cls.__name__}.{name}{tuple(got)}: the protocol's is {tuple(want)}"
    if made is not None:
        assert isinstance(made, Transport)
