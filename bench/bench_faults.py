"""Failures on purpose: launched jobs killed, stopped, raising and hanging, restarted by themselves; their weights against uninterrupted runs'.

    PYTHONPATH=. python bench/bench_faults.py                   # every scenario (about 10 minutes)
    PYTHONPATH=. python bench/bench_faults.py --only kills      # 10 SIGKILLs of examples/digits_faults.toml
    PYTHONPATH=. python bench/bench_faults.py --only research   # raise, hang, SIGSTOP: interlocking, async, AL
    PYTHONPATH=. python bench/bench_faults.py --only tp         # a tensor-parallel shard killed

Each scenario runs the job twice with ``pipeq launch``: once uninterrupted, once with failures
(``--max-restarts``), and compares the final weights (model.pt) bit for bit. After each run it
looks for processes that carry the run's mark in their environment (none may be left) and for
new entries in /dev/shm (none may be left). Recovery times come from two clocks: the restart
record's ``seconds_lost`` (the failure noticed -> training again) and this script's (the kill ->
the restart record written).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MARK = "PIPEQ_BENCH_FAULTS"
RESEARCH_JOBS = {"interlocking": "examples/digits_nwise.toml", "async": "examples/digits_async.toml",
                 "al": "examples/digits_al.toml"}
TP_JOB = """\
stages = "examples.digits_job:stages"
loss = "torch.nn:CrossEntropyLoss"
optimizer = "torch.optim:Adam"
optimizer_args = { lr = 0.001 }
lr_scheduler = "torch.optim.lr_scheduler:StepLR"
lr_scheduler_args = { step_size = 50, gamma = 0.5 }
data = "examples.digits_job:train_batches"
microbatches = 4
seed = 0
tensor_parallel = 2
tp_plan = [{ "0" = "colwise" }, { "0" = "rowwise" }, {}]
"""


# -- processes ---------------------------------------------------------------------------------
def _children() -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        out.setdefault(ppid, []).append(int(entry))
    return out


def stage_pids(launch_pid: int) -> list[int]:
    """The launch's stage processes: its children's children (the fork server's)."""
    kids = _children()
    return [g for c in kids.get(launch_pid, []) for g in kids.get(c, [])]


def marked(mark: str) -> list[int]:
    """Processes whose environment carries ``mark`` (a run's own, and anything it left)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/environ", "rb") as f:
                    if f"{MARK}={mark}".encode() in f.read():
                        found.append(int(entry))
            except OSError:
                pass
    return found


def _shm() -> set[str]:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


# -- runs --------------------------------------------------------------------------------------
class Run:
    """One ``pipeq launch`` of ``job`` into ``out`` with ``args``, its environment marked."""

    def __init__(self, job: str, out: str, *args: str, fault: str | None = None) -> None:
        self.out, self.mark = out, uuid.uuid4().hex
        env = {**os.environ, MARK: self.mark, "PYTHONPATH": ROOT}
        env.pop("PIPEQ_FAULT", None)
        if fault is not None:
            env["PIPEQ_FAULT"] = fault
        self.shm_before = _shm()
        argv = [sys.executable, "-m", "pipeq", "launch", job, "--quiet", "--threads-per-stage", "1", "--out", out,
                *args]
        self.proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True)

    def metrics(self) -> list[dict]:
        try:
            with open(os.path.join(self.out, "metrics.jsonl")) as f:
                return [json.loads(line) for line in f if line.strip()]
        except (OSError, ValueError):
            return []

    def restarts(self) -> list[dict]:
        return [m for m in self.metrics() if "restart" in m]

    def finish(self, timeout: float = 900) -> dict:
        """Wait for the run; its exit code, restarts, leftovers."""
        out, err = self.proc.communicate(timeout=timeout)
        time.sleep(0.5)  # a process being reaped
        leftover = marked(self.mark)
        for pid in leftover:
            os.kill(pid, signal.SIGKILL)
        return {"code": self.proc.returncode, "stderr": err, "restarts": self.restarts(), "leftover": leftover,
                "new_shm": sorted(_shm() - self.shm_before)}


def same_weights(a: str, b: str) -> bool:
    wa = torch.load(os.path.join(a, "model.pt"), weights_only=True)
    wb = torch.load(os.path.join(b, "model.pt"), weights_only=True)
    return wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def _wait_training(run: Run, after: int, deadline: float) -> bool:
    """Until the run has trained a step since ``after`` restart records (False: it ended)."""
    while time.monotonic() < deadline and run.proc.poll() is None:
        lines = run.metrics()
        restarts = sum("restart" in m for m in lines)
        if restarts >= after and any("loss" in m for m in lines[_last_restart_index(lines) + 1:]):
            return True
        time.sleep(0.02)
    return False


def _last_restart_index(lines: list[dict]) -> int:
    idx = [i for i, m in enumerate(lines) if "restart" in m]
    return idx[-1] if idx else -1


def _strike(run: Run, rng: random.Random, sig: int, count: int, pause: tuple[float, float]) -> list[float]:
    """Send ``sig`` to a random stage process ``count`` times, each a random ``pause`` after
    training (re)started; the seconds from each to its restart record."""
    waits = []
    deadline = time.monotonic() + 900
    for i in range(count):
        if not _wait_training(run, i, deadline):
            break
        time.sleep(rng.uniform(*pause))
        pids = stage_pids(run.proc.pid)
        if not pids or run.proc.poll() is not None:
            break
        os.kill(rng.choice(pids), sig)
        t0 = time.monotonic()
        while len(run.restarts()) <= i and run.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        if len(run.restarts()) > i:
            waits.append(time.monotonic() - t0)
    return waits


# -- scenarios ---------------------------------------------------------------------------------
def _report(name: str, ref: dict, got: dict, ref_out: str, out: str, waits: list[float] | None = None) -> bool:
    lost = [r["seconds_lost"] for r in got["restarts"] if r.get("resumed_from") is not None]  # not a failed start
    ok = ref["code"] == 0 and got["code"] == 0 and same_weights(ref_out, out)
    clean = not got["leftover"] and not got["new_shm"] and not ref["leftover"] and not ref["new_shm"]
    line = (f"{name:<28} exit {got['code']}, {len(lost)} restart(s), weights "
            f"{'bitwise equal' if ok else 'DIFFER'}, {'nothing left behind' if clean else 'LEFT: ' + str(got)}")
    if lost:
        line += f"; seconds_lost median {statistics.median(lost):.2f} max {max(lost):.2f}"
        sources = sorted({r.get("state_from", "?") for r in got["restarts"]})
        line += f" (state from {', '.join(sources)})"
    if waits:
        line += f"; signal -> resumed median {statistics.median(waits):.2f} s max {max(waits):.2f} s"
    print(line, flush=True)
    if got["code"] != 0:
        print(got["stderr"][-2000:], flush=True)
    return ok and clean


def kills(tmp: str, rng: random.Random, count: int = 10) -> bool:
    """examples/digits_faults.toml (300 steps): ``count`` SIGKILLs of random stages at random times."""
    job = "examples/digits_faults.toml"
    ref_out, out = os.path.join(tmp, "kills-ref"), os.path.join(tmp, "kills")
    ref = Run(job, ref_out, "--max-restarts", "0").finish()
    run = Run(job, out)
    waits = _strike(run, rng, signal.SIGKILL, count, (0.0, 0.15))
    return _report(f"digits_faults: {len(waits)} SIGKILLs", ref, run.finish(), ref_out, out, waits)


def _job_with(base: str, tmp: str, extra: str) -> str:
    path = os.path.join(tmp, f"job-{uuid.uuid4().hex[:8]}.toml")
    with open(os.path.join(ROOT, base)) as f:
        text = f.read()
    with open(path, "w") as f:
        f.write(text + "\n" + extra + "\n")
    return path


def research(tmp: str, rng: random.Random) -> bool:
    """The interlocking, async and AL job files: a raise, a hang and a SIGSTOP each."""
    ok = True
    for name, base in RESEARCH_JOBS.items():
        job = _job_with(base, tmp, "step_timeout = 4\nheartbeat_timeout = 3")
        common = ("--steps", "120", "--checkpoint-every", "40", "--snapshot-every", "10", "--eval-every", "0")
        ref_out = os.path.join(tmp, f"{name}-ref")
        ref = Run(job, ref_out, *common).finish()
        for kind in ("raise", "hang"):
            out = os.path.join(tmp, f"{name}-{kind}")
            fault = f"stage:{rng.randrange(3)},step:{rng.randrange(30, 110)},kind:{kind}"
            got = Run(job, out, *common, "--max-restarts", "3", fault=fault).finish()
            ok &= _report(f"{name}: {kind} ({fault.split(',kind')[0]})", ref, got, ref_out, out)
        out = os.path.join(tmp, f"{name}-sigstop")
        run = Run(job, out, *common, "--max-restarts", "3")
        waits = _strike(run, rng, signal.SIGSTOP, 1, (0.2, 1.0))
        ok &= _report(f"{name}: SIGSTOP", ref, run.finish(), ref_out, out, waits)
    return ok


def tensor_parallel(tmp: str, rng: random.Random) -> bool:
    """A T=2 digits job (Adam, StepLR): a shard killed mid-run."""
    job = os.path.join(tmp, "tp.toml")
    with open(job, "w") as f:
        f.write(TP_JOB)
    common = ("--steps", "150", "--checkpoint-every", "25", "--eval-every", "0")
    ref_out, out = os.path.join(tmp, "tp-ref"), os.path.join(tmp, "tp")
    ref = Run(job, ref_out, *common).finish()
    run = Run(job, out, *common, "--max-restarts", "3", "--snapshot-every", "10")
    waits = _strike(run, rng, signal.SIGKILL, 1, (0.1, 1.0))
    return _report("tensor parallel: a shard", ref, run.finish(), ref_out, out, waits)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", choices=["kills", "research", "tp"], help="one scenario (default: all)")
    p.add_argument("--seed", type=int, default=None, help="the draw of stages and times (default: random)")
    args = p.parse_args()
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1 << 30)
    rng = random.Random(seed)
    print(f"seed {seed} (--seed {seed} repeats the draw)", flush=True)
    ok = True
    with tempfile.TemporaryDirectory(prefix="pipeq-faults-") as tmp:
        if args.only in (None, "kills"):
            ok &= kills(tmp, rng)
        if args.only in (None, "research"):
            ok &= research(tmp, rng)
        if args.only in (None, "tp"):
            ok &= tensor_parallel(tmp, rng)
    print("all recovered with the uninterrupted weights" if ok else "SOME SCENARIO FAILED", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
