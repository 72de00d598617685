"""The tutorial's tensor-parallel MLP: a 16-8-1 MLP split over two processes, layer by layer.

    python examples/tp_mlp.py                    # the tutorial's iterations 0-1000, float64
    python examples/tp_mlp.py --steps 2001       # to its iteration 2000
    python examples/tp_mlp.py --float32 --steps 5001 --every 1000   # its precision and length

The tutorial's tensor-parallel section: its MLP (Linear 16->8, ReLU, Linear 8->1, sigmoid), BCE,
SGD, the 320 random inputs and binary targets of ``torch.manual_seed(40)``. Node 0 holds rows
0-3 of the first layer (4 of its 8 outputs) and node 1 rows 4-7; the second layer is split by
its input columns, each node multiplying its own 4 activations by its 4 columns, and the two
partial sums are added (the one bias lives on node 0). Batches of 64 (twice the tutorial's 32:
"since we split the model in half, we can double the batch size") and so lr 1.0 ("we'll have
twice the effective batch size, so we double the lr").

Here that is one pipeline stage, ``nn.Sequential(Linear(16, 8), ReLU(), Linear(8, 1), Sigmoid())``,
on ``tensor_parallel=2`` processes with the plan ``{"0": "colwise", "2": "rowwise"}``: torch's
``ColwiseParallel`` gives shard s the output rows 4s..4s+3 of layer "0" (its weight is sharded on
dim 0, "column-wise" in torch's y = x A convention), ``RowwiseParallel`` gives it the matching
input columns of layer "2" and all-reduces the two partial sums (gloo) -- the tutorial's split
exactly, with one difference: torch keeps the second layer's bias on both shards (replicated, the
same gradient on each; counted once in the summed output), where the tutorial keeps it on node 0
only; the result is the same. The ReLU and the sigmoid act on what each shard already has (its 4
activations; the summed output), so a forward needs one all-reduce of 64 numbers (beside shard 0
sharing the batch it receives with shard 1).

Why one stage: the tutorial's two nodes are the two shards of one stage (T = 2, N = 1: two
processes, one per core here). Cutting the MLP into two pipeline stages would cut the colwise /
rowwise pair apart: a stage ending in a trailing "colwise" gathers its output, so the 8
activations would be gathered and shipped to the next stage, which is the very communication the
colwise-then-rowwise pairing avoids, and the 4 processes would share 2 cores.

Initial weights: the tutorial makes a fresh MLP for this section without re-seeding, so its
weights are the third ``MLP(16, 8, 1)`` drawn after ``manual_seed(40)`` and the data (its
earlier sections each made one); ``tutorial_data`` replays that. The tutorial's batches:
iteration i takes ``x[i*64 % 320 : (i+1)*64 % 320]``, so every fifth slice is ``x[256:0]``, empty
(the end wraps to 0): its loss is nan and its step changes nothing (every gradient is a sum over
no samples). Those iterations are skipped here (``--steps 5001`` makes 4001 updates on samples
0-255, as the tutorial's run does) and the tutorial's iteration numbers are kept, so its printed
losses can be read beside ours: 0.693 at 0, 0.510 at 1000, 0.367 at 2000 (later ones depend on
rounding: float32 and the split summation order make that run chaotic after ~2000 iterations).

At the end the same updates are repeated in this process by plain PyTorch (one unsplit model,
the same initial weights and batches, SGD lr 1.0), and the losses of every update and the final
parameters (``runner.state_dict()``: full, unsharded tensors) are compared. A run here (2-core VM,
forkserver; the time excludes starting the two shard processes)::

    $ python examples/tp_mlp.py
    stage 0 on 2 processes: shard 0 pid 17333, shard 1 pid 17337
    iteration    pipeq T=2  one process   |diff| tutorial
            0     0.693083     0.693083  0.0e+00    0.693
          250     0.682693     0.682693  0.0e+00
          500     0.627681     0.627681  0.0e+00
          750     0.538238     0.538238  0.0e+00
         1000     0.510174     0.510174  0.0e+00    0.510
    801 updates of 64 samples (float64; the tutorial's iterations 0-1000, its empty slices skipped) on 1 stage x 2 shards in 4.6 s (2.4 s to start the shard processes)
    single-process training on the same batches: max |loss difference| 7.8e-16 over 801 updates, max |parameter difference| 3.1e-15

``--steps 2001`` goes on to 0.367259 at iteration 2000 (the tutorial: 0.367), still to 1e-15.
A step costs ~6 ms here against ~0.9 ms with ``--shards 1`` (the same run, one process, no
plan): the model is 145 numbers, so a step is all latency -- the shards' all-reduce and shard 0
sharing each message with shard 1 are gloo collectives between two processes, which take
0.3-4 ms each on this VM (``bench/bench_tp.py`` measures them). Tensor parallelism is for
layers too large for one device, not for this one.

Why float64 by default (as in ``examples/dp_mlp.py``): the shards sum the second layer's product
in two halves of 4 where one process sums 8 terms, so the two runs differ by rounding, and this
training amplifies a difference as it goes. In float32 it grows from 6e-8 (iteration 1000) to
2.4e-7 (2000) and 4.6e-6 (3000), and the runs part near iteration 2900 (no ReLU kink needed: the
smallest |pre-activation| of those batches is ~1e-3); in float64 it starts ~5e8 times smaller
and is 1.8e-12 after all 5001 iterations (~1e-15 up to iteration 2000). In float32::

    $ python examples/tp_mlp.py --float32 --steps 5001 --every 1000
    iteration    pipeq T=2  one process   |diff| tutorial
            0     0.693083     0.693083  0.0e+00    0.693
         1000     0.510174     0.510174  6.0e-08    0.510
         2000     0.367258     0.367259  2.4e-07    0.367
         3000     0.308903     0.308908  4.6e-06    0.315
         4000     0.306181     0.298366  7.8e-03    0.298
         5000     0.296446     0.314725  1.8e-02    0.285
    4001 updates of 64 samples (float32; ...) on 1 stage x 2 shards in 19.7 s (2.4 s to start the shard processes)
    single-process training on the same batches: max |loss difference| 1.1e+00 over 4001 updates, max |parameter difference| 1.2e-01
    the runs parted at iteration 2888 (loss 0.3425 against 0.3423): float32 rounding of the two summation orders (see the docstring)

The tutorial's own float32 run (0.315, 0.298, 0.285 at 3000-5000) is a third path: it sums
in yet another order (its own split, on its torch).
"""

