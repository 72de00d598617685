"""Activations and gradients between CUDA stages, by every way the wire settings give them.

    transport="ipc" (default)   device tensors through CUDA IPC slots (pipeq.wire.shm's
                                CudaSlotWriter / CudaSlotReader: a device buffer and an
                                interprocess event per slot; the handles in the header)
    ipc, shm_slots=1            the same with one slot per channel: a sender waits for it
    ipc, shm_slots=0            no shared memory: host copies through pinned memory
                                (pipeq.stage.transfer), ZeroMQ frames
    transport="tcp"             pinned host copies over TCP (encrypted, the default security)

each with every stage on cuda:0 and with neighbours on different GPUs (peer devices: the
receiver opens the sender's buffer on the sender's GPU and copies it to its own). The messages
hold a float32 activation and an int64 tensor (two dtypes in one slot), the middle stage's
activation is non-contiguous, and the second step's microbatches (1.2 MiB) outgrow the slots'
first 1 MiB buffers, so each slot is allocated again (a new generation of IPC handles).
"""

from __future__ import annotations

import pytest
import torch

from gpu_cases import CUDA, FP32_TOL, assert_matches, batches, needs_gpus, predict, reference, round_robin, train, \
    tuple_stages

pytestmark = [*CUDA, pytest.mark.timeout(300)]

WIRES = {
    "cuda-ipc": dict(transport="ipc"),
    "cuda-ipc-one-slot": dict(transport="ipc", shm_slots=1),
    "pinned-frames": dict(transport="ipc", shm_slots=0),
    "pinned-tcp": dict(transport="tcp"),
}
PLACEMENTS = [
    pytest.param("same-device", id="same-device"),
    pytest.param("peer-devices", id="peer-devices", marks=needs_gpus(2)),
]


@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("wire", list(WIRES))
def test_activations_and_gradients_cross_between_cuda_stages(wire, placement):
    devices = ["cuda:0"] * 3 if placement == "same-device" else round_robin(3)
    stages = tuple_stages(width=512)
    # microbatches of 16, 600 (600 x 512 float32: 1.2 MiB, over a slot's first 1 MiB) and 4 rows
    data = batches(3, [64, 2400, 16])
    x_eval = batches(1, 37, seed=9)[0][0]
    got = train(stages, data, schedule="1f1b", microbatches=4, devices=devices, x_eval=x_eval, **WIRES[wire])
    assert got.devices == devices
    assert all(isinstance(s["shm_waits"], int) for s in got.stats)
    want = reference(stages, data)
    assert_matches(got, want, FP32_TOL)
    torch.testing.assert_close(got.pred, predict(want, x_eval), atol=FP32_TOL, rtol=0)
