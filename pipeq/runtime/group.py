"""A stage process holding several stages (virtual stages): one event loop serving all of them.

To the driver and the neighbours each stage is what it always is: its own control channel,
inbound sockets and lanes (a :class:`~pipeq.runtime.worker.EventLoop` each, drained together
by an :class:`~pipeq.wire.inbox_group.InboxGroup`). The process serves the commands of every
stage it holds; a batch (TRAIN, PREDICT) runs once all of them have it, as the process's one
action list (:func:`pipeq.runtime.chunks.execute_chunks`): messages between its own stages are
handed over in memory, the others go out on the sending stage's channels. A failure is reported
by the stage it happened in (the ERROR names it), and the process exits, as a one-stage process does.
"""

from __future__ import annotations

import os
import sys
import time

import torch
from typing import Any, Sequence

from pipeq.runtime.batch_command import batch_parts
from pipeq.runtime.chunks import ChunkError, execute_chunks
from pipeq.runtime.faults import inject
from pipeq.runtime.interpreter import StagePlan
from pipeq.runtime.links import PeerLinks
from pipeq.runtime.worker import (EventLoop, WorkerConfig, _make_stage, _orphaned, _prepare_process, _report_error,
                                  _report_ready)
from pipeq.stage.spec import StageBuilder
from pipeq.wire import control
from pipeq.wire.control import Ack, Drain, Exit, Loss, Predict, Train
from pipeq.wire.control_link import Heartbeat
from pipeq.wire.errors import Stopped
from pipeq.wire.inbox_group import InboxGroup
from pipeq.wire.stage_link import StageTransport

__all__ = ["GroupLoop", "group_entry"]

_BATCH = (Train, Predict, Drain)


class GroupLoop:
    """Serves the driver's commands for every stage of one process (``loops``, by chunk), as
    process ``process`` of the schedule's plan."""

    def __init__(self, loops: Sequence[EventLoop], process: int) -> None:
        self.loops = list(loops)
        cfg = self.loops[0].cfg
        self.plan = StagePlan(cfg.schedule, process, cfg.n_stages)
        self.step: int | None = None

    def serve(self) -> None:
        """Carry out the commands until EXIT. A stage's commands run in the order they came; a
        stage given a batch waits (its later commands too) until every stage here has it."""
        batch: dict[int, tuple[Any, Any]] = {}
        exits: set[int] = set()  # the stages told EXIT: the process leaves once all are (the
        deadline = 0.0           # driver's sends to the others must still find them), or 5 s on
        while True:
            got = False
            for c, loop in enumerate(self.loops):
                queue = loop.transport.control_queue
                while queue and c not in batch and c not in exits:
                    got = True
                    msg = queue.popleft()
                    cmd = control.decode(msg)
                    if isinstance(cmd, Exit):
                        exits.add(c)
                        deadline = deadline or time.monotonic() + 5.0
                        continue
                    if isinstance(cmd, _BATCH):
                        batch[c] = (cmd, msg)
                        continue
                    answer = loop.answer(cmd, msg)
                    if answer is not None:
                        loop.transport.send_control(answer)
            if len(exits) == len(self.loops) or (exits and time.monotonic() > deadline):
                return
            if len(batch) == len(self.loops):
                self._batch([batch[c] for c in range(len(self.loops))])
                batch.clear()
            elif not got:
                self.loops[0].transport.pump(100 if exits else 1000)

    def _batch(self, given: list[tuple[Any, Any]]) -> None:
        """Run one batch on every stage of the process (or a DRAIN: nothing is left to drain)."""
        kinds = {type(cmd) for cmd, _ in given}
        steps = {msg.step for _, msg in given}
        if len(kinds) != 1 or len(steps) != 1:
            raise RuntimeError(f"the stages of one process were given different batches: "
                               f"{[type(c).__name__ for c, _ in given]} for steps {sorted(steps)}")
        cmd0 = given[0][0]
        if isinstance(cmd0, Drain):
            for loop, (_, msg) in zip(self.loops, given):
                loop.transport.send_control(control.message(Ack(), msg.step))
            return
        training = isinstance(cmd0, Train)
        step = self.step = given[0][1].step
        for loop in self.loops:
            loop.step = step
        for c, loop in enumerate(self.loops):
            if training and loop.cfg.fault is not None:
                try:
                    inject(loop.cfg.fault, loop.cfg.stage, step, loop.cfg.replica, self._note)
                except Exception as exc:
                    raise ChunkError(loop.cfg.stage, c, exc) from exc
        for loop, (cmd, msg) in zip(self.loops, given):
            ex = loop.executor
            x, target, inputs = batch_parts(cmd, msg.tensors, loop.cfg.stage, ex.is_first, ex.needs_target and training)
            more = {"inputs": inputs} if inputs is not None else {}
            ex.begin(step, cmd.sizes, training, x, target, getattr(cmd, "weights", None),
                     aux_weights=getattr(cmd, "aux_weights", None), **more)
        last = self.loops[-1] if self.loops[-1].executor.is_last else None
        lr = last.executor.learning_rate() if last is not None and training else None
        self._run(self.plan.actions(len(cmd0.sizes), training), step)
        if last is not None and training:
            last.transport.send_control(control.message(Loss(loss=last.executor.mean_loss(), lr=lr), step))

    def _note(self, code: int, j: int) -> None:
        now = (code, j, time.monotonic())
        for loop in self.loops:
            loop.current = now

    def _run(self, actions: list[Any], step: int) -> None:
        """Run the process's actions, each request carried out by its chunk's stage."""
        loops = self.loops
        gen = execute_chunks([lp.executor for lp in loops], actions, [lp.trace for lp in loops], None, self._note)
        value: Any = None
        try:
            while True:
                req = gen.send(value)
                for loop in loops:
                    loop.current = None
                value = loops[req[-1]].carry_out(req[:-1], step, None)
        except StopIteration:
            pass
        finally:
            for loop in loops:
                loop.current = None