from __future__ import annotations

import argparse
import copy
import functools
import time

import os
import sys

if __name__ == "__main__":  # said at once: importing torch takes a second or two
    print(f"pipeq example: {__doc__.splitlines()[0]}", flush=True)

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import pipeq  # noqa: E402
from examples import dp_mlp  # noqa: E402  (the tutorial's model and data, drawn in its order)
from examples.dp_mlp import MLP  # noqa: E402

BATCH = 64        # the tutorial's "split_model_batch_size = 2 * batch_size"
LR = 1.0          # the tutorial's "2 * lr" for the doubled batch
PLAN = {"0": "colwise", "2": "rowwise"}
SHARDS = 2
# the tutorial's printed losses of its tensor-parallel loop (float32, iteration: loss)
TUTORIAL = {0: 0.693, 1000: 0.510, 2000: 0.367, 3000: 0.315, 4000: 0.298, 5000: 0.285}


def as_sequential(mlp: MLP) -> nn.Sequential:
    """The same model as the stage pipeq shards: names "0" (w1), "1", "2" (w2), "3"."""
    seq = nn.Sequential(nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 1), nn.Sigmoid())
    seq.load_state_dict({"0.weight": mlp.w1.weight, "0.bias": mlp.w1.bias,
                         "2.weight": mlp.w2.weight, "2.bias": mlp.w2.bias})
    return seq


def tutorial_data(dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, torch.Tensor, nn.Sequential]:
    """The tutorial's inputs, targets and the initial weights of its tensor-parallel section."""
    x, target, _ = dp_mlp.tutorial_data(dtype)  # seed 40, the data, its single-process section's MLP
    MLP()  # its data-parallel section's
    model = as_sequential(MLP())  # "model = MLP(layer_1_in, layer_1_out, layer_2_out)" again
    return x, target, model.to(dtype)


def batches(x: torch.Tensor, target: torch.Tensor, steps: int, size: int = BATCH):
    """(iteration, x, target) of the tutorial's iterations 0..steps-1 whose slice is not empty."""
    for i in range(steps):
        start, end = i * size % len(x), (i + 1) * size % len(x)
        if end > start:  # x[256:0] is empty: that iteration changes nothing (see the docstring)
            yield i, x[start:end], target[start:end]


def reference(model: nn.Module, x: torch.Tensor, target: torch.Tensor, steps: int,
              lr: float = LR) -> tuple[nn.Module, list[float]]:
    """Plain single-process training of a copy of ``model`` on the same batches: the model and the
    loss of every update (before it)."""
    model = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    loss_fn = nn.BCELoss()
    losses = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: more threads only wait for each other
    try:
        for _, xb, yb in batches(x, target, steps):
            opt.zero_grad()
            loss = loss_fn(model(xb), yb)
            loss.backward()
            opt.step()
            losses.append(loss.item())
    finally:
        torch.set_num_threads(threads)
    return model, losses


