"""The two-node run of bench/bench_chaos.py: its nodes in network namespaces, its metrics as they
come, the events done to it (a stage SIGKILLed, node 1 lost and started again, a full disk)."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import random
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field

from launch_util import ROOT, launch_cmd, secret_env
from netns import TwoHosts

PORT = 29531  # node 0's rendezvous store, inside its namespace: nothing else listens there


@dataclass
class Event:
    """One thing done to the run, and what came of it (seconds from the moment it was done)."""

    name: str
    when: str
    detected: float | None = None
    again: float | None = None
    lost: str = ""
    ok: bool = True
    note: str = ""
    log: str = field(default="", repr=False)  # what a node said, where that explains a failure
    at: float = field(default=0.0, repr=False)


def secs(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f} s"


class Metrics:
    """OUT/metrics.jsonl as the run writes it (a resume trims it): its complete lines, each with
    when this script first saw it (read every 50 ms by a thread)."""

    def __init__(self, path: str) -> None:
        self.path, self.seen, self.parsed = path, {}, {}
        self.lines: list[tuple[float, dict]] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            self.poll()

    def poll(self) -> None:
        try:
            with open(self.path) as f:
                texts = f.read().split("\n")[:-1]  # the last piece: a line being written, or ""
        except OSError:
            return
        now, lines = time.monotonic(), []
        for text in texts:
            if text not in self.parsed:
                try:
                    self.parsed[text] = json.loads(text)
                except ValueError:
                    continue
            lines.append((self.seen.setdefault(text, now), self.parsed[text]))
        with self._lock:
            self.lines = lines

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)

    def snapshot(self) -> list[tuple[float, dict]]:
        with self._lock:
            return list(self.lines)

    def step(self) -> int:
        return max((m["step"] for _, m in self.snapshot() if "loss" in m), default=0)

    def records(self) -> list[dict]:
        return [m for _, m in self.snapshot() if "restart" in m]

    def training_after(self, pred, timeout: float) -> float | None:
        """When the first loss line after the first line for which ``pred(time, line)`` holds was
        seen (None: not within ``timeout``)."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            lines = self.snapshot()
            start = next((i for i, (t, m) in enumerate(lines) if pred(t, m)), None)
            if start is not None:
                after = next((t for t, m in lines[start + 1:] if "loss" in m), None)
                if after is not None:
                    return after
            time.sleep(0.02)
        return None


class Node:
    """One ``pipeq launch`` node in a namespace, in its own process group; its stderr lines timed."""

    def __init__(self, h: TwoHosts, rank: int, out: str, common: tuple[str, ...], *extra: str) -> None:
        self.rank = rank
        argv = launch_cmd("--nnodes", "2", "--node-rank", str(rank), "--master-addr", h.addr_a, "--master-port",
                          str(PORT), "--out", out, *common, *extra)
        self.p = h.popen(h.a if rank == 0 else h.b, argv, cwd=ROOT, stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE, text=True, env=secret_env(PYTHONPATH=ROOT), start_new_session=True)
        self.lines: list[tuple[float, str]] = []
        self._reader = threading.Thread(target=lambda: self.lines.extend((time.monotonic(), ln) for ln in self.p.stderr),
                                        daemon=True)
        self._reader.start()

    @property
    def err(self) -> str:
        return "".join(ln for _, ln in list(self.lines))

    def said(self, words: tuple[str, ...], after: float, timeout: float) -> float | None:
        """When a line holding one of ``words`` came after ``after`` (waiting up to ``timeout``)."""
        end = time.monotonic() + timeout
        while True:
            hit = next((t for t, ln in list(self.lines) if t >= after and any(w in ln for w in words)), None)
            if hit is not None or time.monotonic() > end or (self.p.poll() is not None and not self._reader.is_alive()):
                return hit
            time.sleep(0.02)

    def wait(self, timeout: float) -> int | None:
        try:
            code = self.p.wait(timeout)
        except subprocess.TimeoutExpired:
            return None
        self._reader.join(5)
        return code

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.p.pid, signal.SIGKILL)  # the node's launch, fork server and stages
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.p.wait(10)


@contextlib.contextmanager
def tmpfs(path: str, size: str):
    """A tmpfs of ``size`` mounted at ``path`` (a disk this script can fill), unmounted after."""
    os.makedirs(path)
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", path], capture_output=True, text=True,
                         check=False)
    if res.returncode != 0:
        raise Unavailable(f"cannot mount a tmpfs for the run directory: {res.stderr.strip()}")
    try:
        yield path
    finally:
        if subprocess.run(["umount", path], capture_output=True, check=False).returncode != 0:
            subprocess.run(["umount", "-l", path], capture_output=True, check=False)  # still busy: detach it


