"""Module-level (hence picklable) test models and a single-process training reference."""

from __future__ import annotations

import copy
import os
import time

import torch
from torch import nn


def float64_stages3(seed: int = 0) -> list[nn.Module]:
    """Three float64 stages: 6 -> 10 -> 10 -> 4 (ReLU, then Tanh inside the first two)."""
    torch.manual_seed(seed)
    return [
        nn.Sequential(nn.Linear(6, 10), nn.ReLU()).double(),
        nn.Sequential(nn.Linear(10, 10), nn.Tanh()).double(),
        nn.Linear(10, 4).double(),
    ]


def float64_data(batch: int, seed: int = 1, d_in: int = 6, classes: int = 4):
    """(x, class targets) for float64_stages3."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(batch, d_in, generator=g, dtype=torch.float64),
            torch.randint(0, classes, (batch,), generator=g))


def mlp_stages(widths=(8, 16, 16, 3), seed: int = 0) -> list[nn.Module]:
    """Linear(+ReLU) stages: widths[k] -> widths[k+1]; no ReLU after the last."""
    torch.manual_seed(seed)
    stages: list[nn.Module] = []
    for k in range(len(widths) - 1):
        lin = nn.Linear(widths[k], widths[k + 1])
        stages.append(nn.Sequential(lin, nn.ReLU()) if k < len(widths) - 2 else lin)
    return stages


class Chain(nn.Sequential):
    """nn.Sequential with pipeq's boundary rule: a tuple output becomes the next stage's *args."""

    def forward(self, x):
        for m in self:
            x = m(*x) if isinstance(x, tuple) else m(x)
        return x


def flat_state(stages) -> dict[str, torch.Tensor]:
    """The state of ``stages`` (a list, or a Chain of them) under pipeq's names: those of
    ``runner.state_dict()`` and checkpoints, the flat model ``nn.Sequential(*layers)``'s."""
    from pipeq.checkpoint import flat_model

    return flat_model(stages).state_dict()


def reference_train(stages, loss_fn, make_opt, batches, clip=None, bf16=False, tie=None, *, norm_type=2.0,
                    autocast=None, scaler=None, model=None, opt=None, after_step=None, loss_of=None, device=None):
    """Plain single-process training, as a user writes it: the one reference every equality test
    holds pipeq to. The stages are chained (:class:`Chain`, a copy: ``stages`` are left as they
    are) and trained on full batches, one optimizer step per batch. Returns ``(model, losses)``.

    ``clip``: clip by the global norm (``norm_type``), as ``torch.nn.utils.clip_grad_norm_``;
    ``bf16`` (or ``autocast``, a dtype): the forward and the loss under CPU autocast; ``scaler``: a
    ``torch.amp.GradScaler``-like loss scaler (unscaled before clipping); ``tie(model)``: makes the
    chained copy's tied parameters one tensor first; ``model`` and ``opt``: go on training those
    instead of a fresh copy and optimizer; ``after_step(model)``: called after each step;
    ``loss_of(model, batch)``: a batch's loss, for batches that are not ``(x, target)`` pairs
    (stage inputs, keyword inputs); default ``loss_fn(model(x), target)``; ``device``: the model
    and each ``(x, target)`` batch moved there (autocast of that device's type)."""
    if model is None:
        model = Chain(*copy.deepcopy(stages))
        if tie is not None:
            tie(model)
    if device is not None:
        model = model.to(device)
    if opt is None:
        opt = make_opt(model.parameters())
    dtype = autocast or (torch.bfloat16 if bf16 else None)
    losses = []
    kind = torch.device(device).type if device is not None else "cpu"
    for batch in batches:
        if device is not None:
            batch = tuple(t.to(device) for t in batch)
        opt.zero_grad()
        with torch.autocast(kind, dtype=dtype or torch.bfloat16, enabled=dtype is not None):
            loss = loss_of(model, batch) if loss_of is not None else loss_fn(model(batch[0]), batch[1])
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
        else:
            loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip, norm_type=norm_type)
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        losses.append(loss.item())
        if after_step is not None:
            after_step(model)
    return model, losses


