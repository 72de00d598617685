"""``pipeq launch`` with tensor parallelism: ``tensor_parallel`` and ``tp_plan`` in a job file.

A job run with T=2 over two nodes on loopback (each stage's two shards on the node that runs
the stage) must train as the same job at T=1 does (within float tolerance: a
rowwise layer sums its partial products in another order); a bad plan in a job file is refused
before anything starts (tests/unit/launch/test_tp_job_checks.py).
"""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
import torch

from launch_util import SUPPORT, free_ports, metrics, model_state, secret_env
from tp_jobs import JOB, _in_tests, _launch

pytestmark = pytest.mark.timeout(300)


def test_job_file_tensor_parallel_over_two_nodes_matches_t1(tmp_path, capfd) -> None:
    job = tmp_path / "tp.toml"
    job.write_text(JOB)
    outs = {name: str(tmp_path / name) for name in ("t1", "nodes")}
    port = free_ports(1)[0]
    node = ("--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", str(port))
    nodes = {r: subprocess.Popen([sys.executable, "-m", "pipeq", *_launch(str(job), outs["nodes"], *node,
                                                                         "--node-rank", str(r))],
                                 cwd=SUPPORT, env=secret_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 text=True) for r in (1, 0)}
    try:
        # meanwhile, the same job at T=1 on this host (in this process: no interpreter to start)
        assert _in_tests(_launch(str(job), outs["t1"], "--tensor-parallel", "1")) == 0
        results = {r: p.communicate(timeout=240) for r, p in nodes.items()}
    finally:
        for p in nodes.values():
            if p.poll() is None:
                p.kill()
                p.communicate()
    for r, p in nodes.items():
        assert p.returncode == 0, f"node {r}: {results[r][1][-3000:]}"
    assert "starting 6 stage processes (3 stages x 2 shards)" in results[0][1]
    # node 1 runs stages 1 and 2 (the default placement of 3 stages on 2 nodes): their leads
    # (processes 1, 2) and their shards 1 (processes 3 + 1, 3 + 2), all on the node's host
    started = re.search(r"node 1: started stage\(s\) (\[[\d, ]*\])", results[1][1])
    assert started is not None, results[1][1][-2000:]
    assert started.group(1) == "[1, 2, 4, 5]"
    reference, got = metrics(outs["t1"]), metrics(outs["nodes"])
    assert [m["step"] for m in got] == [m["step"] for m in reference]
    for a, b in zip(got, reference):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5, abs=1e-6)
    ref_state, state = model_state(outs["t1"]), model_state(outs["nodes"])
    assert state.keys() == ref_state.keys()
    for k in ref_state:
        torch.testing.assert_close(state[k], ref_state[k], rtol=1e-5, atol=1e-6, msg=k)
    assert reference[-1]["loss"] < reference[0]["loss"]
