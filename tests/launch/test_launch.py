"""``pipeq launch``: a job file trains, writes what it claims, checkpoints and resumes exactly."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from launch_util import ROOT, assert_same_state, digits_model, launch_here, metrics, model_state, tensorboard_scalars

pytestmark = pytest.mark.timeout(300)


def _bad_job(directory) -> str:
    """A copy of the digits job whose last stage raises in its forward."""
    job = directory / "bad.toml"
    job.write_text(
        open(os.path.join(ROOT, "examples", "digits.toml")).read()
        .replace('stages = "examples.digits_job:stages"', 'stages = "tests_bad_job:stages"')
    )
    (directory / "tests_bad_job.py").write_text(
        "import torch\nfrom torch import nn\n"
        "class Boom(nn.Module):\n"
        "    def __init__(self):\n        super().__init__()\n        self.l = nn.Linear(128, 10)\n"
        "    def forward(self, x):\n        raise RuntimeError('boom in the last stage')\n"
        "def stages():\n"
        "    return [nn.Sequential(nn.Linear(64, 128), nn.ReLU()), nn.Sequential(nn.Linear(128, 128)), Boom()]\n"
    )
    return str(job)


@pytest.fixture(scope="module")
def launched(tmp_path_factory) -> dict[str, tuple[str, subprocess.CompletedProcess]]:
    """Three independent runs; each one's output directory and result. ``bad`` runs as the
    command a user types (a subprocess) while the other two run in this process.

    ``full``: 40 steps in one go, checkpointing every 20 (the reference of the resume test).
    ``fresh``: 20 steps with --resume in an empty directory: it starts fresh (one test) and is the
    first half of the resumed run (another test: one launch serves both).
    ``bad``: a job whose last stage raises.
    """
    outs = {name: str(tmp_path_factory.mktemp(name) / "run") for name in ("full", "fresh", "bad")}
    bad = tmp_path_factory.mktemp("bad-job")
    p = subprocess.Popen([sys.executable, "-m", "pipeq", "launch", _bad_job(bad), "--quiet", "--steps", "3",
                          "--out", outs["bad"]], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        results = {
            "full": launch_here("--steps", "40", "--checkpoint-every", "20", "--eval-every", "20",
                                "--out", outs["full"], "--trace", os.path.join(outs["full"], "trace.json")),
            "fresh": launch_here("--steps", "20", "--checkpoint-every", "20", "--out", outs["fresh"], "--resume"),
        }
        stdout, stderr = p.communicate(timeout=200)
        results["bad"] = subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr)
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()
    return {name: (outs[name], results[name]) for name in outs}


@pytest.fixture(scope="module")
def uninterrupted(launched) -> str:
    """40 steps in one go, checkpointing every 20 (the reference of the resume test)."""
    out, r = launched["full"]
    assert r.returncode == 0, r.stderr
    return out


def test_launch_trains_and_writes_state_and_metrics(uninterrupted: str, launched) -> None:
    out = uninterrupted
    lines = metrics(out)
    assert [ln["step"] for ln in lines] == list(range(1, 41))
    assert all(ln["loss"] > 0 and ln["samples_per_s"] > 0 for ln in lines)
    first = sum(ln["loss"] for ln in lines[:5]) / 5
    last = sum(ln["loss"] for ln in lines[-5:]) / 5
    assert last < 0.5 * first, (first, last)
    evaluated = [ln for ln in lines if "eval_accuracy" in ln]
    assert [ln["step"] for ln in evaluated] == [20, 40]
    # model.pt is the flat model's state_dict, and it scores what the metrics say it scores
    import sys

    sys.path.insert(0, ROOT)
    from examples.digits_job import heldout

    x, y = heldout()
    model = digits_model(model_state(out))
    acc = float((model(x).argmax(1) == y).float().mean())
    assert acc == pytest.approx(lines[-1]["eval_accuracy"], abs=1e-6)
    assert acc > 0.85
    # the first step's line holds every byte each stage holds (runner.memory(), logged as a table too): SGD's
    # momentum is one buffer per parameter; 1F1B's activation peak is what its plan predicts
    from examples.digits_job import stages

    memory = lines[0]["memory"]
    assert all("memory" not in ln for ln in lines[1:]) and "memory per stage" in launched["full"][1].stderr
    assert [(m["stage"], m["replica"]) for m in memory] == [(0, 0), (1, 0), (2, 0)]
    for m, stage in zip(memory, stages()):
        size = sum(p.numel() * p.element_size() for p in stage.parameters())
        assert m["param_bytes"] == m["grad_bytes"] == m["optimizer_bytes"] == size, m
        assert m["measured_step"] == 1 and m["in_flight"] == 3 - m["stage"], m
        assert m["activation_peak_bytes"] == pytest.approx(m["predicted_activation_bytes"], rel=0.05), m
    for d in ("final", "checkpoints/step-00000020", "checkpoints/step-00000040"):
        with open(os.path.join(out, d, "manifest.json")) as f:
            manifest = json.load(f)
        assert manifest["n_stages"] == 3 and manifest["meta"]["step"] == int(d[-2:]) if "step" in d else True
    # TensorBoard's event files (the tensorboard key's default): the same numbers at the same steps
    tb = tensorboard_scalars(out)
    if tb is not None:
        assert f"tensorboard: {out}/tb (tensorboard --logdir {out}/tb)" in launched["full"][1].stdout
        assert tb["train/loss"] == [(ln["step"], pytest.approx(ln["loss"], rel=1e-6)) for ln in lines]
        assert tb["train/lr"] == [(ln["step"], pytest.approx(ln["lr"], rel=1e-6)) for ln in lines]
        assert [s for s, _ in tb["train/samples_per_s"]] == list(range(1, 41))
        assert tb["eval/accuracy"] == [(ln["step"], pytest.approx(ln["eval_accuracy"], rel=1e-6)) for ln in evaluated]
        # the run is traced: each stage's busy time and bubble in each step, from the trace
        for k in range(3):
            assert [s for s, v in tb[f"busy_ms/stage{k}"] if v > 0] == list(range(1, 41))
            assert all(0 <= v <= 1 for _, v in tb[f"bubble/stage{k}"])


def test_resume_continues_to_the_same_parameters(uninterrupted: str, launched, tmp_path) -> None:
    out = str(tmp_path / "run")
    first_out, first = launched["fresh"]  # 20 steps, checkpointed at 20
    assert first.returncode == 0, first.stderr
    shutil.copytree(first_out, out)  # resume a copy: the fixture's run stays as it was
    resumed = launch_here("--steps", "40", "--checkpoint-every", "20", "--out", out, "--resume")
    assert resumed.returncode == 0, resumed.stderr
    assert "resumed from" in resumed.stderr and "step 20" in resumed.stderr
    # the same parameters as 40 steps in one go: weights, momentum, lr schedule and data order
    assert_same_state(model_state(out), model_state(uninterrupted))
    assert [ln["step"] for ln in metrics(out)] == list(range(1, 41))
    tb = tensorboard_scalars(out)  # the resumed run appended an event file of its own
    if tb is not None:
        assert len(os.listdir(os.path.join(out, "tb"))) == 2
        assert tb["train/loss"] == [(ln["step"], pytest.approx(ln["loss"], rel=1e-6)) for ln in metrics(out)]


def test_resume_of_a_finished_run_starts_no_stage(launched, tmp_path, monkeypatch) -> None:
    """--resume of a run that trained all its steps says so, and starts no process (exit 0)."""
    from pipeq.control.runner import PipelineRunner

    out = str(tmp_path / "run")
    first_out, first = launched["fresh"]  # 20 steps: its final state is step 20
    assert first.returncode == 0, first.stderr
    shutil.copytree(first_out, out)
    before = metrics(out)

    def refuse(self):
        raise AssertionError("a finished run's --resume started the stages")

    monkeypatch.setattr(PipelineRunner, "start", refuse)
    again = launch_here("--steps", "20", "--checkpoint-every", "20", "--out", out, "--resume")
    assert again.returncode == 0, again.stderr
    assert "already trained all 20 steps" in again.stderr and "no stage started" in again.stderr
    assert "starting" not in again.stderr and again.stdout == ""
    assert metrics(out) == before


def test_resume_without_checkpoint_starts_fresh(launched) -> None:
    out, r = launched["fresh"]
    assert r.returncode == 0, r.stderr
    assert "no complete checkpoint" in r.stderr
    assert len(metrics(out)) == 20


def test_failing_stage_exits_nonzero_with_its_traceback(launched) -> None:
    _, r = launched["bad"]  # the job's last stage raises in its forward
    assert r.returncode == 1
    assert "stage 2 failed" in r.stderr
    assert "boom in the last stage" in r.stderr and "Traceback" in r.stderr


def test_bad_job_file_is_refused_with_the_key(tmp_path) -> None:
    job = tmp_path / "typo.toml"
    job.write_text(open(os.path.join(ROOT, "examples", "digits.toml")).read() + "\nmicrobatchs = 4\n")
    r = launch_here(job=str(job))
    assert r.returncode == 2
    assert "unknown key(s) ['microbatchs']" in r.stderr


def test_nodes_started_with_different_jobs_are_refused(tmp_path, monkeypatch) -> None:
    """A node with another schedule or seed would deadlock or train apart: both nodes say so.
    (Node 0 runs in this process, node 1 as the command.)"""
    from launch_util import SECRET, free_port, launch_cmd, secret_env

    port = str(free_port())
    common = ("--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", port, "--steps", "3")
    node1 = subprocess.Popen(launch_cmd(*common, "--node-rank", "1", "--out", str(tmp_path / "n1"),
                                        "--schedule", "fill-drain"),
                             cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=secret_env())
    try:
        monkeypatch.setenv("PIPEQ_SECRET", SECRET)
        node0 = launch_here(*common, "--node-rank", "0", "--out", str(tmp_path / "n0"))
        _, err1 = node1.communicate(timeout=60)
    finally:
        if node1.poll() is None:
            node1.kill()
            node1.communicate()
    expected = "schedule is '1f1b' on node 0 but 'fill-drain' here"
    assert node0.returncode == 1 and expected in node0.stderr, node0.stderr
    assert node1.returncode == 1 and expected in err1, err1


def test_embedded_runner_as_node_0_of_a_two_node_run(tmp_path) -> None:
    """A script embeds PipelineRunner with a recipe as node 0; node 1 is `pipeq launch`. The job
    holds two stages per process (zbv, V placement): node 0 runs the process of stages 0 and 3,
    node 1 the one of stages 1 and 2, and the run computes the simulated run's bits."""
    import subprocess
    import sys

    import torch

    import pipeq
    from launch_util import SECRET, free_port, secret_env
    from pipeq.launch.job import load_job

    sys.path.insert(0, ROOT)
    from examples.digits_job import train_batches

    job_file = tmp_path / "zbv.toml"
    job_file.write_text('stages = "examples.digits_job:four_stages"\nloss = "torch.nn:CrossEntropyLoss"\n'
                        'optimizer = "torch.optim:SGD"\noptimizer_args = { lr = 0.05, momentum = 0.9 }\n'
                        'data = "examples.digits_job:train_batches"\nschedule = "zbv"\nmicrobatches = 4\n'
                        'steps = 20\nseed = 0\n')
    job = load_job(str(job_file))
    data = train_batches(0)[:20]
    with pipeq.PipelineRunner(job.recipe, None, None, job.schedule, job.microbatches, mode="simulated") as ref:
        want = [ref.step(x, y) for x, y in data]
        want_state = ref.state_dict()
    port = free_port()
    secret_file = tmp_path / "job.secret"  # node 0 takes the secret from a file, node 1 from its env
    secret_file.write_text(SECRET + "\n")
    secret_file.chmod(0o600)
    node1 = subprocess.Popen(
        [sys.executable, "-m", "pipeq", "launch", str(job_file), "--quiet", "--threads-per-stage", "1",
         "--nnodes", "2", "--node-rank", "1", "--master-addr", "127.0.0.1", "--master-port", str(port),
         "--out", str(tmp_path / "n1")],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=secret_env())
    try:
        rz = pipeq.Rendezvous.from_settings(nnodes=2, node_rank=0, master_addr="127.0.0.1", master_port=port,
                                            env={}, secret_file=str(secret_file))
        runner = pipeq.PipelineRunner(job.recipe, None, None, job.schedule, job.microbatches,
                                      threads_per_stage=1, rendezvous=rz, start_method="forkserver")
        with runner:
            losses = [runner.step(x, y) for x, y in data]
            state = runner.state_dict()
        assert losses[-1] < losses[0]
        assert losses == want
        assert list(state) == list(want_state) and all(torch.equal(state[k], want_state[k]) for k in state)
        _, err1 = node1.communicate(timeout=60)
        assert node1.returncode == 0, err1
        assert "started stage(s) [1, 2] (pids [" in err1 and "]), driver" in err1
        assert len(err1.split("(pids [")[1].split("]")[0].split(",")) == 1  # one process holds both
    finally:
        if node1.poll() is None:
            node1.kill()
            node1.communicate()