class Raises(nn.Module):
    def __init__(self, width: int, after_calls: int = 0):
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.after_calls = after_calls
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        if self.calls > self.after_calls:
            raise ValueError("boom from the stage")
        return self.lin(x)


class Exits(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, x):
        os._exit(7)


class Sleeps(nn.Module):
    """Sleeps forever in forward: a stage that hangs."""

    def __init__(self, width: int):
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, x):
        time.sleep(3600)
        return self.lin(x)


class StallsOnce(nn.Module):
    """Sleeps ``seconds`` in its ``call``-th forward (microbatch call-1 of the first step): a
    stage alive and heartbeating, but stuck in its own computation."""

    def __init__(self, width: int, call: int = 2, seconds: float = 60.0):
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.call, self.seconds, self.calls = call, seconds, 0

    def forward(self, x):
        self.calls += 1
        if self.calls == self.call:
            time.sleep(self.seconds)
        return self.lin(x)


class TwoOut(nn.Module):
    """Returns a tuple: (hidden activation, an integer tensor that rides along)."""

    def __init__(self, a: int, b: int, flag_first: bool = False):
        super().__init__()
        self.lin = nn.Linear(a, b)
        self.flag_first = flag_first

    def forward(self, x):
        h = torch.relu(self.lin(x))
        flag = (x[:, 0] > 0).long()
        return (flag, h) if self.flag_first else (h, flag)


class TwoIn(nn.Module):
    def __init__(self, b: int, c: int, flag_first: bool = False):
        super().__init__()
        self.lin = nn.Linear(b, c)
        self.flag_first = flag_first

    def forward(self, a, b):
        flag, h = (a, b) if self.flag_first else (b, a)
        return self.lin(h) + flag.unsqueeze(1).float()


class FailingStepSGD(torch.optim.SGD):
    """SGD whose step fails on the stage that owns a (5, 8) weight (stage 0 in the tests)."""

    def step(self, closure=None):
        if any(p.shape == (5, 8) for g in self.param_groups for p in g["params"]):
            raise RuntimeError("optimizer step failed on purpose")
        return super().step(closure)


class Widen(nn.Module):
    """Repeats its input's features ``times`` times (a large activation from a small stage)."""

    def __init__(self, times: int) -> None:
        super().__init__()
        self.times = times

    def forward(self, x):
        return x.repeat(1, self.times)


class Narrow(nn.Linear):
    """A Linear over its input's first ``in_features`` features only."""

    def forward(self, x):
        return super().forward(x[:, :self.in_features])


class RefusesLoad(nn.Linear):
    """A Linear whose ``load_state_dict`` fails (this stage only)."""

    def _load_from_state_dict(self, *args, **kwargs):
        raise RuntimeError("RefusesLoad: this stage cannot load state")


def reverse_drain(n_stages, n_microbatches):
    """A user schedule: every forward, then the backwards in reverse order, then the step."""
    from pipeq.schedules import B, F, STEP

    m = n_microbatches
    return [[F(j) for j in range(m)] + [B(j) for j in reversed(range(m))] + [STEP]
            for _ in range(n_stages)]


def eager_backward(n_stages, n_microbatches):
    """A broken user schedule: stage 0 waits for gradient 0 before sending activation 1,
    while the last stage runs both forwards before its first backward."""
    from pipeq.schedules import B, F, STEP

    m = n_microbatches
    first = [F(0), B(0)] + [a for j in range(1, m) for a in (F(j), B(j))] + [STEP]
    rest = [F(j) for j in range(m)] + [B(j) for j in range(m)] + [STEP]
    return [first] + [list(rest) for _ in range(n_stages - 1)]


