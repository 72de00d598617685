"""bench/bench_gpu.py runs on the CPU (``--device cpu --quick``), every part, so that it does not rot
before a GPU runs it; ``--device cuda`` without CUDA says so and exits 2."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys

import pytest
import torch

from strays import assert_session_ends

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository
SCRIPT = os.path.join(ROOT, "bench", "bench_gpu.py")

pytestmark = pytest.mark.timeout(200)


def _run(args: list[str], timeout: float = 160) -> tuple[int, str]:
    """The script in a session of its own: on a timeout the whole session is killed, and either way
    none of its processes may outlive it."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen([sys.executable, SCRIPT, *args], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"bench_gpu.py ran past {timeout} s:\n{out}")
    assert_session_ends(proc.pid, "bench_gpu.py")
    return proc.returncode, out


def _finite(*values: object) -> bool:
    return all(isinstance(v, (int, float)) and math.isfinite(v) for v in values)


def test_quick_cpu_run_has_every_part(tmp_path):
    path = tmp_path / "bench_gpu.json"
    rc, out = _run(["--device", "cpu", "--quick", "--json", str(path)])
    assert rc == 0, out
    got = json.loads(path.read_text())
    parts = got["parts"]
    assert set(parts) == {"gpt", "ipc", "slots", "memory"}, out
    assert all(p["status"] == "ok" for p in parts.values()), {k: p["status"] for k, p in parts.items()}

    gpt = parts["gpt"]["rows"]
    assert [(r["run"], r["schedule"], r["processes"], r["stages"]) for r in gpt] == [
        ("one process", "-", 1, 1), ("one process, microbatches", "-", 1, 1),
        ("pipeq one device", "1f1b", 2, 2), ("pipeq one device", "zb-h1", 2, 2), ("pipeq one device", "zbv", 2, 4),
        ("pipeq one process", "interleaved-1f1b", 1, 2),
        ("pipeq one device, compiled", "1f1b", 2, 2), ("pipeq one device, compiled", "zb-h1", 2, 2),
        ("pipeq one device, compiled", "zbv", 2, 4)]
    for r in gpt:
        assert r["status"] == "ok" and _finite(r["step_ms"], r["ratio"], r["loss_max_diff"], *r["losses"]), r
        assert r["step_ms"] > 0 and r["loss_max_diff"] < 0.05, r  # the same model and batches: the same losses
    assert "pipeq's overhead, not a speed-up" in out

    for r in parts["ipc"]["rows"]:
        assert r["status"] == "ok" and _finite(r["eval_ms"], r["whole_gib_s"], r["copy_ms"], r["copy_gib_s"]), r
        assert r["transfer_ms"] is None or _finite(r["transfer_ms"], r["gib_s"]), r
    assert [r["mib"] for r in parts["ipc"]["rows"]] == [1, 16]
    assert parts["ipc"]["max_message_mb"] > 16

    slots = {r["schedule"]: r for r in parts["slots"]["rows"]}
    assert set(slots) == {"1f1b", "zb-h1", "zbv"}
    for r in slots.values():
        assert r["status"] == "ok" and _finite(r["step_ms"], r["ideal_ms"], r["slots"], r["ms_per_slot"],
                                                r["work_ms"]), r
        assert r["step_ms"] >= 0.9 * r["ideal_ms"], r  # a step cannot beat its plan's critical path
    assert slots["1f1b"]["slots"] == 2 * (4 + 2 - 1)  # 2(m + N - 1) at m = 4, N = 2
    assert slots["1f1b"]["work_ms"] == 4 * (2 * 3 - 1)  # m(N(F + I + W) - stage 0's I), 1 ms each

    memory = parts["memory"]["rows"]
    assert {(r["schedule"], r["stage"]) for r in memory} == {
        ("1f1b", 0), ("1f1b", 1), ("zb-h1", 0), ("zb-h1", 1), ("zbv", 0), ("zbv", 1), ("zbv", 2), ("zbv", 3),
        ("interleaved-1f1b", 0), ("interleaved-1f1b", 1)}
    assert all(r["activation_peak_bytes"] > 0 and r["device_peak_bytes"] is None for r in memory), memory


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a machine without CUDA")
def test_cuda_without_cuda_exits_2():
    rc, out = _run(["--device", "cuda", "--quick"], timeout=60)
    assert rc == 2 and "CUDA is not available" in out and "Traceback" not in out, out
