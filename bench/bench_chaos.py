"""Chaos from outside, as an operator meets it: processes SIGKILLed, a node lost, a full disk; the weights checked after.

    PYTHONPATH=. python bench/bench_chaos.py                  # as root: both parts, 600 steps (2-4 minutes on 2 cores)
    PYTHONPATH=. python bench/bench_chaos.py --quick          # a short run of each (about 1 minute)
    PYTHONPATH=. python bench/bench_chaos.py --part replicas --seed 40 --json chaos.json

Part "nodes": examples/digits.toml on two "hosts" (network namespaces joined by a veth pair, the
test suite's tests/support/netns.py), ``--data-parallel 2`` (node 0 runs replica 0's three stages and
the driver, node 1 replica 1's), ``--max-restarts``, snapshots and checkpoints. During the run the
script SIGKILLs random stage processes on both nodes, SIGKILLs node 1's whole ``pipeq launch``
process group and starts node 1 again (it rejoins), and once fills the disk of node 0's run
directory (a small tmpfs mounted for it), then frees it and relaunches with ``--resume``. A
restart resumes with the same data order and random streams, so the final model.pt must equal a
plain torch training of every step on full batches in this process (compared at atol 1e-5, the
tolerance of the suite's two-node data-parallel launch test: the replicas sum their gradients in
another order than one process does; a lost or repeated step would differ by about 1e-3).

Part "replicas": the same job on one host in this process's ``PipelineRunner(data_parallel=2,
fault_tolerance="replicas")`` while a thread SIGKILLs a random stage of a random replica at random
moments. The run never stops: each loss leaves a step (at some stages, the step before too) to the
surviving replica, so the weights must equal the plain torch training in which each stage, at each
step the runner names in ``runner.degraded_stages``, trains on the samples of the replicas it summed
(a runner without that attribute: the survivor's half at every stage at the steps of
``runner.degraded_steps``; docs/guides/faults.md, "Replicas that carry on"). Each loss is
also explained: the weights the runner has a step after it are matched against the ways the loss
may have been summed (step d without the lost replica at stages 0..j only, step d - 1 too), so
that a difference says which stages of which steps left the replica out.

Per event the script prints when it came, how long until node 0 (or the runner) named it, how long
until training went on, and what was lost; then a verdict, and exits 0 when every check held,
1 when one failed, 2 when this machine cannot run it (part "nodes" needs root and ``ip netns``).
Every process it started is gone at its end, the namespaces and the tmpfs removed, even on Ctrl-C.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import random
import signal
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import asdict

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# examples.digits_job; the suite's netns, launch_util and strays (tests/support); chaos_run beside this script
sys.path[:0] = [p for p in (ROOT, os.path.join(ROOT, "tests", "support"), os.path.join(ROOT, "bench"))
                if p not in sys.path]
# this checkout's pipeq for the runner's fork server too, which leaves the script's folder and the current
# one off its path: without it (a fresh clone, no PYTHONPATH) every stage would import torch and pipeq itself
os.environ["PYTHONPATH"] = os.pathsep.join([ROOT, *filter(None, [os.environ.get("PYTHONPATH")])])

import strays
import torch
from chaos_plain import ATOL, STAGE_LAYERS, compare, digits_job, explain, reconstruct
from chaos_run import Event, TwoNodeRun, Unavailable, secs, tmpfs
from netns import TwoHosts, netns_available


def print_table(title: str, events: list[Event]) -> None:
    rows = [("#", "event", "when", "detected after", "training again after", "lost")]
    rows += [(str(i), e.name + ("" if e.ok else "  [FAILED]"), e.when, secs(e.detected), secs(e.again), e.lost)
             for i, e in enumerate(events, 1)]
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    print(f"\n{title}", flush=True)
    for i, r in enumerate(rows):
        print("  " + " | ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
        if i == 0:
            print("  " + "-+-".join("-" * w for w in widths))
    for i, e in enumerate(events, 1):
        if e.note:
            print(f"  ({i}) {e.note}")
    sys.stdout.flush()


# -- part "nodes": two hosts ---------------------------------------------------------------------
def plan(rng: random.Random, steps: int, stage_kills: int) -> list[tuple[int, str]]:
    """The events, in a random order, one in each of equal slices of the run (at a random step of
    its first half): ``stage_kills`` stage SIGKILLs (on node 0 and node 1 in turn, then either), a
    node loss, a full disk."""
    kinds = [f"stage{(0, 1)[i] if i < 2 else ''}" for i in range(stage_kills)] + ["node", "disk"]
    rng.shuffle(kinds)
    start, end = 25, steps - 40
    width = (end - start) // len(kinds)
    return [(start + i * width + rng.randrange(max(1, width // 2)), kind) for i, kind in enumerate(kinds)]


def nodes_part(steps: int, stage_kills: int, rng: random.Random) -> tuple[list[Event], dict]:
    """The two-node run with its events; the events and the checks at its end."""
    reason = netns_available()
    if reason:
        raise Unavailable(f"part 'nodes' needs network namespaces: {reason} (run as root with iproute2's ip)")
    events: list[Event] = []
    shm_before = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    with tempfile.TemporaryDirectory(prefix="pipeq-chaos-") as tmp, tmpfs(os.path.join(tmp, "disk"), "16m") as fs, \
            TwoHosts() as h:
        run = TwoNodeRun(h, os.path.join(fs, "run"), tmp, steps)
        try:
            run.start()
            for target, kind in plan(rng, steps, stage_kills):
                if run.wait_step(target) >= steps or not run.alive():
                    break
                time.sleep(rng.uniform(0, 0.03))  # anywhere in a step
                ev = (run.kill_node1() if kind == "node" else run.fill_disk(fs) if kind == "disk"
                      else run.kill_stage(rng, int(kind[5:]) if kind[5:] else None))
                print(f"  {len(events) + 1}. {ev.name} at {ev.when}: {'ok' if ev.ok else 'FAILED'}", flush=True)
                events.append(ev)
            ended = run.finish()
            left = run.left()
            records = run.metrics.records()
            steps_on_record = [m["step"] for _, m in run.metrics.snapshot() if "loss" in m]
            model = os.path.join(run.out, "model.pt")
            state = torch.load(model, weights_only=True) if os.path.exists(model) else None
        finally:
            run.close()
    leftover = {ns: procs for ns, procs in itertools.chain(left.items(), h.leftover.items()) if procs}
    checks = nodes_checks(steps, events, ended, records, steps_on_record, state)
    checks["left in the namespaces"] = leftover
    checks["new /dev/shm entries"] = sorted(set(os.listdir("/dev/shm")) - shm_before) if shm_before else []
    checks["problems"] += [f"processes left in the namespaces: {leftover}"] if leftover else []
    if checks["new /dev/shm entries"]:
        checks["problems"].append(f"new /dev/shm entries: {checks['new /dev/shm entries']}")
    return events, checks


def nodes_checks(steps: int, events: list[Event], ended: dict, records: list[dict], on_record: list[int],
                 state: dict | None) -> dict:
    """Both nodes exit 0, every step on record once, a restart record per restart, and model.pt
    equal to the plain torch training within ATOL; ``problems`` says what did not hold."""
    restarts = sum(1 for e in events if "disk" not in e.name)
    codes = [ended["node 0 exit"], ended["node 1 exit"]]
    checks: dict = {"exit codes": codes, "restart records": len(records), "restarts done": restarts,
                    "steps on record once each": on_record == list(range(1, steps + 1))}
    problems = [f"event {i} ({e.name}) failed" for i, e in enumerate(events, 1) if not e.ok]
    if codes != [0, 0]:
        problems.append(f"exit codes {codes}")
        checks["node 0 tail"], checks["node 1 tail"] = ended["node 0 tail"], ended["node 1 tail"]
    if len(records) != restarts:
        problems.append(f"{len(records)} restart records in metrics.jsonl for {restarts} restarts")
    if not checks["steps on record once each"]:
        problems.append("metrics.jsonl does not have each step's line once")
    if state is None:
        checks["model.pt"] = "MISSING"
        problems.append("no model.pt")
    else:
        same, diff, over = compare(state, reconstruct(steps))
        checks["model.pt"] = (f"equal to the plain torch training within {ATOL} (largest difference {diff:.1e})"
                              if same else f"DIFFERS from the plain torch training: {over} (largest {diff:.1e})")
        if not same:
            problems.append(f"model.pt {checks['model.pt']}")
    checks["problems"] = problems
    return checks


# -- part "replicas": one host, fault_tolerance="replicas" ----------------------------------------
class TimedStderr:
    """sys.stderr while the runner runs: each line it writes, with when (the runner names a lost
    replica there), kept and not shown."""

    def __init__(self) -> None:
        self.lines: list[tuple[float, str]] = []

    def write(self, text: str) -> int:
        self.lines.append((time.monotonic(), text))
        return len(text)

    def flush(self) -> None:
        pass


def dropped_as_the_run_says(runner, replicas: int = 2) -> dict[int, dict[int, set[int]]]:
    """What the runner says it left out, as docs/guides/faults.md ("Replicas that carry on") reads
    it: ``runner.degraded_stages`` (step -> stage -> the replicas it summed, for the stages that
    summed fewer than all), where the runner has it; else the failed replica's samples at every
    stage at each step of ``runner.degraded_steps`` (the failures of ``runner.replica_failures`` in
    the order of those steps)."""
    rows = getattr(runner, "degraded_stages", None)
    if rows is not None:
        return {step: {k: set(range(replicas)) - set(summed) for k, summed in row.items()}
                for step, row in rows.items()}
    steps = sorted(runner.degraded_steps)
    failures = runner.replica_failures
    if len(steps) != len(failures):
        raise AssertionError(f"{len(failures)} replica failure(s) but degraded steps {runner.degraded_steps}")
    return {d: {k: {err.replica} for k in range(len(STAGE_LAYERS))} for d, err in zip(steps, failures)}


def loss_steps(kills: list[dict], degraded: dict[int, int]) -> list[int | None]:
    """Each kill's step of the loss: the last degraded step from the one whose loss was in when it
    came (its step before may be degraded too) to two after it, not an earlier kill's."""
    out: list[int | None] = []
    for kill in kills:
        s = kill["steps done"]
        mine = [d for d in sorted(degraded) if s <= d <= s + 2 and (not out or out[-1] is None or d > out[-1])]
        out.append(mine[-1] if mine else None)
    return out


