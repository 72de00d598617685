"""Multi-host runs over TCP: two "hosts" made of network namespaces joined by a veth pair.

Host A runs the driver and stage 0, host B stages 1 and 2 (``pipeq launch --nnodes 2``); the
result must equal the single-host run, even with a foreign client of the rendezvous store on host
B forging, moving, overwriting and deleting every entry the nodes read; a dead driver and SIGTERM
must end the run with no process left in either namespace (a lost host, killed or cut off, is named
and its stages recovered in test_rejoin.py, which also checks that a cut-off host's agent stops
its stages on its own). And (two nodes over loopback) a node
started with another secret is refused, and both nodes say so.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time

import pytest

import store_forger
from launch_util import (REFERENCE_STEPS, ROOT, SECRET, SUPPORT, assert_same_state, free_port, launch_cmd, launch_here,
                         metrics, model_state, secret_env)
from netns import TwoHosts

pytestmark = pytest.mark.timeout(240)

PORT = 29517  # each namespace has its own port space: no clash with anything on the machine
STEPS = REFERENCE_STEPS  # the steps of conftest.py's single_host_digits (shared with test_workers)


def _node(h: TwoHosts, ns: str, rank: int, out: str, *extra: str) -> subprocess.Popen:
    argv = launch_cmd("--nnodes", "2", "--node-rank", str(rank), "--master-addr", h.addr_a,
                      "--master-port", str(PORT), "--out", out, *extra)
    return h.popen(ns, argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                   env=secret_env())


@pytest.mark.xdist_group("single_host_digits")  # the run it compares with (request.getfixturevalue below)
def test_two_namespaces_equal_the_single_host_run(hosts: TwoHosts, request, tmp_path) -> None:
    """... while a foreign store client on host B forges every entry the nodes read (node 1 follows
    only node 0's signed ones): the same losses and parameters as the single-host run."""
    h = hosts
    out = str(tmp_path / "multi")
    forger = h.popen(h.b, [sys.executable, os.path.join(SUPPORT, "store_forger.py"), h.addr_a, str(PORT)],
                     cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                     env={**os.environ, "PYTHONPATH": ROOT})
    try:
        node1 = _node(h, h.b, 1, str(tmp_path / "node1"), "--steps", str(STEPS))
        node0 = _node(h, h.a, 0, out, "--steps", str(STEPS), "--trace", os.path.join(out, "trace.json"))
        # the single-host run to compare with (conftest.py); if not done yet, it runs beside the nodes
        single_host = request.getfixturevalue("single_host_digits")
        out0, err0 = node0.communicate(timeout=150)
        out1, err1 = node1.communicate(timeout=30)
    finally:
        forger.terminate()
        forged, forger_err = forger.communicate(timeout=30)
    assert node0.returncode == 0, err0
    assert node1.returncode == 0, err1
    assert "2 nodes" in out0
    assert forger.returncode == 0 and forged.startswith("rounds "), forged + forger_err
    assert int(forged.split()[1]) >= 2, forged  # it forged all along the start
    assert store_forger.FORGED_CONTROL not in err1
    losses = [line["loss"] for line in metrics(out)]
    assert losses == pytest.approx([line["loss"] for line in metrics(single_host)], abs=1e-6)
    assert_same_state(model_state(out), model_state(single_host), atol=1e-6)
    # stage 1 and 2 really ran on host B: the agent says so
    assert "started stage(s) [1, 2]" in err1
    # and the trace has all three stages on one clock: each step's forward order holds across hosts
    import json

    with open(os.path.join(out, "trace.json")) as f:
        events = [e for e in json.load(f)["traceEvents"] if e["ph"] == "X"]
    for step in range(1, STEPS + 1):
        f0 = {e["tid"]: e["ts"] for e in events
              if e["cat"] == "forward" and e["args"]["step"] == step and e["args"]["microbatch"] == 0}
        # (within 2 ms: the clock offsets are estimated over the network, and under load an estimate
        # can be off by a millisecond, as much as a hop between two stages takes here)
        assert f0[0] < f0[1] + 2000 and f0[1] < f0[2] + 2000, (step, f0)


def _wait_for(pred, timeout: float, what: str) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


@contextlib.contextmanager
def training(h: TwoHosts, tmp_path, *extra: str):
    """Node 1 on host B, node 0 on host A, training "forever"; yields once steps are being made."""
    out = str(tmp_path / "multi")
    args = ("--steps", "100000", *extra)  # --steps replaces the job's epochs: "forever"
    node1 = _node(h, h.b, 1, str(tmp_path / "node1"), *args)
    node0 = _node(h, h.a, 0, out, *args)
    try:
        metrics = os.path.join(out, "metrics.jsonl")
        _wait_for(lambda: os.path.exists(metrics) and os.path.getsize(metrics) > 0, 120, "training to start")
        yield node0, node1
    finally:
        for p in (node0, node1):
            if p.poll() is None:
                p.kill()
                p.communicate()


def test_driver_death_takes_the_remote_workers_with_it(hosts: TwoHosts, tmp_path) -> None:
    h = hosts
    with training(h, tmp_path) as (node0, node1):
        node0.kill()
        node0.communicate()
        _, err1 = node1.communicate(timeout=30)
        assert node1.returncode != 0
        assert "lost the driver" in err1, err1
        _wait_for(lambda: not h.procs(h.a) and not h.procs(h.b), 15, "all processes to exit")


# -- the job secret (loopback) ---------------------------------------------------------------------
def _loopback_node(rank: int, port: int, out: str, *extra: str, env: dict[str, str]) -> subprocess.Popen:
    argv = launch_cmd("--nnodes", "2", "--node-rank", str(rank), "--master-addr", "127.0.0.1",
                      "--master-port", str(port), "--out", out, *extra)
    return subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


@pytest.mark.timeout(90)
def test_a_node_with_another_secret_is_refused_and_both_say_so(tmp_path, monkeypatch) -> None:
    port = free_port()
    # node 1 first: it waits for node 0's store, and then for node 0's entries signed with its own
    # secret, until node 0 gives up and its store goes with it (node 1's own start timeout is far
    # off). Node 0 runs in this process; its start timeout leaves node 1 (a fresh interpreter
    # importing torch, on a machine that other tests keep busy) time to register.
    node1 = _loopback_node(1, port, str(tmp_path / "node1"), "--steps", "3", "--start-timeout", "60",
                           env=secret_env("another secret, not the one node 0 has"))
    try:
        monkeypatch.setenv("PIPEQ_SECRET", SECRET)
        node0 = launch_here("--nnodes", "2", "--node-rank", "0", "--master-addr", "127.0.0.1",
                            "--master-port", str(port), "--out", str(tmp_path / "node0"), "--steps", "3",
                            "--start-timeout", "10")
        err0 = node0.stderr
        _, err1 = node1.communicate(timeout=30)
    finally:
        if node1.poll() is None:
            node1.kill()
            node1.communicate()
    assert node0.returncode == 1, err0
    assert "timed out after 10.0 s waiting for READY (start) from stage(s) [1, 2]" in err0, err0
    assert "node 1 uses another secret: its entries ['agent/1']" in err0, err0
    assert node1.returncode == 1, err1
    assert "ignoring the rendezvous store's 'control' entry" in err1, err1  # said at once
    assert ("node 1: node 0's control address ('control' at the rendezvous 127.0.0.1:" in err1
            and "different secrets" in err1), err1
    assert "started stage(s)" not in err1  # nothing was started with the wrong secret


@pytest.mark.timeout(120)
def test_a_run_that_node_0_ends_on_a_full_disk_fails_on_every_node(tmp_path, monkeypatch) -> None:
    """Node 0's own error (its model.pt finds the disk full) ends the run: node 1's agent is told
    the run failed and exits 1 as node 0 does, not 0 as after a run that went well."""
    import errno

    from pipeq.checkpoint import atomic

    write_file = atomic.write_file

    def writing(path, write):
        if os.path.basename(path) == "model.pt.tmp":
            raise OSError(errno.ENOSPC, "No space left on device")
        return write_file(path, write)

    monkeypatch.setattr(atomic, "write_file", writing)
    port = free_port()
    steps = ("--steps", "2", "--checkpoint-every", "0")
    node1 = _loopback_node(1, port, str(tmp_path / "node1"), *steps, env=secret_env())
    try:
        monkeypatch.setenv("PIPEQ_SECRET", SECRET)
        node0 = launch_here("--nnodes", "2", "--node-rank", "0", "--master-addr", "127.0.0.1",
                            "--master-port", str(port), "--out", str(tmp_path / "node0"), *steps)
        _, err1 = node1.communicate(timeout=60)
    finally:
        if node1.poll() is None:
            node1.kill()
            node1.communicate()
    assert node0.returncode == 1, node0.stderr
    assert "no space left" in node0.stderr.lower(), node0.stderr
    assert node1.returncode == 1, err1
    assert "node 1: the driver ended the run after a failure" in err1, err1


@pytest.mark.timeout(120)
def test_sigterm_to_every_node_checkpoints_and_each_exits_143(tmp_path) -> None:
    """A batch system's cancel signals every process of every node at once: the agents leave the
    stopping to the driver, which finishes the steps in flight and checkpoints the last one."""
    port = free_port()
    out0 = str(tmp_path / "node0")
    argv = {r: launch_cmd("--nnodes", "2", "--node-rank", str(r), "--master-addr", "127.0.0.1",
                          "--master-port", str(port), "--out", out0 if r == 0 else str(tmp_path / "node1"),
                          "--steps", "100000") for r in (0, 1)}
    nodes = {r: subprocess.Popen(argv[r], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                 env=secret_env(), start_new_session=True) for r in (1, 0)}
    try:
        _wait_for(lambda: os.path.exists(os.path.join(out0, "metrics.jsonl")) and len(metrics(out0)) >= 3,
                  90, "three steps")
        for p in nodes.values():
            os.killpg(p.pid, signal.SIGTERM)
        done = {r: p.communicate(timeout=60) for r, p in nodes.items()}
    finally:
        for p in nodes.values():
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.communicate()
    assert nodes[0].returncode == 143, done[0][1]
    assert nodes[1].returncode == 143, done[1][1]
    steps = [m["step"] for m in metrics(out0) if "step" in m]
    assert steps == list(range(1, steps[-1] + 1))
    assert os.path.isdir(os.path.join(out0, "checkpoints", f"step-{steps[-1]:08d}")), os.listdir(out0)
