"""Multi-host restarts (``--max-restarts``): a lost node rejoins, or its stages are re-placed, or
the run ends naming it; and a run whose driver was killed goes on with ``--resume``.

Two "hosts" (network namespaces joined by a veth pair): node 0 (driver + stage 0) on host A,
node 1 (stages 1 and 2) on host B. Node 1's stage 1 hangs at step 4 (``PIPEQ_FAULT``, so that the
loss comes mid-run, after step 2's checkpoint), and the test loses node 1: it SIGKILLs node 1's
whole process group (its agent and stages) and starts node 1 again, and the run resumes with it
(twice: the replacement is lost too, after step 4's checkpoint, and the next one starts on host
A); or it starts no replacement, and without ``--min-nodes`` the run ends once the rejoin timeout
has passed, naming node 1; or it cuts host B's link (no FIN, no RST: heartbeats name node 1's
stages, and node 1's agent, which lost the driver, stops its stages on its own) and
(``--min-nodes 1``) node 0 runs every stage itself. Or it SIGKILLs node 0 (the driver and the
store), and every node started again with ``--resume`` finishes the run. Every run that finishes
ends with the single-host run's weights, bit for bit: every start resumes from the newest
checkpoint with the same data order and RNG streams, and each stage computes the same operations
with one thread wherever it runs, so there is no tolerance to argue for (the plain multi-host
test allows 1e-6; these runs have not needed it). No test leaves a process on either host.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time

import pytest

from launch_util import REFERENCE_STEPS, ROOT, assert_same_state, launch_cmd, metrics, model_state, secret_env
from netns import TwoHosts

PORT = 29518
ARGS = ("--steps", str(REFERENCE_STEPS), "--checkpoint-every", "2", "--max-restarts", "2", "--heartbeat-timeout", "2")
HANG = "stage:1,step:4,kind:hang"  # node 1's stage 1 stops making progress at step 4 (heartbeats go on)


class Node:
    """One ``pipeq launch`` node in a namespace, in its own process group; stderr read as it comes."""

    def __init__(self, h: TwoHosts, rank: int, out: str, *extra: str, on: str | None = None, **env: str) -> None:
        """``on``: the host (namespace) to run on; by default host A for node 0, host B for node 1."""
        argv = launch_cmd("--nnodes", "2", "--node-rank", str(rank), "--master-addr", h.addr_a,
                          "--master-port", str(PORT), "--out", out, *ARGS, *extra)
        on = on or (h.a if rank == 0 else h.b)
        self.p = h.popen(on, argv, cwd=ROOT, stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE, text=True, env=secret_env(**env), start_new_session=True)
        self.lines: list[tuple[float, str]] = []  # each stderr line with when it came
        self._reader = threading.Thread(target=lambda: self.lines.extend((time.monotonic(), ln) for ln in self.p.stderr),
                                        daemon=True)
        self._reader.start()

    @property
    def err(self) -> str:
        return "".join(ln for _, ln in self.lines)

    def said_at(self, text: str) -> float:
        """When the first line holding ``text`` came."""
        return next(t for t, ln in self.lines if text in ln)

    def wait_for(self, text: str, timeout: float) -> None:
        end = time.monotonic() + timeout
        while text not in self.err:
            assert self.p.poll() is None or text in self.err, f"exited {self.p.returncode} before {text!r}:\n{self.err}"
            assert time.monotonic() < end, f"no {text!r} in {timeout} s:\n{self.err}"
            time.sleep(0.1)

    def finish(self, timeout: float) -> int:
        code = self.p.wait(timeout)
        self._reader.join(5)
        return code

    def kill(self) -> None:
        if self.p.poll() is None:
            os.killpg(self.p.pid, signal.SIGKILL)  # the agent and every stage it started
            self.p.wait(10)


def _checkpointed(node0: Node, out: str, step: int, *others: Node) -> None:
    """Wait until ``out`` holds step ``step``'s checkpoint (node 0 still running), and half a second more."""
    done = os.path.join(out, "checkpoints", f"step-{step:08d}", "manifest.json")
    end = time.monotonic() + 60
    while not os.path.exists(done):
        assert node0.p.poll() is None and time.monotonic() < end, node0.err + "".join(n.err for n in others)
        time.sleep(0.1)
    time.sleep(0.5)