def train(steps: int = 1001, every: int = 250, dtype: torch.dtype = torch.float64,
          shards: int = SHARDS, schedule: str = "1f1b", start_method: str = "forkserver",
          verbose: bool = True) -> dict:
    """Train with pipeq (one stage on ``shards`` processes) and in one process; returns
    {"iterations", "losses", "ref_losses", "max_loss_diff", "max_param_diff", "parted_at" (the first
    update whose losses differ by more than 1e-4, or None), "seconds", "start_s", "workers",
    "state"} (losses: one per update, the tutorial's iteration numbers in "iterations")."""
    x, target, model = tutorial_data(dtype)
    runner = pipeq.PipelineRunner(
        [model], nn.BCELoss(), functools.partial(torch.optim.SGD, lr=LR),
        schedule=schedule, microbatches=1,  # the whole batch of 64 at once, as the tutorial
        tensor_parallel=shards, tp_plan=[PLAN] if shards > 1 else None, start_method=start_method,
        threads_per_stage=1,
    )
    iterations, losses = [], []
    t_start = time.perf_counter()
    with runner:
        t0 = time.perf_counter()
        workers = [dict(w) for w in runner.stage_processes]
        if verbose:
            print("stage 0 on %d processes: %s" % (len(workers), ", ".join(
                f"shard {w.get('shard')} pid {w.get('pid')}" for w in workers)), flush=True)
        pending = []
        for i, xb, yb in batches(x, target, steps):
            iterations.append(i)
            losses.append(runner.step(xb, yb))
            if i % every == 0:
                pending.append(len(losses) - 1)
        seconds = time.perf_counter() - t0
        state = runner.state_dict()  # full, unsharded tensors under the Sequential's names
    ref, ref_losses = reference(model, x, target, steps)
    diffs = [abs(a - b) for a, b in zip(losses, ref_losses)]
    max_param_diff = max((state[k] - v).abs().max().item() for k, v in ref.state_dict().items())
    parted = next((j for j, d in enumerate(diffs) if d > 1e-4), None)
    name = str(dtype).removeprefix("torch.")
    if verbose:
        print(f"{'iteration':>9s} {'pipeq T=' + str(shards):>12s} {'one process':>12s} {'|diff|':>8s} "
              f"{'tutorial':>8s}")
        for j in pending:
            i = iterations[j]
            tut = f"{TUTORIAL[i]:8.3f}" if i in TUTORIAL else ""
            print(f"{i:9d} {losses[j]:12.6f} {ref_losses[j]:12.6f} {diffs[j]:8.1e} {tut}")
        print(f"{len(losses)} updates of {BATCH} samples ({name}; the tutorial's iterations 0-{steps - 1}, "
              f"its empty slices skipped) on 1 stage x {shards} shards in {seconds:.1f} s "
              f"({t0 - t_start:.1f} s to start the shard processes)")
        print(f"single-process training on the same batches: max |loss difference| {max(diffs):.1e} "
              f"over {len(losses)} updates, max |parameter difference| {max_param_diff:.1e}")
        if parted is not None:
            print(f"the runs parted at iteration {iterations[parted]} (loss {losses[parted]:.4f} against "
                  f"{ref_losses[parted]:.4f}): {name} rounding of the two summation orders (see the docstring)")
    return {"iterations": iterations, "losses": losses, "ref_losses": ref_losses,
            "max_loss_diff": max(diffs), "max_param_diff": max_param_diff, "parted_at": parted, "seconds": seconds,
            "start_s": t0 - t_start, "workers": workers, "state": state}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=1001,
                   help="the tutorial's iterations 0..steps-1 (every fifth is empty and skipped)")
    p.add_argument("--every", type=int, default=250, help="print the losses every N iterations")
    p.add_argument("--shards", type=int, default=SHARDS, help="tensor_parallel (the tutorial: 2; 1: no plan)")
    p.add_argument("--schedule", default="1f1b")
    p.add_argument("--float32", action="store_true", help="the tutorial's precision (default float64)")
    a = p.parse_args(argv)
    if a.steps < 1 or a.every < 1:
        p.error("--steps and --every must be positive")
    return train(a.steps, a.every, dtype=torch.float32 if a.float32 else torch.float64,
                 shards=a.shards, schedule=a.schedule)


if __name__ == "__main__":  # required: the shard processes may re-import this file
    main()
