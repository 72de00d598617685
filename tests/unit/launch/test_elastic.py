"""Multi-host restarts without processes: what node 0 decides after a failed start (wait, go on,
re-place, give up), the generations agents join, the placement over fewer nodes, and the
rejoin_timeout / min_nodes keys and flags."""

from __future__ import annotations

import datetime
import json
import threading
import time

import pytest

from launch_util import DIGITS_JOB, SECRET
from pipeq.control import rendezvous as rdzv
from pipeq.launch import elastic
from pipeq.launch.elastic import GIVE_UP, GO, REPLACE, WAIT, Decision, Elastic, decide
from pipeq.launch.job import load_job
from pipeq.wire.keys import JobSecret


def _rz(node_rank: int = 0, port: int = 1, nnodes: int = 2, secret: str = SECRET) -> rdzv.Rendezvous:
    return rdzv.Rendezvous(nnodes=nnodes, node_rank=node_rank, master_addr="127.0.0.1", master_port=port,
                           bind="127.0.0.1", agent_store=True, secret=JobSecret.from_text(secret))


@pytest.fixture
def port():
    """A rendezvous store hosted in this process (the Elastic under test connects as a client)."""
    from torch.distributed import TCPStore

    host = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=10))
    yield host.port


def test_decide_waits_then_goes_on_re_places_or_gives_up() -> None:
    assert decide([0, 1, 2], [1, 2], 3, False) == Decision(GO, (0, 1, 2))
    assert decide([0, 1, 2], [2], 3, False) == Decision(WAIT, (0, 1, 2), (1,))
    assert decide([0, 1, 2], [2], 2, True) == Decision(REPLACE, (0, 2), (1,))
    assert decide([0, 1, 2], [2], 3, True) == Decision(GIVE_UP, (0, 2), (1,))
    assert decide([0, 1, 2], [], 1, True) == Decision(REPLACE, (0,), (1, 2))
    assert decide([0, 2], [2], 2, True) == Decision(GO, (0, 2))  # a re-placed run waits for its nodes only
    assert decide([0], [], 1, True) == Decision(GO, (0,))


def test_placement_over_the_nodes_left() -> None:
    assert rdzv.placement_over(3, 2, None) == [[0], [1, 2]]
    assert rdzv.placement_over(3, 2, [0, 1], [[0, 1], [2]]) == [[0, 1], [2]]  # every node: the job's own
    assert rdzv.placement_over(3, 2, [0]) == [[0, 1, 2], []]
    assert rdzv.placement_over(4, 3, [0, 2]) == [[0, 1], [], [2, 3]]
    with pytest.raises(ValueError, match="node 0"):
        rdzv.placement_over(3, 3, [1, 2])


def test_generations_have_their_own_prefix_and_signatures() -> None:
    rz = _rz()
    assert rz.prefix == "pipeq/pipeq/" and rz.at(2).prefix == "pipeq/pipeq/g2/"
    # an entry of one start is not one of another's: it is signed for its full key
    assert rz.at(2).verify("control", rz.at(1).sign("control", "tcp://x:1")) == (False, None)
    assert rz.at(1).verify("control", rz.at(1).sign("control", "tcp://x:1")) == (True, "tcp://x:1")


def _announce(port: int, node: int, generation: int, *, secret: str = SECRET, value: dict | None = None) -> None:
    agent = _rz(node, port, 3, secret).at(generation)
    store = agent.store(5)
    entry = value if value is not None else {"node": node, "generation": generation}
    store.set(f"agent/{node}", agent.sign(f"agent/{node}", entry))


@pytest.mark.timeout(30)
def test_regroup_goes_on_with_the_nodes_that_say_they_are_there(port) -> None:
    said: list[str] = []
    el = Elastic(_rz(0, port, 3), rejoin_timeout=5, min_nodes=None, start_timeout=5, log=said.append)
    el.open()
    try:
        assert elastic.pointer(el.store, el.rz) == {"generation": 0, "rejoin_timeout": 5.0, "nodes": [0, 1, 2]}
        _announce(port, 1, 1)
        _announce(port, 2, 1)
        t0 = time.monotonic()
        assert el.regroup(3) == Decision(GO, (0, 1, 2))
        assert time.monotonic() - t0 < 2 and said == []  # nobody was lost: nothing to say
        assert elastic.pointer(el.store, el.rz)["generation"] == 1
        rz = el.rendezvous()
        assert (rz.generation, rz.nodes, rz.agent_store) == (1, None, True)
    finally:
        el.close()


