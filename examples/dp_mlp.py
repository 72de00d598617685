"""The tutorial's data-parallel MLP: two replicas of a 16-8-1 MLP, gradients summed every step.

    python examples/dp_mlp.py                  # 5001 steps, 2 replica processes, float64
    python examples/dp_mlp.py --float32        # the tutorial's precision (see below)
    python examples/dp_mlp.py --steps 1000 --every 200

The tutorial's setup: ``torch.manual_seed(40)``, 320 random 16-dim inputs with random binary
targets, the MLP (Linear 16->8, ReLU, Linear 8->1, sigmoid), BCE, SGD. Its data-parallel section
gives each of two nodes a batch of 32, sums the two nodes' gradients and steps once. Here that is
``PipelineRunner([mlp], ..., data_parallel=2)``: one stage (N = 1) holding the whole MLP, two
replicas (two processes; replica 0's weights are broadcast to replica 1 when they start). Each
``runner.step`` takes a batch of 64 consecutive samples (5 steps per pass over the data): replica
0 gets the first 32, replica 1 the next 32 (one microbatch each), and the two replicas' gradients
are summed (over pipeq's own ZeroMQ link between the replicas) before each replica steps its own
optimizer.

The learning rate. pipeq weights each replica's loss by its share of the whole batch, so the
summed gradient is the gradient of the mean loss over all 64 samples (half the tutorial's sum of
two 32-sample means). The tutorial's update ``0.5 x (g_0 + g_1)`` is therefore ``1.0 x`` pipeq's
gradient: the learning rate doubled for the doubled effective batch.

The loss curve is printed every ``--every`` steps (the mean loss of the step's 64 samples before
its update: the tutorial's average of its two nodes' losses). At the end the same steps are
repeated in this process by plain PyTorch (one model, the same initial weights, each batch of 64
at once, SGD lr 1.0) and the parameters compared. A run here (2-core VM shared with other jobs,
forkserver)::

    step     0: loss 0.704
    step  1000: loss 0.579
    step  2000: loss 0.489
    step  3000: loss 0.473
    step  4000: loss 0.463
    step  5000: loss 0.455
    5001 steps of 2 x 32 samples (float64) on 2 replicas in 28.3 s (3.5 s to start the replica processes)
    single-process training on the same batches: max |parameter difference| 9.8e-15

Why float64 by default: the two runs sum the same numbers in a different order (two halves of
32, then an all-reduce, against one batch of 64), so they differ by rounding, and a ReLU turns
rounding into a jump when a sample's pre-activation is as small as the rounding. The tutorial's
run meets one at step 422 (a pre-activation of 3e-7). In float32 (``--float32``) most of our runs
part there, some do not (the rounding details vary from run to run), and from then on the two
follow different paths::

    step     0: loss 0.704                       (the same up to step 422)
    step  1000: loss 0.588
    step  2000: loss 0.604
    step  3000: loss 0.453
    step  4000: loss 0.889
    step  5000: loss 0.356
    5001 steps of 2 x 32 samples (float32) on 2 replicas in 24.8 s (3.4 s to start the replica processes)
    single-process training on the same batches: max |parameter difference| 3.9e+00
    the runs parted at step 423 (loss 0.6669 against 0.6665); the smallest |ReLU pre-activation|
    in the 3 steps before: 2.8e-07 (float32 rounding decides that sample's side of the kink)

When they do not part, the difference at the end is ~1e-5. In float64 no pre-activation of the
run comes near rounding (none is below 1e-9) and the runs agree to 1e-14: each step is the
single-process step. (The tutorial's own curve, 0.706, 0.467, 0.361, 0.347, 0.320, 0.293, is
of another run: its model is re-made after its first loop, and its nodes' batches overlap, node 1
taking the batch node 0 takes in the next iteration.)
"""

from __future__ import annotations

import argparse
import copy
import functools
import time

if __name__ == "__main__":  # said at once: importing torch takes a second or two
    print(f"pipeq example: {__doc__.splitlines()[0]}", flush=True)

import torch
from torch import nn

import pipeq

DATASET = 320
BATCH = 32    # per replica: the tutorial's batch
REPLICAS = 2
LR = 0.5      # the tutorial's; doubled for the doubled batch (see the docstring)


class MLP(nn.Module):
    def __init__(self, layer_1_in: int = 16, layer_1_out: int = 8, layer_2_out: int = 1) -> None:
        super().__init__()
        self.w1 = nn.Linear(layer_1_in, layer_1_out)
        self.w2 = nn.Linear(layer_1_out, layer_2_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.w2(torch.relu(self.w1(x))))