class Mul(nn.Module):
    """A scalar "multiply" net: x * w with a 1-element parameter (interlocking hand checks)."""

    def __init__(self, w: float):
        super().__init__()
        self.w = nn.Parameter(torch.tensor([float(w)]))

    def forward(self, x):
        return x * self.w


class SumSq:
    """Sum (or mean) of squared errors, with the ``reduction`` attribute pipeq reads."""

    def __init__(self, reduction: str = "sum"):
        self.reduction = reduction

    def __call__(self, out, y):
        sq = (out - y) ** 2
        return sq.sum() if self.reduction == "sum" else sq.mean()


class TutorialStage0(nn.Module):
    """The tutorial's 16-8-1 MLP, first half: Linear(16, 8) + ReLU."""

    def __init__(self):
        super().__init__()
        self.w1 = nn.Linear(16, 8)

    def forward(self, x):
        return torch.relu(self.w1(x))


class TutorialStage1(nn.Module):
    """Second half: Linear(8, 1) + sigmoid (BCE loss)."""

    def __init__(self):
        super().__init__()
        self.w2 = nn.Linear(8, 1)

    def forward(self, x):
        return torch.sigmoid(self.w2(x))


class UpDown(nn.Module):
    """``down(relu(up(x)))`` with named children (not an nn.Sequential: one layer of the flat
    model, so its state is ``"{k}.up.weight"``...): tensor-parallel plans name ``"up"``, ``"down"``."""

    def __init__(self, d_in: int, hidden: int, d_out: int):
        super().__init__()
        self.up = nn.Linear(d_in, hidden)
        self.down = nn.Linear(hidden, d_out)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


class ShardedLinear(nn.Linear):
    """An nn.Linear that, in a process of a tensor-parallel run (torch.distributed initialized),
    checks in every forward that its weight really is a DTensor split along ``dim`` (0: "colwise",
    1: "rowwise"), each process holding a part; elsewhere (a reference in the test process) it is
    a plain nn.Linear. Its state has nn.Linear's names."""

    def __init__(self, d_in: int, d_out: int, dim: int):
        super().__init__(d_in, d_out)
        self.dim = dim

    def forward(self, x):
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            from torch.distributed.tensor import DTensor, Shard

            w = self.weight
            if not (isinstance(w, DTensor) and Shard(self.dim) in w.placements
                    and w.to_local().shape[self.dim] < w.shape[self.dim]):
                raise RuntimeError(f"weight not split along dim {self.dim}: {type(w).__name__} "
                                   f"{getattr(w, 'placements', None)} {tuple(w.shape)}")
        return super().forward(x)


def tp_stages(seed: int = 0, d: int = 8, hidden: int = 16, classes: int = 4, probe: bool = False) -> list[nn.Module]:
    """Two stages for tensor parallelism: an MLP block (d -> hidden -> d), then an MLP block and a
    classifier (d -> hidden -> d -> classes). With ``TP_PLAN`` every Linear is sharded; every
    size divides by 4. ``probe``: ShardedLinear layers, which fail unless TP_PLAN split them."""
    torch.manual_seed(seed)
    if probe:
        def col(a, b):
            return ShardedLinear(a, b, 0)

        def row(a, b):
            return ShardedLinear(a, b, 1)
    else:
        col = row = nn.Linear
    return [
        nn.Sequential(col(d, hidden), nn.ReLU(), row(hidden, d)),
        nn.Sequential(col(d, hidden), nn.ReLU(), row(hidden, d), nn.Tanh(), col(d, classes)),
    ]


#: tp_stages' plan: colwise + rowwise pairs, and stage 1's classifier colwise (its output gathered).
TP_PLAN = [{"0": "colwise", "2": "rowwise"}, {"0": "colwise", "2": "rowwise", "4": "colwise"}]