@pytest.mark.parametrize("given", ["nothing", "a file others may read"])
def test_multi_host_without_a_usable_secret_refuses_to_start(tmp_path, monkeypatch, capsys, given) -> None:
    """Refused before anything starts, saying what to do (exit code 2)."""
    from launch_util import DIGITS_JOB, SECRET
    from pipeq.launch.cli import main

    monkeypatch.delenv("PIPEQ_SECRET", raising=False)
    loose = tmp_path / "loose.secret"
    loose.write_text(SECRET)
    loose.chmod(0o644)
    argv = ["launch", DIGITS_JOB, "--nnodes", "2", "--node-rank", "0", "--master-addr", "127.0.0.1",
            "--out", str(tmp_path / "out")]
    if given != "nothing":
        argv += ["--secret-file", str(loose)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    if given == "nothing":
        assert "a multi-host run needs the job's secret on every node" in err, err
        assert "python -m pipeq secret" in err and "--secret-file" in err and "PIPEQ_SECRET" in err, err
    else:
        assert f"the secret file {loose} is readable by others (mode 644); chmod 600 {loose}" in err, err
    assert not os.path.exists(tmp_path / "out")  # nothing started


def test_launch_trace_covers_every_step_of_every_stage(uninterrupted: str) -> None:
    with open(os.path.join(uninterrupted, "trace.json")) as f:
        t = json.load(f)
    events = [e for e in t["traceEvents"] if e["ph"] == "X"]
    for k in range(3):
        steps = {e["args"]["step"] for e in events if e["tid"] == k and e["cat"] == "forward"}
        assert len(steps) >= 40  # 40 training steps (and the evaluations' forward passes)