class Unavailable(Exception):
    """This machine cannot run the part (exit code 2)."""


def fill(path: str) -> int:
    """Write ``path``/filler until the disk is full; the bytes written."""
    written, block = 0, b"\0" * (1 << 20)
    with open(os.path.join(path, "filler"), "wb", buffering=0) as f:
        for chunk in (block, b"\0" * 4096, b"\0"):
            while True:
                try:
                    written += f.write(chunk)
                except OSError as exc:
                    if exc.errno != errno.ENOSPC:
                        raise
                    break
    return written


class TwoNodeRun:
    """The two-node run: node 0 (driver, replica 0) on host A writing into ``out``, node 1
    (replica 1) on host B; the events done to it."""

    def __init__(self, h: TwoHosts, out: str, tmp: str, steps: int) -> None:
        self.h, self.out, self.tmp, self.steps = h, out, tmp, steps
        self.common = ("--steps", str(steps), "--data-parallel", "2", "--eval-every", "0", "--checkpoint-every", "20",
                       "--keep-checkpoints", "2", "--snapshot-every", "5", "--max-restarts", "20",
                       "--heartbeat-timeout", "5", "--rejoin-timeout", "30")
        self.metrics = Metrics(os.path.join(out, "metrics.jsonl"))
        self.node0: Node | None = None
        self.node1: Node | None = None
        self.starts = 0
        self.t0 = time.monotonic()

    def start(self, *extra: str) -> None:
        self.start_node1()
        self.node0 = Node(self.h, 0, self.out, self.common, *extra)

    def start_node1(self) -> None:
        self.starts += 1
        self.node1 = Node(self.h, 1, os.path.join(self.tmp, f"node1-{self.starts}"), self.common)

    def close(self) -> None:
        for node in (self.node0, self.node1):
            if node is not None:
                node.kill()
        self.metrics.close()

    def alive(self) -> bool:
        return self.node0 is not None and self.node0.p.poll() is None

    def wait_step(self, target: int, timeout: float = 120) -> int:
        """Until node 0 has trained step ``target`` (or ended); the step it is at."""
        end = time.monotonic() + timeout
        while self.metrics.step() < target and self.alive() and time.monotonic() < end:
            time.sleep(0.01)
        return self.metrics.step()

    def when(self) -> str:
        return f"step {self.metrics.step()}, {time.monotonic() - self.t0:.1f} s"

    def stage_pids(self) -> list[tuple[int, str, int]]:
        """(pid, name, node) of every stage process on both hosts (``pipeq-stage1r1``: stage 1 of replica 1)."""
        return [(pid, comm, n) for n, ns in enumerate((self.h.a, self.h.b)) for pid, comm in self.h.procs(ns)
                if comm.startswith("pipeq-stage")]

    def _restarted(self, ev: Event, before: int, detected_by: tuple[str, ...]) -> dict | None:
        """Fill ``ev`` in from node 0's lines and the next restart record; the record."""
        assert self.node0 is not None
        said = self.node0.said(detected_by, ev.at, 30)
        ev.detected = None if said is None else said - ev.at
        end = time.monotonic() + 90
        while len(self.metrics.records()) <= before and self.alive() and time.monotonic() < end:
            time.sleep(0.02)
        records = self.metrics.records()
        if len(records) <= before:
            ev.ok, ev.note = False, f"no restart record; node 0 said:\n{self.node0.err[-3000:]}"
            return None
        record = records[before]
        again = self.metrics.training_after(lambda t, m: m is record, 60)  # (a relaunch numbers its restarts from 1)
        ev.again = None if again is None else again - ev.at
        redone = record["unfinished_step"] - 1 - record["resumed_from"]
        ev.lost = (f"{redone} step(s) redone (resumed from step {record['resumed_from']}, "
                   f"{record.get('state_from', '?')}); no sample skipped")
        ev.ok = again is not None and said is not None
        return record

    def kill_stage(self, rng: random.Random, node: int | None) -> Event:
        end = time.monotonic() + 30
        while not (procs := [p for p in self.stage_pids() if node is None or p[2] == node]) and time.monotonic() < end:
            time.sleep(0.05)  # (between a restart's stop and start)
        if not procs:
            return Event(f"SIGKILL a stage of node {node}", self.when(), ok=False, note="no stage process to kill")
        pid, comm, n = rng.choice(procs)
        stage, _, replica = comm.removeprefix("pipeq-stage").partition("r")
        ev = Event(f"SIGKILL stage {stage} of replica {replica} (node {n})", self.when())
        before = len(self.metrics.records())
        ev.at = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        self._restarted(ev, before, ("failed", "lost"))
        return ev

    def kill_node1(self) -> Event:
        """SIGKILL node 1's process group (its agent, fork server and stages); once node 0 has
        named the loss, start node 1 again (a replacement, as an operator would): it rejoins."""
        assert self.node0 is not None and self.node1 is not None
        ev = Event("SIGKILL node 1 (its pipeq launch's process group); started again", self.when())
        before = len(self.metrics.records())
        ev.at = time.monotonic()
        self.node1.kill()
        said = self.node0.said(("node 1 lost",), ev.at, 30)
        self.start_node1()
        record = self._restarted(ev, before, ("failed", "lost"))
        if said is None:
            ev.ok, ev.note = False, "node 0 never said 'node 1 lost'"
        elif record is not None:
            if record.get("rejoined") != [1] or record.get("lost_nodes") != [1]:
                ev.ok, ev.note = False, f"the restart record does not show node 1 lost and rejoined: {record}"
            else:
                ev.note = (f"node 0 said 'node 1 lost' {said - ev.at:.2f} s after the kill; node 1, started again "
                           f"then, rejoined; training again {secs(ev.again and ev.again - (said - ev.at))} later")
        return ev

    def fill_disk(self, fs: str) -> Event:
        """Fill node 0's run directory's disk: a write fails (a checkpoint, a metrics line...),
        node 0 must say so in one line and end; node 1 must end too. Then free the space and
        start both again, node 0 with ``--resume``."""
        assert self.node0 is not None and self.node1 is not None
        ev = Event("node 0's run directory's disk filled; freed, both relaunched (--resume)", self.when())
        ev.at = time.monotonic()
        written = fill(fs)
        said = self.node0.said(("no space left",), ev.at, 60)
        ev.detected = None if said is None else said - ev.at
        code0 = self.node0.wait(60)
        exit0 = time.monotonic() - ev.at
        code1 = self.node1.wait(30)
        exit1 = time.monotonic() - ev.at
        last = self.metrics.step()
        problems = []
        if said is None:
            problems.append("node 0 never said 'no space left'")
        if code0 is None or code1 is None:
            problems.append(f"still running after the disk filled: node 0 exit {code0}, node 1 exit {code1}")
        lines = [ln.strip() for _, ln in self.node0.lines if "no space left" in ln]
        left = {ns: procs for ns, procs in self.left(5).items() if procs}
        if left:
            problems.append(f"processes left after both nodes ended: {left}")
        ev.log = self.node0.err  # (in --json)
        if "Traceback" in ev.log:
            told = [ln.strip() for t, ln in self.node0.lines if t >= ev.at and ln.startswith(("pipeq launch:", "Exc"))]
            problems.append(f"node 0 printed {ev.log.count('Traceback')} traceback(s) ({ev.log.strip().splitlines()[-1]}) "
                            f"and said: {' | '.join(told)}")
        self.node0.kill()
        self.node1.kill()
        os.remove(os.path.join(fs, "filler"))
        relaunched = time.monotonic()
        self.start("--resume")
        again = self.metrics.training_after(lambda t, m: t >= relaunched, 120)
        first = next((m["step"] for t, m in self.metrics.snapshot() if t >= relaunched and "loss" in m), None)
        ev.again = None if again is None else again - ev.at
        if first is not None:
            ev.lost = f"{last - (first - 1)} step(s) redone (resumed from step {first - 1}, disk); no sample skipped"
        ev.ok = not problems and again is not None
        ev.note = (f"{written >> 20} MiB written to fill it; node 0 exited {code0} after {exit0:.2f} s saying: "
                   f"{lines[0] if lines else '(nothing)'}; node 1 exited {code1} after {exit1:.2f} s; both started "
                   f"again after {relaunched - ev.at:.2f} s"
                   + ("; PROBLEMS: " + "; ".join(problems) if problems else ""))
        return ev

    def left(self, timeout: float = 10) -> dict[str, list]:
        """The processes still in either namespace ``timeout`` s after both nodes ended (none may be)."""
        end = time.monotonic() + timeout
        while (self.h.procs(self.h.a) or self.h.procs(self.h.b)) and time.monotonic() < end:
            time.sleep(0.1)
        return {ns: self.h.procs(ns) for ns in (self.h.a, self.h.b)}

    def finish(self) -> dict:
        """Wait for both nodes to end the run; what they ended with."""
        assert self.node0 is not None and self.node1 is not None
        code0 = self.node0.wait(300)
        code1 = self.node1.wait(60)
        self.metrics.poll()
        return {"node 0 exit": code0, "node 1 exit": code1, "node 0 tail": self.node0.err[-2000:],
                "node 1 tail": self.node1.err[-2000:]}
