"""The launch recipes in ``workers/``: each one trains the digits job on two pipeq nodes over
loopback to exactly the parameters of a single-host run.

The recipes are started from a scratch directory (not the repository root), so each one's own
``cd`` is exercised too. SLURM is faked: ``srun`` and ``scontrol`` stand-ins on PATH. Each recipe
passes the job's secret its own way: local.sh a ``SECRET_FILE``, torchrun.sh ``PIPEQ_SECRET``
(inherited by torchrun's workers), slurm.sbatch a file it makes for the job.
"""

from __future__ import annotations

import os
import shutil
import signal
import stat
import subprocess
import sys
import time

import pytest

from launch_util import REFERENCE_STEPS, ROOT, SECRET, assert_same_state, free_ports, model_state

WORKERS = os.path.join(ROOT, "workers")
LOCAL = os.path.join(WORKERS, "local.sh")
TORCHRUN = os.path.join(WORKERS, "torchrun.sh")
SLURM = os.path.join(WORKERS, "slurm.sbatch")
SCRIPTS = [LOCAL, TORCHRUN, SLURM]

STEPS = str(REFERENCE_STEPS)  # 6
ARGS = ["--threads-per-stage", "1", "--steps", STEPS, "--quiet"]  # deterministic, short


@pytest.fixture(scope="module")
def reference(single_host_digits: str) -> dict:
    """The single-host run every recipe must reproduce (conftest.py: shared with test_multihost)."""
    return model_state(single_host_digits)


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    # the caller's own multi-host settings must not leak into the recipes
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
              "NNODES", "NPROC_PER_NODE", "NODE_RANK", "JOB", "BIND", "WORKDIR",
              "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_RUN_ID", "PIPEQ_SECRET", "SECRET_FILE",
              "MAX_RESTARTS", "REJOIN_TIMEOUT", "MIN_NODES"):
        env.pop(k, None)
    for k in [k for k in env if k.startswith(("SLURM_", "SRUN_"))]:
        env.pop(k)
    env["PYTHON"] = sys.executable
    env.update(extra)
    return env


def _start(cmd: list[str], env: dict[str, str], cwd: str) -> subprocess.Popen:
    # own session: on a timeout the whole tree (torchrun's workers, fake srun's tasks) is ended
    return subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)


def _end_group(p: subprocess.Popen) -> None:
    """End p's whole process group (torchrun's workers, fake srun's tasks) if it still runs."""
    if p.poll() is not None:
        return
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(p.pid, sig)
        except ProcessLookupError:
            break
        try:
            p.wait(timeout=5)
            break
        except subprocess.TimeoutExpired:
            continue
    p.communicate()


def _finish(procs: list[subprocess.Popen], deadline: float) -> list[tuple[int, str, str]]:
    """(returncode, stdout, stderr) of each process; all are ended (their groups) if one is still
    running at ``deadline`` (time.monotonic())."""
    results = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=max(0.1, deadline - time.monotonic()))
            results.append((p.returncode, out, err))
    except subprocess.TimeoutExpired:
        for p in procs:
            _end_group(p)
        raise
    return results


def _report(results: list[tuple[int, str, str]]) -> str:
    return "\n".join(f"--- process {i}: exit {rc}\n{out}\n{err}" for i, (rc, out, err) in enumerate(results))


FAKE_SCONTROL = """#!/usr/bin/env bash
# fake scontrol: `scontrol show hostnames NODELIST` -> one host, 127.0.0.1
set -euo pipefail
[[ "$1 $2" == "show hostnames" && -n "$3" ]] || { echo "fake scontrol: unexpected: $*" >&2; exit 1; }
echo "$3" >> "$FAKE_SLURM_LOG.scontrol"
echo 127.0.0.1
"""