class RaisesOnShard(nn.Linear):
    """An nn.Linear (to be split by a plan) whose forward raises on shard ``shard`` of its stage
    (every shard when None): the shard is its place in the weight's device mesh. Unsplit (no
    DTensor weight) it never raises."""

    def __init__(self, d_in: int, d_out: int, shard: int | None):
        super().__init__(d_in, d_out)
        self.shard = shard

    def forward(self, x):
        from torch.distributed.tensor import DTensor

        w = self.weight
        if isinstance(w, DTensor):
            mine = w.device_mesh.get_local_rank()
            if self.shard is None or mine == self.shard:
                raise ValueError(f"boom from shard {mine}")
        return super().forward(x)


def split_by_hand(module, mesh):
    """A callable tensor-parallel plan, ``(stage_module, mesh) -> module``: what TP_PLAN[1] says,
    written with torch's own styles (the classifier's output gathered)."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    return parallelize_module(module, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel(),
                                             "4": ColwiseParallel(output_layouts=Replicate())})


def stages64(n: int, seed: int = 0) -> list[nn.Module]:
    """``n`` float64 stages 6 -> 10 -> ... -> 4 (Tanh between)."""
    torch.manual_seed(seed)
    widths = [6] + [10] * (n - 1) + [4]
    return [nn.Sequential(nn.Linear(widths[k], widths[k + 1]), nn.Tanh()).double() if k < n - 1
            else nn.Linear(widths[k], widths[k + 1]).double() for k in range(n)]


def batches64(n_steps: int, batch: int = 10, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, 6, generator=g, dtype=torch.float64), torch.randint(0, 4, (batch,), generator=g))
            for _ in range(n_steps)]



class _SlowBackward(torch.autograd.Function):
    """The identity, whose backward sleeps ``seconds`` first."""

    @staticmethod
    def forward(ctx, y, seconds):
        ctx.seconds = seconds
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad):
        if ctx.seconds > 0:
            time.sleep(ctx.seconds)
        return grad, None


class SlowBackwardAt(nn.Module):
    """``inner``, except that the backward of a microbatch whose input holds the value ``marker``
    sleeps ``seconds`` first (when it reaches ``inner``'s output): it slows one replica's stage at
    one step, picked by the data (``armed=False``: never; the same numbers either way)."""

    def __init__(self, inner: nn.Module, marker: float, seconds: float, armed: bool = True) -> None:
        super().__init__()
        self.inner = inner
        self.marker, self.seconds, self.armed = marker, seconds, armed

    def forward(self, x):
        slow = self.armed and bool((x == self.marker).any())
        return _SlowBackward.apply(self.inner(x), self.seconds if slow else 0.0)


class CarryFirst(nn.Module):
    """``inner``, whose output carries its input's first feature as one more column: a marker in
    the data reaches the next stage (see :class:`DropLast`)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return torch.cat([self.inner(x), x[:, :1]], dim=1)


class DropLast(nn.Module):
    """``inner`` of its input without the column :class:`CarryFirst` added."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x[:, :-1])


class _RaiseBackward(torch.autograd.Function):
    """The identity, whose backward sleeps ``seconds``, then raises (when ``armed``)."""

    @staticmethod
    def forward(ctx, y, seconds, armed):
        ctx.seconds, ctx.armed = seconds, armed
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad):
        if ctx.armed:
            time.sleep(ctx.seconds)
            raise RuntimeError("injected: a backward failed late in the step")
        return grad, None, None


class RaiseBackwardAt(nn.Module):
    """``inner``, except that the backward of a microbatch whose input holds the value ``marker``
    sleeps ``seconds``, then raises (``armed=False``: never; the same numbers otherwise)."""

    def __init__(self, inner: nn.Module, marker: float, seconds: float, armed: bool = True) -> None:
        super().__init__()
        self.inner = inner
        self.marker, self.seconds, self.armed = marker, seconds, armed

    def forward(self, x):
        armed = self.armed and bool((x == self.marker).any())
        return _RaiseBackward.apply(self.inner(x), self.seconds, armed)