def group_entry(cfgs: Sequence[WorkerConfig], payloads: Sequence["bytes | StageBuilder"], process: int) -> None:
    """Entry point of a process holding the stages ``cfgs`` (one per chunk; ``payloads`` alike),
    process ``process`` of the schedule's plan. Like :func:`pipeq.runtime.worker.worker_entry`."""
    _prepare_process(cfgs[0])
    transports = [StageTransport(cfg.process, cfg.control_addr, bind=cfg.bind, queue_capacity=cfg.queue_capacity,
                                 spin_s=cfg.spin_s, auth=cfg.auth, max_frame_bytes=cfg.max_frame_bytes,
                                 shm=cfg.shm(), device=torch.device(cfg.device)) for cfg in cfgs]
    InboxGroup(transports)
    clean = _serve_group(cfgs, payloads, transports, process)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0 if clean else 1)


def _serve_group(cfgs: Sequence[WorkerConfig], payloads: Sequence["bytes | StageBuilder"],
                 transports: list[StageTransport], process: int) -> bool:
    """Build every stage, report each READY, serve until EXIT; False after a failure (reported
    by the stage that failed, or by every stage when it is not known which)."""
    beats: list[Heartbeat] = []
    links: list[PeerLinks] = []
    loops: list[EventLoop] = []
    group: GroupLoop | None = None
    try:
        for cfg, t in zip(cfgs, transports):
            beats.append(Heartbeat(t.ctx, cfg.control_addr, cfg.process, cfg.heartbeat_interval,
                                   cfg.driver_pid or os.getppid(), lambda cfg=cfg: _orphaned(cfg), auth=cfg.auth,
                                   status=lambda i=len(beats): control.encode(loops[i].doing())
                                   if i < len(loops) else None))
        for cfg, payload, t in zip(cfgs, payloads, transports):
            executor, serving = _make_stage(cfg, payload, t)
            links.append(PeerLinks(t, cfg.bind, executor, stage=cfg.stage, replica=cfg.replica,
                                   replicas=cfg.replicas))
            _report_ready(cfg, t, executor, links[-1])
            loops.append(EventLoop(cfg, serving, executor, links[-1]))
        group = GroupLoop(loops, process)
        group.serve()
        return True
    except Stopped:
        return True
    except BaseException as exc:
        failed = [exc.chunk] if isinstance(exc, ChunkError) else range(len(transports))
        for c in failed:
            _report_error(transports[c], exc, loops[c] if c < len(loops) else None)
        return False
    finally:
        for hb in beats:
            hb.stop()
        for ln in links:
            ln.close(linger_ms=200)
        for t in transports:
            t.close(linger_ms=200)