def _nothing_left(h: TwoHosts, timeout: float = 10) -> None:
    """No process is left on either host (within ``timeout`` s: the last ones may still be exiting)."""
    end = time.monotonic() + timeout
    while (h.procs(h.a) or h.procs(h.b)) and time.monotonic() < end:
        time.sleep(0.1)
    assert not h.procs(h.a) and not h.procs(h.b), f"processes left on the hosts: {h.procs(h.a)} {h.procs(h.b)}"


def _lose_node_1(h: TwoHosts, out: str, *extra: str, cut: bool = False) -> tuple[Node, Node, float]:
    """Node 0 training, node 1 killed (its process group), or cut off (host B's link down, its
    processes left running), while its stage 1 hangs at step 4; and when that was done."""
    node1 = Node(h, 1, out + "-node1", *extra, PIPEQ_FAULT=HANG)
    node0 = Node(h, 0, out, *extra)
    try:
        # step 2's checkpoint is written (the driver reports step 3 only with step 4, which hangs)
        _checkpointed(node0, out, 2, node1)
        if cut:
            subprocess.run(h.cmd(h.b, ["ip", "link", "set", h.veth_b, "down"]), check=True)
        else:
            node1.kill()
        lost_at = time.monotonic()
    except BaseException:
        node0.kill()
        node1.kill()
        raise
    return node0, node1, lost_at


def _restart_record(out: str) -> dict:
    records = [m for m in metrics(out) if "restart" in m]
    assert len(records) == 1, records
    return records[0]


def _lost(node0: Node, times: int, timeout: float = 30) -> None:
    """Wait until node 0 has said ``times`` times that node 1 is lost."""
    end = time.monotonic() + timeout
    while node0.err.count("node 1 lost; waiting up to 40 s for it to rejoin") < times:
        assert node0.p.poll() is None and time.monotonic() < end, f"exited {node0.p.returncode}:\n{node0.err}"
        time.sleep(0.1)


@pytest.mark.timeout(120)
@pytest.mark.xdist_group("single_host_digits")
def test_a_killed_node_started_again_rejoins_and_the_run_ends_with_the_same_weights(hosts, request, tmp_path):
    """... twice: the replacement's own stage 1 hangs at its 4th step (step 6: it resumed from step
    2) and it is killed too, once step 4's checkpoint is written; the second replacement starts on
    host A (any host will do). Two restarts, from step 2's checkpoint and from step 4's."""
    h = hosts
    out = str(tmp_path / "run")
    node0, _, _ = _lose_node_1(h, out, "--rejoin-timeout", "40")
    again = again2 = None
    try:
        _lost(node0, 1)
        again = Node(h, 1, out + "-node1-again", PIPEQ_FAULT=HANG)  # a replacement node 1
        _checkpointed(node0, out, 4, again)
        again.kill()
        _lost(node0, 2)
        again2 = Node(h, 1, out + "-node1-again2", on=h.a)  # on node 0's host this time, without a fault
        assert node0.finish(60) == 0, node0.err
        assert again2.finish(20) == 0, again2.err
    finally:
        node0.kill()
        for node in (again, again2):
            if node is not None:
                node.kill()
    # either of node 1's stages is named first (their heartbeats stopped together)
    assert ("stage 1 failed" in node0.err or "stage 2 failed" in node0.err), node0.err
    assert node0.err.count("node 1 rejoined") == 2, node0.err
    assert "started stage(s) [1, 2]" in again.err and "started stage(s) [1, 2]" in again2.err, again2.err
    records = [m for m in metrics(out) if "restart" in m]
    assert len(records) == 2, records
    for record, step in zip(records, (2, 4)):
        assert record["nodes"] == 2 and record["lost_nodes"] == [1] and record["rejoined"] == [1], record
        assert record["resumed_from"] == step and not record["replaced"], record
    assert [m["step"] for m in metrics(out) if "loss" in m] == list(range(1, REFERENCE_STEPS + 1))
    assert_same_state(model_state(out), model_state(request.getfixturevalue("single_host_digits")))
    _nothing_left(h)


