"""``fault_tolerance="replicas"``: with data parallelism, replicas that carry on when one fails.

When a stage of replica r fails during a training step (it raises, dies, stops heart-beating or
is stuck past ``step_timeout``), the driver does not end the run:

1. it stops every process of replica r and tells the other replicas' stages (LOST) to sum the
   gradients without it: a stage waiting for r's gradient buckets stops waiting at once;
2. each surviving stage sums, in replica order, the buckets of the replicas whose copy of that
   stage delivered all of them for the step, and scales the sum by the whole batch's loss weight
   over theirs (:func:`pipeq.parallel.data.survivor_scale`). Every microbatch's loss is weighted
   by its share of the whole batch, so the step's update is the one a batch made of the
   completed replicas' samples only gives: the mean loss over those samples. The loss reported
   for the step is that mean too (the survivors' weighted losses, scaled alike);
3. before the next command (the next step), replica r is started again: fresh processes, wired
   to their neighbours and to the other replicas, then loaded with a healthy replica's live
   state (weights and buffers, optimizer, lr schedulers, loss scaler: the state the survivors
   hold after the step; each stage keeps its own random streams, seeded as at the run's start).
   The next step runs with every replica again.

The run never stops and never rolls back. The steps that had fewer replicas are recorded
(``runner.degraded_steps``; ``pipeq launch`` writes ``"replicas"`` in their metrics line).

A failure of the last healthy replica, a failure while a replica is being rebuilt, and a failure
outside a training step (an evaluation, a save) still end the run, as without this setting. A
lost replica's samples of the step are not trained on; a stage of the lost replica that had
already delivered its gradients for the step when another of its stages failed is counted for
that stage (the sums are made per stage), which a failure at a step's start never causes.
Supported on one host, one stage per process, without tensor parallelism, with schedules that
finish every batch before the next (not asynchronous 1F1B).
"""

from __future__ import annotations

import os
import sys
import time
from typing import TYPE_CHECKING, Any, Callable

from pipeq.control.processes import stop_processes
from pipeq.errors import PipelineError
from pipeq.wire import control, shm
from pipeq.wire.control import GetSnapshot, Lost, Ready, Rejoin, Restore
from pipeq.wire.errors import PeerUnreachable
from pipeq.wire.lanes import lane_path
from pipeq.wire.messages import Kind, Message

if TYPE_CHECKING:
    from pipeq.control.config import RunConfig
    from pipeq.control.startup import StageProcesses

__all__ = ["check_replicas_mode", "ReplicaLoss"]


def check_replicas_mode(cfg: "RunConfig", *, multi_host: bool) -> None:
    """Refuse, naming the setting, what ``fault_tolerance="replicas"`` does not support."""
    if cfg.fault.fault_tolerance != "replicas":
        return
    place, schedule = cfg.placement, cfg.schedule
    what = "fault_tolerance='replicas'"
    if place.mode != "process":
        raise ValueError(f"{what} needs mode='process' (a simulated run has no replicas to lose)")
    if place.data_parallel < 2:
        raise ValueError(f"{what} needs data_parallel >= 2 (the other replicas carry on without a failed one), "
                         f"got data_parallel={place.data_parallel}: set data_parallel=2 or more, or leave "
                         "fault_tolerance unset (pipeq launch --max-restarts restarts a run from its checkpoint)")
    if place.tensor_parallel > 1:
        raise ValueError(f"{what} does not support tensor_parallel={place.tensor_parallel} yet: use "
                         "tensor_parallel=1, or leave fault_tolerance unset")
    if schedule.stages_per_process > 1:
        raise ValueError(f"{what} does not support schedule {schedule.name!r}, which holds several stages per "
                         "process: use a schedule of one stage per process (e.g. '1f1b')")
    if schedule.streams_across_batches:
        raise ValueError(f"{what} does not support schedule {schedule.name!r}, which carries work across "
                         "batches: use a schedule that finishes each batch (e.g. '1f1b')")
    if multi_host:
        raise ValueError(f"{what} runs on one host only for now: leave it unset in a multi-host run "
                         "(pipeq launch --max-restarts restarts a run from its checkpoint)")