def tutorial_data(dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor, MLP]:
    """The tutorial's inputs, targets and initial model (seed 40, in its order)."""
    torch.manual_seed(40)
    x = torch.rand([DATASET, 16])
    target = torch.randint(0, 2, [DATASET, 1], dtype=torch.float32)
    return x.to(dtype), target.to(dtype), MLP().to(dtype)


def batches(x: torch.Tensor, target: torch.Tensor, steps: int, size: int):
    """Step i's batch: ``size`` consecutive samples from (i * size) mod 320, wrapping round."""
    for i in range(steps):
        idx = (torch.arange(size) + i * size) % len(x)
        yield x[idx], target[idx]


def reference(model: nn.Module, x: torch.Tensor, target: torch.Tensor, steps: int, size: int,
              lr: float) -> tuple[nn.Module, list[float], list[float]]:
    """Plain single-process training of a copy of ``model`` on the same batches: the model, the
    loss of every step and the smallest |first-layer pre-activation| of every step's batch."""
    model = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    loss_fn = nn.BCELoss()
    losses, kinks = [], []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: more threads only wait for each other on a busy host
    try:
        for xb, yb in batches(x, target, steps, size):
            opt.zero_grad()
            with torch.no_grad():
                kinks.append(model.w1(xb).abs().min().item())
            loss = loss_fn(model(xb), yb)
            loss.backward()
            opt.step()
            losses.append(loss.item())
    finally:
        torch.set_num_threads(threads)
    return model, losses, kinks


def train(steps: int = 5001, every: int = 1000, replicas: int = REPLICAS, batch: int = BATCH,
          dtype: torch.dtype = torch.float64, start_method: str = "forkserver",
          verbose: bool = True) -> dict:
    """Returns {"curve": [(step, loss)], "max_diff", "seconds", "start_s", "parted_at"}."""
    x, target, model = tutorial_data(dtype)
    size = replicas * batch
    lr = LR * replicas  # the tutorial sums the replicas' mean gradients; pipeq averages them
    runner = pipeq.PipelineRunner(
        [model], nn.BCELoss(), functools.partial(torch.optim.SGD, lr=lr),
        schedule="1f1b", microbatches=1,  # one microbatch per replica: its whole shard
        data_parallel=replicas, start_method=start_method, threads_per_stage=1,
    )
    losses = []
    t_start = time.perf_counter()
    with runner:
        t0 = time.perf_counter()
        for i, (xb, yb) in enumerate(batches(x, target, steps, size)):
            losses.append(runner.step(xb, yb))
            if verbose and i % every == 0:
                print(f"step {i:5d}: loss {losses[-1]:.3f}", flush=True)
        seconds = time.perf_counter() - t0
        state = runner.state_dict()  # replica 0's; replica 1's gradients are in every update
    ref, ref_losses, kinks = reference(model, x, target, steps, size, lr)
    max_diff = max((state[f"0.{k}"] - v).abs().max().item() for k, v in ref.state_dict().items())
    parted = next((i for i in range(steps) if abs(losses[i] - ref_losses[i]) > 1e-4), None)
    if verbose:
        name = str(dtype).removeprefix("torch.")
        print(f"{steps} steps of {replicas} x {batch} samples ({name}) on {replicas} replicas in "
              f"{seconds:.1f} s ({t0 - t_start:.1f} s to start the replica processes)")
        print(f"single-process training on the same batches: max |parameter difference| {max_diff:.1e}")
        if parted is not None:
            print(f"the runs parted at step {parted} (loss {losses[parted]:.4f} against "
                  f"{ref_losses[parted]:.4f}); the smallest |ReLU pre-activation|\n"
                  f"in the 3 steps before: {min(kinks[max(0, parted - 3):parted] or [float('nan')]):.1e} "
                  f"({name} rounding decides that sample's side of the kink)")
    return {"curve": [(i, losses[i]) for i in range(0, steps, every)], "losses": losses,
            "max_diff": max_diff, "seconds": seconds, "start_s": t0 - t_start, "parted_at": parted}


if __name__ == "__main__":  # required: the replica processes re-import this file
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=5001, help="steps of 2 x 32 samples (the tutorial: 5001)")
    p.add_argument("--every", type=int, default=1000, help="print the loss every N steps")
    p.add_argument("--replicas", type=int, default=REPLICAS)
    p.add_argument("--float32", action="store_true", help="the tutorial's precision (default float64)")
    a = p.parse_args()
    train(a.steps, a.every, replicas=a.replicas, dtype=torch.float32 if a.float32 else torch.float64)