@pytest.mark.timeout(120)
@pytest.mark.xdist_group("single_host_digits")
def test_a_cut_off_node_with_min_nodes_1_has_its_stages_re_placed_on_node_0(hosts, request, tmp_path):
    """Host B's link goes down (no FIN, no RST): node 0's heartbeats name node 1's stages within
    seconds, node 1 is waited for and its stages re-placed on node 0; node 1's agent, which lost
    the driver, stops its stages on its own, and no process is left on either host."""
    h = hosts
    out = str(tmp_path / "run")
    node0, node1, cut_at = _lose_node_1(h, out, "--rejoin-timeout", "3", "--min-nodes", "1", cut=True)
    try:
        assert node0.finish(60) == 0, node0.err
        assert node1.finish(30) != 0, node1.err
    finally:
        node0.kill()
        node1.kill()
    err = node0.err
    assert "no heartbeat" in err and ("stage 1 failed" in err or "stage 2 failed" in err), err
    # when node 0 said so (not when it had exited: a busy machine slows that down); heartbeat timeout 2 s
    took = node0.said_at("no heartbeat") - cut_at
    assert took < 2 + 5, f"the driver took {took:.1f} s to notice the lost host"
    assert "lost the driver" in node1.err, node1.err
    assert "node 1 lost; waiting up to 3 s" in err, err
    assert "node 1 did not rejoin within 3 s; re-placing stages [1, 2] on node 0 (min_nodes = 1)" in err, err
    assert "starting 3 stages..." in err.split("re-placing")[1], err  # all three on node 0
    record = _restart_record(out)
    assert record["nodes"] == 1 and record["lost_nodes"] == [1] and record["replaced"], record
    assert [m["step"] for m in metrics(out) if "loss" in m] == list(range(1, REFERENCE_STEPS + 1))
    assert_same_state(model_state(out), model_state(request.getfixturevalue("single_host_digits")))
    end = time.monotonic() + 10
    while (h.procs(h.a) or h.procs(h.b)) and time.monotonic() < end:
        time.sleep(0.1)
    assert not h.procs(h.a) and not h.procs(h.b), "processes left on the hosts"


@pytest.mark.timeout(90)
@pytest.mark.xdist_group("single_host_digits")
def test_a_live_agent_takes_part_in_the_restart_after_a_stage_of_node_0_dies(hosts, request, tmp_path):
    """Node 0's stage 0 kills itself at step 4: node 1's agent, told the start failed, waits for
    the next one and starts its stages again (no node is lost, so nobody is waited for)."""
    h = hosts
    out = str(tmp_path / "run")
    node1 = Node(h, 1, out + "-node1")
    node0 = Node(h, 0, out, PIPEQ_FAULT="stage:0,step:4,kind:kill")
    try:
        assert node0.finish(60) == 0, node0.err
        assert node1.finish(20) == 0, node1.err
    finally:
        node0.kill()
        node1.kill()
    assert "stage 0 failed" in node0.err and "lost" not in node0.err, node0.err
    assert "waiting up to" in node1.err and node1.err.count("started stage(s) [1, 2]") == 2, node1.err
    record = _restart_record(out)
    assert record["nodes"] == 2 and record["lost_nodes"] == [] and record["stage"] == 0, record
    assert_same_state(model_state(out), model_state(request.getfixturevalue("single_host_digits")))


