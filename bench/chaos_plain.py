"""The plain torch side of bench/bench_chaos.py: examples/digits.toml trained in one process, with
a replica's samples left out where a run says it left them out, and the ways a lost replica's step
may have been summed, matched against a run's weights."""

from __future__ import annotations

import copy
import itertools

import torch
from launch_util import DIGITS_JOB
from torch import nn

ATOL = 1e-5  # tests/process/test_data_parallel.py's two-node launch against full-batch training
STAGE_LAYERS = (2, 2, 1)  # examples.digits_job.stages(): the flat model's layers per stage

def digits_job(steps: int):
    from pipeq.launch.job import load_job

    return load_job(DIGITS_JOB, {"steps": steps})


class Plain:
    """examples/digits.toml trained in one process, step by step: its stages' flat model built
    under the job's seed, its optimizer and lr scheduler (stepped every step), its batches in
    order. Each batch is split into ``replicas`` contiguous shards as the runner splits it (larger
    ones first), each shard's loss weighted by its share of the batch; ``dropped[step][stage]``
    names the replicas whose shard that stage's update left out at that step: the stage's
    gradient is then the mean over the other shards' samples."""

    def __init__(self, steps: int, replicas: int = 2) -> None:
        from examples.digits_job import layers

        job = digits_job(steps)
        torch.manual_seed(job.recipe.seed)
        self.model = nn.Sequential(*layers())
        self.opt = job.recipe.optimizer_factory()(self.model.parameters())
        self.sched = job.recipe.scheduler_factory()(self.opt)
        self.loss_fn, self.replicas, self.step = job.recipe.loss_fn(), replicas, 0
        self.data = list(itertools.islice((b for e in itertools.count() for b in job.batches(e)), steps))
        bounds = list(itertools.accumulate((0, *STAGE_LAYERS)))
        self.stage_of = {p: k for k in range(len(STAGE_LAYERS)) for i in range(bounds[k], bounds[k + 1])
                         for p in self.model[i].parameters()}

    def train(self, upto: int, dropped: dict[int, dict[int, set[int]]] | None = None) -> Plain:
        for step in range(self.step + 1, upto + 1):
            x, y = self.data[step - 1]
            shards = list(zip(torch.tensor_split(x, self.replicas), torch.tensor_split(y, self.replicas)))
            grads = []
            for xs, ys in shards:
                self.opt.zero_grad()
                (self.loss_fn(self.model(xs), ys) * (len(ys) / len(y))).backward()
                grads.append({p: p.grad.clone() for p in self.model.parameters()})
            out = (dropped or {}).get(step, {})
            for p in self.model.parameters():
                keep = [r for r in range(self.replicas) if r not in out.get(self.stage_of[p], set())]
                p.grad = sum(grads[r][p] for r in keep) / (sum(len(shards[r][1]) for r in keep) / len(y))
            self.opt.step()
            self.sched.step()
        self.step = max(self.step, upto)
        return self

    def state(self) -> dict:
        return {k: v.clone() for k, v in self.model.state_dict().items()}


def reconstruct(steps: int, dropped: dict[int, dict[int, set[int]]] | None = None) -> dict:
    """The weights of :class:`Plain` after ``steps`` steps."""
    return Plain(steps).train(steps, dropped).state()


def compare(got: dict, want: dict) -> tuple[bool, float, list[str]]:
    """Whether ``got`` equals ``want`` within ATOL; the largest difference; the tensors over it."""
    if sorted(got) != sorted(want):
        return False, float("inf"), sorted(set(got) ^ set(want))
    diffs = {k: float((got[k].double() - want[k].double()).abs().max()) for k in want}
    over = [k for k, d in diffs.items() if d > ATOL]
    return not over, max(diffs.values()), over


def _accountings(d: int, r: int, k: int, n: int):
    """(label, dropped) for each way a loss of replica r's stage k at step d may be summed: step d
    without r at every stage (the guide's), or only at stages 0..j (r's stages after j had sent
    their gradients of step d), and step d - 1 without r at stages 0..j too (they died or were
    stopped before sending theirs: issue 40's defect 2)."""
    def name(j: int) -> str:
        return "every stage" if j == n - 1 else f"stages 0..{j}"

    for before in [-1, *range(k + 1)]:
        for j in [n - 1, *(j for j in range(k, -1, -1) if j != n - 1)]:
            dropped = {d: {s: {r} for s in range(j + 1)}}
            if before >= 0:
                dropped[d - 1] = {s: {r} for s in range(before + 1)}
            label = f"step {d} without replica {r} at {name(j)}" + (f", step {d - 1} at {name(before)}"
                                                                    if before >= 0 else "")
            yield label + (" (the guide's)" if before < 0 and j == n - 1 else ""), dropped


def explain(steps: int, losses: list[int | None], failures: list, mid: dict[int, dict]) -> tuple[list[str], dict | None]:
    """Per loss (replica r's stage k at step d), the accounting of :func:`_accountings` that the
    runner's weights after step d + 1 match, the losses before it taken as they matched; and all
    of them together (None: a loss that none explains)."""
    chosen: dict[int, dict[int, set[int]]] | None = {}
    out = []
    base = Plain(steps)
    for d, err in zip(losses, failures):
        match = None
        if d is None:  # (a loss between two steps: the replica rebuilt before the next one)
            out.append("nothing left out")
            continue
        if chosen is not None:
            base.train(d - 2, chosen)  # the steps no accounting of this loss touches
        for label, extra in _accountings(d, err.replica, err.stage or 0, len(STAGE_LAYERS)):
            if chosen is None or d + 1 not in mid:
                break
            trial = {s: {j: set(v) for j, v in st.items()} for s, st in chosen.items()}
            for s, st in extra.items():
                for j, reps in st.items():
                    trial.setdefault(s, {}).setdefault(j, set()).update(reps)
            if compare(mid[d + 1], copy.deepcopy(base).train(d + 1, trial).state())[0]:
                match, chosen = label, trial
                break
        if match is None:
            chosen = None
        out.append(match or "none of the accountings tried (step d at stages 0..j, step d-1 too)")
    return out, chosen
