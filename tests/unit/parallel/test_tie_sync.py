"""Tied gradients between stage processes' transports (pipeq.parallel.ties over pipeq.wire.tie_link), in this process: bucketed, tagged, authenticated per link."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from torch import nn

from pipeq.parallel.ties import TieSync
from pipeq.stage.info import Tie, set_info
from pipeq.stage.ties import TiedGrads
from pipeq.wire.keys import JobSecret
from pipeq.wire.security import FrameMac, WireAuth
from pipeq.wire.sockets import BindTo, make_ipc_dir, remove_ipc_dir
from one_stage import OneStage


def _tied(k):
    """Stage k's module holding two tied tensors (a big one and a small one), tied with stage 2 - k."""
    module = nn.Module()
    module.big = nn.Parameter(torch.zeros(40, 30))
    module.small = nn.Parameter(torch.zeros(7, dtype=torch.float64))
    set_info(module, ties=(Tie("big", "big", (0, 2)), Tie("small", "small", (0, 2))))
    return TiedGrads.of(module, k)


def _pair(bind, auth=None, max_frame_bytes=256 << 20):
    """Stages 0 and 2 of one replica, joined (each learns which pieces the other holds: both whole)."""
    stages = {k: OneStage(k, "inproc://unused", bind=bind, queue_capacity=4, auth=auth,
                          max_frame_bytes=max_frame_bytes) for k in (0, 2)}
    syncs = {k: TieSync(t.rx, bind, stage=k, replica=0, tied=_tied(k), peers=[2 - k]) for k, t in stages.items()}
    joiner = threading.Thread(target=syncs[2].join, args=([syncs[0].address, None, syncs[2].address],))
    joiner.start()
    syncs[0].join([syncs[0].address, None, syncs[2].address])
    joiner.join(10)
    assert syncs[0].tied.theirs[2] == syncs[2].tied.pieces() and not syncs[0].tied.redistributed()
    return stages, syncs


def _close(stages, syncs):
    for s in syncs.values():
        s.close()
    for t in stages.values():
        t.close()


def _exchange_both(syncs, n, grads):
    """Both stages' exchange number ``n`` at once (each waits for the other's)."""
    got = {}
    thread = threading.Thread(target=lambda: got.__setitem__(2, syncs[2].exchange(n, {0: grads[2]})))
    thread.start()
    got[0] = syncs[0].exchange(n, {2: grads[0]})
    thread.join(10)
    return got


@pytest.mark.timeout(30)
def test_tied_gradients_cross_in_buckets_and_come_back_as_fresh_tensors():
    where = make_ipc_dir()
    stages, syncs = _pair(BindTo.ipc(where), max_frame_bytes=1024)  # 4800-byte tensor: five buckets
    try:
        grads = {k: [torch.randn(40, 30), torch.randn(7, dtype=torch.float64)] for k in (0, 2)}
        for n in (1, 2):  # two exchanges, tagged apart
            got = _exchange_both(syncs, n, grads)
            assert len(syncs[0]._layout(2, grads[0])) > 2
            for k in (0, 2):
                assert all(torch.equal(a, b) for a, b in zip(got[k][2 - k], grads[2 - k]))
                assert all(a.data_ptr() != b.data_ptr() for a, b in zip(got[k][2 - k], grads[2 - k]))
        with pytest.raises(RuntimeError, match="tied gradients for stages \\[1\\], but its tie peers are \\[2\\]"):
            syncs[0].exchange(3, {1: grads[0]})
        with pytest.raises(RuntimeError, match="stage\\(s\\) \\[2\\], which have no tie link"):
            syncs[0].join([syncs[0].address, None, None])
    finally:
        _close(stages, syncs)
        remove_ipc_dir(where)


@pytest.mark.timeout(30)
def test_a_message_sealed_for_another_link_is_dropped():
    """tcp "authenticate": a tie message sealed for replica 1's link 2 -> 0, for shard 1's, or for
    the other direction, does not open on replica 0's; the genuine one does."""
    auth = WireAuth(JobSecret.generate(), "authenticate")
    stages, syncs = _pair(BindTo.tcp("127.0.0.1"), auth)
    try:
        link0, link2 = syncs[0].link, syncs[2].link
        from pipeq.wire import codec
        from pipeq.wire.messages import Kind

        frames = codec.encode(Kind.TIE, 1, 0, [torch.ones(3)])
        out = link2._out[0]
        for label in ("T1.0:2>0", "T0.1:2>0", "T0.0:0>2"):
            out.send_multipart([b"\0\0\0\2", *FrameMac(auth, label).seal(frames)])
        link2.send(1, 0, [torch.full((3,), 2.0)], to=[0])
        assert torch.equal(link0.wait(2, 1, 0)[0], torch.full((3,), 2.0))
        time.sleep(0.2)
        link0.drain()
        assert link0.dropped == 3 and len(link0.queue) == 0
    finally:
        _close(stages, syncs)