@pytest.mark.timeout(60)
def test_a_node_that_does_not_rejoin_in_time_ends_the_run_naming_it(hosts, tmp_path):
    """Without --min-nodes every node is needed: node 1 killed and not started again ends the run
    once the rejoin timeout has passed, with one line naming node 1 and what to do; node 0 exits 1,
    no process is left on either host, and the restart is on record with the node lost."""
    h = hosts
    out = str(tmp_path / "run")
    node0, node1, _ = _lose_node_1(h, out, "--rejoin-timeout", "1")
    try:
        assert node0.finish(30) == 1, node0.err
    finally:
        node0.kill()
        node1.kill()
    err = node0.err
    assert "node 1 lost; waiting up to 1 s" in err, err
    assert ("node 1 did not rejoin within 1 s, and the 1 node(s) left are fewer than min_nodes = 2: the run ends. "
            "Start node 1 again (pipeq launch ... --node-rank 1) with --resume on node 0, or allow fewer nodes "
            "(--min-nodes 1)") in err, err
    assert "restart 1 of 2" in err and "resumed from" not in err, err  # no stage started again
    _nothing_left(h)
    record = _restart_record(out)
    assert record["resumed_from"] is None and record["lost_nodes"] == [1] and record["nodes"] == 1, record
    assert "start_failed" in record and record["step"] == 3, record  # steps 1-3 trained, the checkpoint of 2 kept
    assert os.path.isdir(os.path.join(out, "checkpoints", "step-00000002")) and not os.path.exists(
        os.path.join(out, "model.pt"))


@pytest.mark.timeout(120)
@pytest.mark.xdist_group("single_host_digits")
def test_the_driver_killed_and_every_node_started_with_resume_ends_with_the_same_weights(hosts, request, tmp_path):
    """Node 0's whole process group (the driver, its store, its stage) SIGKILLed after step 2's
    checkpoint: node 1's agent stops its stages by itself (and exits 1); every node started again
    with --resume goes on from that checkpoint and ends with the single-host run's weights."""
    h = hosts
    out = str(tmp_path / "run")
    node1 = Node(h, 1, out + "-node1", PIPEQ_FAULT=HANG)
    node0 = Node(h, 0, out)
    resumed: list[Node] = []
    try:
        _checkpointed(node0, out, 2, node1)
        node0.kill()
        node1.wait_for("node 1: lost the driver", 30)  # it then stops its stages and exits: nothing to join
        resumed = [Node(h, 1, out + "-node1", "--resume"), Node(h, 0, out, "--resume")]
        assert node1.finish(30) == 1, node1.err
        assert resumed[1].finish(60) == 0, resumed[1].err
        assert resumed[0].finish(20) == 0, resumed[0].err
    finally:
        for n in (node0, node1, *resumed):
            n.kill()
    assert "step-00000002 (step 2, epoch 1)" in resumed[1].err, resumed[1].err  # "resumed from .../step-00000002"
    assert [m["step"] for m in metrics(out) if "loss" in m] == list(range(1, REFERENCE_STEPS + 1))
    assert_same_state(model_state(out), model_state(request.getfixturevalue("single_host_digits")))
    _nothing_left(h)


@pytest.mark.timeout(60)
def test_without_restarts_a_stage_of_node_1_that_dies_ends_the_run_on_every_node(hosts, tmp_path):
    """No --max-restarts: node 1's stage 1 killed at step 3 is named by node 0, which exits 1; node
    1's agent, told the run ended, stops its other stage and exits 1 too; no process is left."""
    h = hosts
    out = str(tmp_path / "run")
    node1 = Node(h, 1, out + "-node1", "--max-restarts", "0", PIPEQ_FAULT="stage:1,step:3,kind:kill")
    node0 = Node(h, 0, out, "--max-restarts", "0")
    try:
        assert node0.finish(60) == 1, node0.err
        assert node1.finish(20) == 1, node1.err
    finally:
        node0.kill()
        node1.kill()
    assert "stage 1 failed: stage process" in node0.err and "SIGKILL" in node0.err, node0.err
    assert "restart" not in node0.err and "waiting up to" not in node1.err, node1.err
    _nothing_left(h)