class ReplicaLoss:
    """The driver's side: drops a failed replica (the supervisor's ``absorb``) and rebuilds it.

    ``busy()`` says whether a training step is outstanding: only then is a failure absorbed."""

    def __init__(self, processes: "StageProcesses", busy: Callable[[], bool]) -> None:
        self.p = processes
        self.busy = busy
        self.down: dict[int, PipelineError] = {}  # replica -> the failure that dropped it
        self.failures: list[PipelineError] = []  # every failure absorbed, in order
        processes.absorb = self.absorb

    def live(self) -> list[int]:
        """The replicas running now."""
        return [r for r in range(self.p.replicas) if r not in self.down]

    def processes_of(self, r: int) -> list[int]:
        n = self.p.n_stages
        return list(range(r * n, (r + 1) * n))

    def absorb(self, g: int, err: PipelineError) -> bool:
        """Process g has failed: drop its replica and carry on (True), when a training step is
        outstanding and another replica is healthy; else False (the run ends)."""
        r = self.p.numbering.replica(g)
        if not self.busy() or r in self.down or len(self.live()) < 2:
            return False
        self._drop(r, err)
        return True

    def _drop(self, r: int, err: PipelineError) -> None:
        p, sup = self.p, self.p.sup
        assert sup is not None and sup.server is not None
        self.down[r] = err
        self.failures.append(err)
        mine = self.processes_of(r)
        sup.ignore(mine)
        stop_processes([p.procs.pop(g) for g in mine if g in p.procs])
        lost = control.message(Lost(replica=r))
        try:
            sup.server.send_many([(g, lost) for s in self.live() for g in self.processes_of(s)])
        except PeerUnreachable as exc:  # a survivor is gone too: that one ends the run
            raise sup.fail(sup.error("its control socket is gone", exc.process))
        print(f"pipeq: {_where(err)}: {err.message}; the other replicas finish the step without replica {r}, "
              "which is rebuilt for the next step", file=sys.stderr)

    def rebuild(self, rounds: int, request_id: Callable[[], int]) -> None:
        """Start every lost replica again from a healthy one's state (nothing may be in flight);
        ``rounds``: the gradient rounds every replica has made so far (the training steps sent)."""
        for r in sorted(self.down):
            self._rebuild(r, rounds, request_id)
            del self.down[r]

    def _rebuild(self, r: int, rounds: int, request_id: Callable[[], int]) -> None:
        p, sup = self.p, self.p.sup
        assert sup is not None
        mine = self.processes_of(r)
        end = time.monotonic() + 0.2  # what the lost processes sent before they died: read, ignored
        while time.monotonic() < end:
            sup.drain_pending()
            time.sleep(0.02)
        if p.ipc_dir is not None:  # their shared-memory segments and lanes: the new processes make their own
            for g in mine:
                for direction in "FB":
                    shm.remove_segments(f"{shm.run_prefix(p.ipc_dir)}-{direction}{g}")
                for address in (p.ready[g].forward, p.ready[g].backward):
                    path = lane_path(address)
                    if path is not None and os.path.exists(path):
                        os.unlink(path)
        p.spawn(mine)
        now = time.monotonic()
        for g in mine:  # they count again, judged for heartbeats from now on
            sup.ignored.discard(g)
            sup.last_beat[g] = now
        replies = sup.collect(Kind.READY, dict.fromkeys(mine, 1), timeout=p.start_timeout,
                              what=f"replica {r}'s restart")
        for g in mine:
            p.ready[g] = control.read(replies[g][0], Ready)
        healthy = self.live()
        others = [g for s in healthy for g in self.processes_of(s)]
        req = request_id()
        msgs: list[tuple[int, Message]] = [(g, m) for g, m in p._peers(p.ready, req, rejoin_round=rounds)
                                           if g in mine]
        for g in others:
            link = p.ready[r * p.n_stages + g % p.n_stages].replica_link
            assert link is not None
            msgs.append((g, control.message(Rejoin(replica=r, address=link, round=rounds), req)))
        sup.send_all(msgs)
        sup.collect(Kind.ACK, dict.fromkeys(mine + others, 1), step=req, timeout=p.start_timeout,
                    what=f"replica {r}'s rejoining")
        self._copy_state(self.processes_of(healthy[0]), mine, request_id)

    def _copy_state(self, source: list[int], target: list[int], request_id: Callable[[], int]) -> None:
        """Each stage of ``target`` (a rebuilt replica) loads the live state of the same stage of
        ``source`` (a healthy one): weights, optimizer, schedulers, scaler; not its RNG."""
        sup = self.p.sup
        assert sup is not None
        req = request_id()
        sup.send_all([(g, control.message(GetSnapshot(), req)) for g in source])
        got = sup.collect(Kind.SNAPSHOT, dict.fromkeys(source, 1), step=req, what="a healthy replica's state")
        req = request_id()
        msgs = []
        for g, h in zip(source, target):
            snap: dict[str, Any] = control.state_of(got[g][0])
            snap.pop("rng", None)  # each replica's own random streams (dropout masks differ)
            msgs.append((h, control.state_message(Restore, req, snap, f"stage {g % self.p.n_stages}'s state")))
        sup.send_all(msgs)
        sup.collect(Kind.ACK, dict.fromkeys(target, 1), step=req, what="the rebuilt replica's state")


def _where(err: PipelineError) -> str:
    """Where a failure happened, as its error names it."""
    parts = [f"replica {err.replica}"] if err.replica is not None else []
    if err.stage is not None:
        parts.append(f"stage {err.stage}")
    return ", ".join(parts) or "a stage"