def _killer(runner, done: list[float], targets: list[int], rng: random.Random, kills: list[dict],
            stop: threading.Event) -> None:
    """At each target step: once the step before it is done, a random moment later (up to 1.5
    step times), SIGKILL a random stage of a random replica."""
    for target in targets:
        while len(done) < target - 1 and not stop.is_set():
            time.sleep(0.002)
        if stop.is_set():
            return
        times = [b - a for a, b in itertools.pairwise(done[1:])] or [0.05]
        time.sleep(rng.uniform(0, 1.5 * statistics.median(times[-20:])))
        procs = [p for p in runner.stage_processes if p.get("pid")]
        victim = rng.choice(procs)
        kills.append({"at": time.monotonic(), "steps done": len(done) - 1, "stage": victim["stage"],
                      "replica": victim["replica"], "pid": victim["pid"]})
        with contextlib.suppress(ProcessLookupError):
            os.kill(victim["pid"], signal.SIGKILL)


def replicas_part(steps: int, kills_wanted: int, rng: random.Random) -> tuple[list[Event], dict]:
    """The runner with fault_tolerance="replicas" on one host, its stages SIGKILLed at random."""
    import pipeq
    from examples.digits_job import stages

    job = digits_job(steps)
    torch.manual_seed(job.recipe.seed)
    runner = pipeq.PipelineRunner(stages(), job.recipe.loss_fn(), job.recipe.optimizer_factory(), "1f1b", 4,
                                  lr_scheduler=job.recipe.scheduler_factory(), data_parallel=2,
                                  fault_tolerance="replicas", start_method="forkserver", threads_per_stage=1,
                                  heartbeat_timeout=6)
    data = list(itertools.islice((b for e in itertools.count() for b in job.batches(e)), steps))
    gap = (steps - 20) // kills_wanted
    targets = [10 + i * gap + rng.randrange(max(1, gap // 2)) for i in range(kills_wanted)]
    done: list[float] = []
    kills: list[dict] = []
    stop = threading.Event()
    err, sys.stderr = sys.stderr, TimedStderr()
    state, degraded, failures, dropped, ended = None, {}, [], {}, None
    mid: dict[int, dict] = {}
    after_loss = False
    try:
        with runner:
            done.append(time.monotonic())
            killer = threading.Thread(target=_killer, args=(runner, done, targets, rng, kills, stop), daemon=True)
            killer.start()
            try:
                for step, (x, y) in enumerate(data, start=1):
                    runner.step(x, y)
                    done.append(time.monotonic())
                    if runner.last_step_replicas is not None:
                        after_loss = True
                    elif after_loss:  # the weights the step after a loss left: what explain() reads
                        mid[step], after_loss = runner.state_dict(), False
            except pipeq.PipelineError as exc:  # the run ended: a check fails, the script goes on
                ended = f"the run ended at step {len(done)}: {str(exc).splitlines()[0]}"
            stop.set()
            killer.join(5)
            degraded, failures = runner.degraded_steps, runner.replica_failures
            if ended is None:
                state = runner.state_dict()
                try:
                    dropped = dropped_as_the_run_says(runner)
                except AssertionError as exc:
                    ended = str(exc)
    finally:
        stop.set()
        said, sys.stderr = sys.stderr.lines, err
    left = strays.wait_no_strays(10)
    sizes = [len(y) for _, y in data]
    source = "degraded_stages" if hasattr(runner, "degraded_stages") else "degraded_steps"
    events, checks = replicas_report(steps, sizes, done, kills, said, degraded, failures, dropped, state, left, ended,
                                     source)
    found, chosen = explain(steps, loss_steps(kills, degraded), failures, mid)
    checks["weights read after steps"] = sorted(mid)
    for ev, how in zip(events, found):
        ev.note += f"; the weights a step later match: {how}"
    if state is not None and chosen is not None:
        same, diff, _ = compare(state, reconstruct(steps, chosen))
        checks["weights against the accountings found"] = f"{'equal' if same else 'DIFFER'} (largest difference {diff:.1e})"
    return events, checks


def replicas_report(steps: int, sizes: list[int], done: list[float], kills: list[dict], said: list[tuple[float, str]],
                    degraded: dict[int, int], failures: list, dropped: dict, state: dict | None, left: list,
                    ended: str | None, source: str) -> tuple[list[Event], dict]:
    """An event per kill (its loss named, the survivor's step done, the replica back), and the checks."""
    took = [b - a for a, b in itertools.pairwise(done)]  # took[i]: step i + 1
    median = statistics.median(took) if took else 0.0
    events = []
    order = loss_steps(kills, degraded)
    for i, kill in enumerate(kills):
        ev = Event(f"SIGKILL stage {kill['stage']} of replica {kill['replica']}",
                   f"step {kill['steps done'] + 1}, {kill['at'] - done[0]:.1f} s", at=kill["at"])
        named = next((t for t, text in said if t >= kill["at"] and "finish the step without replica" in text), None)
        ev.detected = None if named is None else named - kill["at"]
        d = order[i]
        if d is not None and i < len(failures):
            r = failures[i].replica
            back = done[d + 1] - kill["at"] if d + 1 < len(done) else None
            ev.again = done[d] - kill["at"]
            ev.lost = (f"replica {r}'s {sizes[d - 1] - sizes[d - 1] // 2 if r == 0 else sizes[d - 1] // 2} of "
                       f"{sizes[d - 1]} samples at step {d}; no step redone")
            ev.note = (f"step {d} took {took[d - 1]:.2f} s (median {median:.3f} s); replica {r} rebuilt and training "
                       f"again {secs(back)} after the kill (step {d + 1} took {secs(took[d] if d < len(took) else None)})")
        elif i < len(failures) and named is not None:  # lost between two steps: no step left it out
            ev.again = next((t for t in done if t >= named), named) - kill["at"]
            ev.lost = "nothing: no step was degraded (the replica was rebuilt between two steps)"
        else:
            ev.ok, ev.note = False, "no failure on record, or no degraded step, for this kill"
        events.append(ev)
    slow = [i + 1 for i, t in enumerate(took) if t > 2 * median and i + 1 not in degraded]  # noisy on a busy machine
    waited = [i + 1 for i, t in enumerate(took) if t > 4.8]  # 0.8 x heartbeat_timeout: a stall on a timeout
    checks: dict = {"degraded steps": degraded, "replica failures": [str(e).splitlines()[0] for e in failures],
                    "kills": len(kills), "median step": round(median, 4),
                    "steps over 2x the median (loss steps aside; not judged)": len(slow),
                    "steps that waited for a timeout (> 4.8 s)": waited, "left behind": left}
    problems = [f"event {i} ({e.name}) failed: {e.note}" for i, e in enumerate(events, 1) if not e.ok]
    problems += [f"the run ended: {ended}"] if ended is not None else []
    problems += [f"step(s) {waited} waited for a timeout"] if waited else []
    problems += [f"left behind: {left}"] if left else []
    if len(kills) != len(failures):
        problems.append(f"{len(kills)} kills, {len(failures)} replica failures, degraded steps {degraded}")
    if state is not None:
        same, diff, over = compare(state, reconstruct(steps, dropped))
        checks["weights"] = (f"equal to the plain torch reconstruction from {source} within {ATOL} (largest "
                             f"difference {diff:.1e})" if same else
                             f"DIFFER from the plain torch reconstruction from {source}: {over} (largest {diff:.1e})")
        if not same:
            problems.append(f"the weights {checks['weights']}")
    checks["problems"] = problems
    if problems:  # (in --json) what the runner said, from the script's start
        checks["runner said"] = [f"{t - (done or [t])[0]:.2f} s: {text.rstrip()}" for t, text in said if text.strip()]
    return events, checks


# -- the script ----------------------------------------------------------------------------------
def _terminate(signum, frame):  # SIGTERM ends the script as Ctrl-C does: every finally block runs
    raise KeyboardInterrupt(f"signal {signum}")


def _verdict(name: str, checks: dict) -> str:
    if not checks["problems"]:
        return f"{name}: every event recovered, {checks.get('model.pt') or checks.get('weights')}, nothing left behind"
    weights = checks.get("model.pt") or checks.get("weights")
    return f"{name}: FAILED: " + "; ".join(checks["problems"]) + (f" (model.pt {weights})" if "model.pt" in checks
                                                                   and "DIFFER" not in weights else "")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--part", choices=["all", "nodes", "replicas"], default="all")
    p.add_argument("--steps", type=int, default=None, help="steps of the two-node run (default 600; --quick 150)")
    p.add_argument("--seed", type=int, default=None, help="the draw of events, stages and moments, each part's its own (default: random)")
    p.add_argument("--quick", action="store_true", help="a short run: fewer steps and events")
    p.add_argument("--json", metavar="PATH", help="also write the events and checks as JSON")
    args = p.parse_args()
    steps = args.steps or (150 if args.quick else 600)
    if steps < 120:
        p.error("--steps must be at least 120 (room for the events)")
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1 << 30)
    signal.signal(signal.SIGTERM, _terminate)
    torch.set_num_threads(1)  # the reconstructions and the runner's driver: the stages need the cores
    print(f"bench_chaos: seed {seed} (--seed {seed} repeats the draw), {steps} steps on two nodes", flush=True)
    results: dict = {"seed": seed, "steps": steps}
    lines = []
    try:
        if args.part in ("all", "nodes"):
            print("part nodes: two hosts (network namespaces), data_parallel=2, --max-restarts", flush=True)
            events, checks = nodes_part(steps, 2 if args.quick else 4, random.Random(f"{seed}:nodes"))
            print_table(f"two nodes, {steps} steps, data_parallel=2, restarts from snapshots and checkpoints", events)
            results["nodes"] = {"events": [asdict(e) for e in events], "checks": checks}
            lines.append(_verdict("two nodes", checks))
        if args.part in ("all", "replicas"):
            r_steps = 60 if args.quick else 200
            print(f"part replicas: one host, fault_tolerance='replicas', {r_steps} steps", flush=True)
            events, checks = replicas_part(r_steps, 1 if args.quick else 4, random.Random(f"{seed}:replicas"))
            print_table(f"one host, {r_steps} steps, data_parallel=2, fault_tolerance='replicas'", events)
            results["replicas"] = {"events": [asdict(e) for e in events], "checks": checks}
            lines.append(_verdict("replicas", checks))
    except Unavailable as exc:
        print(f"bench_chaos: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # (every process it started is stopped, the namespaces and the tmpfs removed)
        print("bench_chaos: interrupted; everything it started is stopped", file=sys.stderr)
        return 130
    ok = not any(part["checks"]["problems"] for key, part in results.items() if key in ("nodes", "replicas"))
    print()
    for line in lines:
        print(line)
    print(f"VERDICT: {'PASS' if ok else 'FAIL'} (seed {seed})", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1, default=str)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