@pytest.mark.timeout(30)
def test_regroup_ignores_stale_and_foreign_agents_and_names_a_node_that_rejoins(port) -> None:
    said: list[str] = []
    el = Elastic(_rz(0, port, 3), rejoin_timeout=20, min_nodes=None, start_timeout=5, log=said.append)
    el.open()
    try:
        _announce(port, 1, 1)  # a live agent, at once
        _announce(port, 2, 0)  # node 2's stale entry (the last start's prefix): not for this start
        _announce(port, 2, 1, secret="another secret, of at least 32 characters")  # not the job's
        _announce(port, 2, 1, value={"node": 1, "generation": 1})  # node 1's entry moved under node 2's key

        def comes_back() -> None:  # node 2 started again, after node 0 said it was lost
            while not said:
                time.sleep(0.05)
            _announce(port, 2, 1)

        t = threading.Thread(target=comes_back)
        t.start()
        decision = el.regroup(3)
        t.join()
        assert decision == Decision(GO, (0, 1, 2), rejoined=(2,))
        assert said == ["node 2 lost; waiting up to 20 s for it to rejoin (pipeq launch ... --node-rank 2 "
                        "started again, on any host)", "node 2 rejoined"], said
    finally:
        el.close()


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.now += s


@pytest.mark.timeout(30)
def test_regroup_re_places_or_gives_up_after_the_rejoin_timeout(port) -> None:
    said: list[str] = []
    clock = _Clock()
    el = Elastic(_rz(0, port, 3), rejoin_timeout=60, min_nodes=2, start_timeout=5, log=said.append, clock=clock,
                 sleep=clock.sleep)
    el.open()
    try:
        _announce(port, 2, 1)
        assert el.regroup(3) == Decision(REPLACE, (0, 2), (1,))
        assert 60 <= clock.now < 61
        assert said[-1] == "node 1 did not rejoin within 60 s; re-placing stages [1] on nodes [0, 2] (min_nodes = 2)"
        rz = el.rendezvous()
        assert rz.nodes == (0, 2) and rdzv.placement_over(3, 3, rz.nodes) == [[0], [], [1, 2]]
        assert elastic.pointer(el.store, el.rz)["nodes"] == [0, 2]  # node 1, if it comes now, is told
        # the next failure: node 2 is lost too, and one node is fewer than min_nodes
        assert el.regroup(3) == Decision(GIVE_UP, (0,), (2,))
        assert "node 2 did not rejoin within 60 s, and the 1 node(s) left are fewer than min_nodes = 2" in said[-1]
        assert "--node-rank 2" in said[-1] and "--min-nodes 1" in said[-1]
    finally:
        el.close()


@pytest.mark.timeout(30)
def test_an_agent_joins_the_generation_node_0_points_at(port) -> None:
    from pipeq.launch.agent import AgentError, _next_generation, _NotNeeded

    node0, agent = _rz(0, port), _rz(1, port)
    store = agent.store(5)
    lines: list[str] = []
    assert _next_generation(store, agent, -1, time.monotonic() + 1, 1, lines.append) == 0  # no restarts: 0
    store.set(rdzv.GENERATION, node0.sign(rdzv.GENERATION, {"generation": 3, "rejoin_timeout": 9}))
    assert _next_generation(store, agent, -1, time.monotonic() + 1, 1, lines.append) == 3  # a late node
    # after generation 3 failed: a replayed older pointer is no new start; a forged newer one is ignored
    store.set(rdzv.GENERATION, json.dumps({"generation": 7}).encode())
    with pytest.raises(AgentError, match="did not start the run again within 1 s"):
        _next_generation(store, agent, 3, time.monotonic() + 0.3, 1, lines.append)
    store.set(rdzv.GENERATION, node0.sign(rdzv.GENERATION, {"generation": 4, "rejoin_timeout": 9}))
    assert _next_generation(store, agent, 3, time.monotonic() + 1, 1, lines.append) == 4
    # the run went on without node 1 (its stages re-placed): it is told so, and exits 0
    store.set(rdzv.GENERATION, node0.sign(rdzv.GENERATION, {"generation": 5, "rejoin_timeout": 9, "nodes": [0]}))
    with pytest.raises(_NotNeeded, match="the run goes on without this node"):
        _next_generation(store, agent, -1, time.monotonic() + 1, 1, lines.append)


def test_rejoin_timeout_and_min_nodes_keys_and_flags(tmp_path) -> None:
    import argparse

    from pipeq.launch.args import add_arguments, job_overrides

    job = load_job(DIGITS_JOB)
    assert (job.rejoin_timeout, job.min_nodes) == (60.0, None)
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args([DIGITS_JOB, "--rejoin-timeout", "5", "--min-nodes", "1"])
    job = load_job(DIGITS_JOB, job_overrides(args))
    assert (job.rejoin_timeout, job.min_nodes) == (5.0, 1)
    for bad, match in (({"rejoin_timeout": 0}, "rejoin_timeout must be more than 0"),
                       ({"min_nodes": 0}, "min_nodes must be at least 1")):
        with pytest.raises(ValueError, match=match):
            load_job(DIGITS_JOB, bad)
    with pytest.raises(ValueError, match="min_nodes = 3, but the run has 2 node"):
        Elastic.of(load_job(DIGITS_JOB, {"min_nodes": 3, "max_restarts": 1}), _rz(), print)
    assert Elastic.of(load_job(DIGITS_JOB, {"min_nodes": 1}), _rz(), print) is None  # no restarts: no regroup
    assert Elastic.of(load_job(DIGITS_JOB, {"max_restarts": 1}), None, print) is None  # one host