FAKE_SRUN = """#!/usr/bin/env bash
# fake srun: start $SLURM_NTASKS copies of the command with SLURM_PROCID=i, wait for all of them
set -uo pipefail
opts=()
while [[ $# -gt 0 && $1 == -* ]]; do opts+=("$1"); shift; done   # srun's own options
echo "${opts[*]}" >> "$FAKE_SLURM_LOG.srun-options"
echo "MASTER_ADDR=$MASTER_ADDR MASTER_PORT=$MASTER_PORT $*" >> "$FAKE_SLURM_LOG.srun"
pids=()
for ((i = 0; i < SLURM_NTASKS; i++)); do
    SLURM_PROCID=$i SLURM_LOCALID=0 SLURM_NODEID=$i "$@" &
    pids+=("$!")
done
rc=0
for pid in "${pids[@]}"; do
    wait "$pid" || rc=$?
done
exit "$rc"
"""


def _fake_slurm(tmp_path) -> tuple[str, str]:
    """A bin directory with fake scontrol/srun, and the log prefix they write to."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("scontrol", FAKE_SCONTROL), ("srun", FAKE_SRUN)):
        path = bin_dir / name
        path.write_text(text)
        path.chmod(0o755)
    return str(bin_dir), str(tmp_path / "fake-slurm")


@pytest.fixture(scope="module")
def recipe_runs(tmp_path_factory, request) -> dict:
    """The three recipes' training runs, started at once (each node's driver and stages are fresh
    interpreters importing torch: run one after another they leave a core idle much of the time).

    Each run: its output directory and the (returncode, stdout, stderr) of its processes.
    ``local``: local.sh node 0 and node 1; ``torchrun``: torchrun.sh with two processes;
    ``slurm``: slurm.sbatch under the fake srun/scontrol (whose logs are under ``slurm_log``).
    """
    base = tmp_path_factory.mktemp("recipes")
    ports = free_ports(3)
    dirs = {name: base / name for name in ("local", "torchrun", "slurm")}
    outs = {name: str(d / "out") for name, d in dirs.items()}
    for d in dirs.values():
        d.mkdir()
    bin_dir, log = _fake_slurm(dirs["slurm"])
    scratch = dirs["slurm"] / "scratch"
    scratch.mkdir()
    procs: dict[str, list[subprocess.Popen]] = {}
    try:
        # local.sh, two nodes (node 1 first), started from a scratch directory: the script cds
        # to the repository root itself; the secret file's path is relative to where it started
        secret = dirs["local"] / "job.secret"
        secret.write_text(SECRET + "\n")
        secret.chmod(0o600)
        env = _env(MASTER_PORT=str(ports[0]), SECRET_FILE="job.secret")
        node1 = _start([LOCAL, "1", "127.0.0.1", *ARGS, "--out", outs["local"]], env, str(dirs["local"]))
        procs["local"] = [node1]
        node0 = _start([LOCAL, "0", "127.0.0.1", *ARGS, "--out", outs["local"]], env, str(dirs["local"]))
        procs["local"] = [node0, node1]  # results in rank order
        # torchrun.sh: one torchrun, two processes (nodes) on loopback
        env = _env(NNODES="1", NPROC_PER_NODE="2", MASTER_PORT=str(ports[1]), PIPEQ_SECRET=SECRET)
        procs["torchrun"] = [_start([TORCHRUN, "0", "127.0.0.1", *ARGS, "--out", outs["torchrun"]], env,
                                    str(dirs["torchrun"]))]
        # slurm.sbatch under fake srun and scontrol on PATH; no secret given: it makes one for the job
        env = _env(
            PATH=bin_dir + os.pathsep + os.environ.get("PATH", ""),
            FAKE_SLURM_LOG=log,
            SLURM_JOB_NODELIST="node[01-02]",
            SLURM_NTASKS="2",
            SLURM_JOB_ID="4242",
            SLURM_SUBMIT_DIR=ROOT,  # sbatch runs a copy of the script: it must cd to the submit dir
            MASTER_PORT=str(ports[2]),
        )
        procs["slurm"] = [_start(["bash", SLURM, *ARGS, "--out", outs["slurm"]], env, str(scratch))]
        deadline = time.monotonic() + 200
        # the single-host run they must reproduce (conftest.py): if not done yet, it runs beside them
        request.getfixturevalue("single_host_digits")
        results = {name: _finish(ps, deadline) for name, ps in procs.items()}
    finally:  # a time-out (or error) in one run ends the others too, with their process groups
        for p in (p for ps in procs.values() for p in ps):
            _end_group(p)
    return {"out": outs, "results": results, "slurm_log": log, "slurm_port": ports[2]}


@pytest.mark.timeout(240)
def test_local_sh_two_nodes_match_single_host(recipe_runs, reference) -> None:
    out, results = recipe_runs["out"]["local"], recipe_runs["results"]["local"]
    assert [rc for rc, _, _ in results] == [0, 0], _report(results)
    assert "trained 6 steps (3 stages, 2 nodes" in results[0][1], _report(results)
    assert "node 1: started stage(s) [1, 2]" in results[1][2], _report(results)
    assert_same_state(model_state(out), reference, atol=1e-6)


@pytest.mark.timeout(240)
def test_torchrun_sh_two_processes_on_loopback_match_single_host(recipe_runs, reference) -> None:
    out, results = recipe_runs["out"]["torchrun"], recipe_runs["results"]["torchrun"]
    assert results[0][0] == 0, _report(results)
    assert "trained 6 steps (3 stages, 2 nodes" in results[0][1], _report(results)
    assert_same_state(model_state(out), reference, atol=1e-6)


@pytest.mark.timeout(240)
def test_slurm_sbatch_under_fake_srun_matches_single_host(recipe_runs, reference) -> None:
    out, results = recipe_runs["out"]["slurm"], recipe_runs["results"]["slurm"]
    log, port = recipe_runs["slurm_log"], recipe_runs["slurm_port"]
    assert results[0][0] == 0, _report(results)
    with open(log + ".scontrol") as f:
        assert f.read().split() == ["node[01-02]"]
    with open(log + ".srun") as f:
        srun_line = f.read().strip()
    secret = os.path.join(ROOT, ".pipeq-secret-4242")  # the job's own, in the submission directory
    assert srun_line.startswith(f"MASTER_ADDR=127.0.0.1 MASTER_PORT={port} {sys.executable} -m pipeq launch "
                                f"examples/digits.toml --secret-file {secret} --threads-per-stage 1"), srun_line
    assert "trained 6 steps (3 stages, 2 nodes" in results[0][1], _report(results)
    assert_same_state(model_state(out), reference, atol=1e-6)
    assert not os.path.exists(secret)  # removed when the job ended


@pytest.mark.timeout(30)
def test_slurm_sbatch_default_port_and_bind(tmp_path) -> None:
    """Without MASTER_PORT the port comes from the job id; BIND becomes --bind (no training:
    the fake srun's "tasks" only print what they were given)."""
    bin_dir, log = _fake_slurm(tmp_path)
    env = _env(PATH=bin_dir + os.pathsep + os.environ.get("PATH", ""), FAKE_SLURM_LOG=log,
               SLURM_JOB_NODELIST="node01", SLURM_NTASKS="1", SLURM_JOB_ID="123457",
               SLURM_SUBMIT_DIR=ROOT, BIND="eth0", PYTHON="echo", PIPEQ_SECRET=SECRET)
    r = subprocess.run(["bash", SLURM, "--steps", "3"], env=env, cwd=str(tmp_path),
                       capture_output=True, text=True, timeout=20)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["-m", "pipeq", "launch", "examples/digits.toml", "--bind", "eth0",
                                "--steps", "3"]
    with open(log + ".srun") as f:
        assert f.read().startswith(f"MASTER_ADDR=127.0.0.1 MASTER_PORT={20000 + 123457 % 40000} ")


ELASTIC = {"MAX_RESTARTS": "3", "REJOIN_TIMEOUT": "30", "MIN_NODES": "1"}
PIPEQ_ELASTIC = "--max-restarts 3 --rejoin-timeout 30 --min-nodes 1"


@pytest.mark.timeout(30)
@pytest.mark.parametrize("rank", ["0", "1"])
def test_local_sh_and_torchrun_sh_pass_the_restart_settings(tmp_path, rank) -> None:
    """MAX_RESTARTS / REJOIN_TIMEOUT / MIN_NODES become pipeq's flags on every node; torchrun's own
    --max-restarts (its workers started again) is given to every host but host 0, whose worker is
    the driver (python is ``echo`` here: the commands are printed, nothing trains)."""
    env = _env(PYTHON="echo", PIPEQ_SECRET=SECRET, **ELASTIC)
    local = subprocess.run([LOCAL, rank, "127.0.0.1", "--steps", "3"], env=env, cwd=str(tmp_path),
                           capture_output=True, text=True, timeout=20)
    assert local.returncode == 0, local.stderr
    assert local.stdout.split() == (f"-m pipeq launch examples/digits.toml --nnodes 2 --node-rank {rank} "
                                    f"--master-addr 127.0.0.1 --master-port 29500 {PIPEQ_ELASTIC} --steps 3").split()
    tr = subprocess.run([TORCHRUN, rank, "127.0.0.1", "--steps", "3"], env=env, cwd=str(tmp_path),
                        capture_output=True, text=True, timeout=20)
    assert tr.returncode == 0, tr.stderr
    torchrun_restarts = "--max-restarts 3 " if rank != "0" else ""
    assert tr.stdout.split() == (f"-m torch.distributed.run --nnodes 2 --node-rank {rank} --nproc-per-node 1 "
                                 f"--master-addr 127.0.0.1 --master-port 29500 {torchrun_restarts}-m pipeq launch "
                                 f"examples/digits.toml {PIPEQ_ELASTIC} --steps 3").split()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("case", ["plain", "restarts", "requeued"])
def test_slurm_sbatch_restarts_keep_the_job_and_a_requeued_job_resumes(tmp_path, case) -> None:
    """With MAX_RESTARTS a task that dies does not end the others (srun --kill-on-bad-exit=0):
    pipeq waits for the lost node or re-places its stages; a job SLURM requeued (sbatch --requeue,
    SLURM_RESTART_COUNT) continues from the newest checkpoint (--resume)."""
    bin_dir, log = _fake_slurm(tmp_path)
    extra = {"plain": {}, "restarts": ELASTIC, "requeued": {"SLURM_RESTART_COUNT": "1"}}[case]
    env = _env(PATH=bin_dir + os.pathsep + os.environ.get("PATH", ""), FAKE_SLURM_LOG=log,
               SLURM_JOB_NODELIST="node[01-02]", SLURM_NTASKS="2", SLURM_JOB_ID="78", SLURM_SUBMIT_DIR=ROOT,
               PYTHON="echo", PIPEQ_SECRET=SECRET, **extra)
    r = subprocess.run(["bash", SLURM, "--steps", "3"], env=env, cwd=str(tmp_path), capture_output=True,
                       text=True, timeout=20)
    assert r.returncode == 0, r.stderr
    flags = {"plain": "", "restarts": PIPEQ_ELASTIC + " ", "requeued": "--resume "}[case]
    assert r.stdout.splitlines() == [f"-m pipeq launch examples/digits.toml {flags}--steps 3"] * 2, r.stdout
    with open(log + ".srun-options") as f:
        assert f.read().split() == [f"--kill-on-bad-exit={0 if case == 'restarts' else 1}"]


FAKE_PYTHON = """#!/usr/bin/env bash
# fake python: `-m pipeq secret` prints a secret; `-m pipeq launch ...` prints its arguments and
# the mode of the --secret-file it was given
set -euo pipefail
if [[ "$*" == "-m pipeq secret" ]]; then echo "$FAKE_SECRET"; exit 0; fi
echo "$@"
while [[ $# -gt 0 ]]; do
    if [[ $1 == --secret-file ]]; then stat -c 'mode %a' "$2"; fi
    shift
done
"""


@pytest.mark.timeout(30)
@pytest.mark.parametrize("given", ["none", "file", "env"])
def test_slurm_sbatch_secret_per_job_or_given(tmp_path, given) -> None:
    """No secret given: one file per job in the submission directory, mode 600, passed to every
    task and removed at the end; a SECRET_FILE (relative to the submission directory) or an
    exported PIPEQ_SECRET is used as it is."""
    bin_dir, log = _fake_slurm(tmp_path)
    python = tmp_path / "python"
    python.write_text(FAKE_PYTHON)
    python.chmod(0o755)
    submit = tmp_path / "submit"
    submit.mkdir()
    extra = {"none": {}, "file": {"SECRET_FILE": "mine.secret"}, "env": {"PIPEQ_SECRET": SECRET}}[given]
    (submit / "mine.secret").write_text(SECRET)
    (submit / "mine.secret").chmod(0o600)
    env = _env(PATH=bin_dir + os.pathsep + os.environ.get("PATH", ""), FAKE_SLURM_LOG=log,
               SLURM_JOB_NODELIST="node[01-02]", SLURM_NTASKS="2", SLURM_JOB_ID="77",
               SLURM_SUBMIT_DIR=str(submit), WORKDIR=ROOT, PYTHON=str(python), FAKE_SECRET=SECRET, **extra)
    r = subprocess.run(["bash", SLURM, "--steps", "3"], env=env, cwd=str(tmp_path), capture_output=True,
                       text=True, timeout=20)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    path = {"none": str(submit / ".pipeq-secret-77"), "file": str(submit / "mine.secret"), "env": None}[given]
    flag = f"--secret-file {path} " if path else ""
    launch = f"-m pipeq launch examples/digits.toml {flag}--steps 3"
    assert lines.count(launch) == 2, r.stdout  # both tasks
    assert lines.count("mode 600") == (2 if path else 0), r.stdout
    assert os.path.exists(submit / "mine.secret")  # a given file stays
    assert not os.path.exists(submit / ".pipeq-secret-77")  # the job's own is gone


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    "cmd, env, message",
    [
        ([LOCAL], {}, "missing NODE_RANK"),
        ([LOCAL, "0"], {}, "missing MASTER_ADDR"),
        ([LOCAL, "hostA", "0"], {}, "NODE_RANK must be a number"),
        ([LOCAL, "0", "127.0.0.1"], {"JOB": "no/such/job.toml"}, "job file 'no/such/job.toml' not found"),
        ([LOCAL, "0", "127.0.0.1"], {}, "no job secret: set SECRET_FILE (or export PIPEQ_SECRET)"),
        ([LOCAL, "0", "127.0.0.1"], {"SECRET_FILE": "no/such.secret"}, "no/such.secret' not found"),
        ([TORCHRUN], {}, "missing NODE_RANK"),
        ([TORCHRUN, "1"], {}, "missing MASTER_ADDR"),
        ([TORCHRUN, "1", "127.0.0.1"], {}, "no job secret: export PIPEQ_SECRET (or set SECRET_FILE)"),
        (["bash", SLURM], {}, "submit this script with sbatch"),
    ],
    ids=["local-no-rank", "local-no-addr", "local-swapped", "local-no-job", "local-no-secret",
         "local-no-secret-file", "torchrun-no-rank", "torchrun-no-addr", "torchrun-no-secret",
         "slurm-outside-allocation"],
)
def test_missing_argument_exits_nonzero_with_usage(cmd, env, message, tmp_path) -> None:
    r = subprocess.run(cmd, env=_env(PYTHON="false", **env), cwd=str(tmp_path), capture_output=True,
                       text=True, timeout=20)
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert message in r.stderr and "usage:" in r.stderr, r.stderr


@pytest.mark.timeout(30)
@pytest.mark.parametrize("script", SCRIPTS, ids=os.path.basename)
def test_script_is_executable_bash_and_parses(script) -> None:
    assert os.stat(script).st_mode & stat.S_IXUSR, f"{script} is not executable"
    with open(script) as f:
        text = f.read()
    assert text.startswith("#!/usr/bin/env bash\n") and "set -euo pipefail" in text
    r = subprocess.run(["bash", "-n", script], capture_output=True, text=True, timeout=20)
    assert r.returncode == 0, r.stderr


@pytest.mark.timeout(60)
def test_scripts_are_shellcheck_clean() -> None:
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck is not installed")
    r = subprocess.run(["shellcheck", "--shell=bash", "--severity=style", *SCRIPTS],
                       capture_output=True, text=True, timeout=50)
    assert r.returncode == 0, r.stdout + r.stderr
