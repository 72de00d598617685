"""The two network-namespace hosts the multi-host tests run on (made by the test, removed after it)."""

from __future__ import annotations

import pytest

from netns import TwoHosts, netns_available


@pytest.fixture
def hosts():
    """Two hosts joined by a veth pair; no process may be left in either afterwards."""
    reason = netns_available()
    # .ci/run installs iproute2; a machine where this still fails must not pass silently
    assert reason is None, f"network namespaces are needed for this test: {reason}"
    with TwoHosts() as h:
        yield h
    assert h.leftover == {h.a: [], h.b: []}, f"processes left in the namespaces: {h.leftover}"
