#!/usr/bin/env python
"""Every built-in schedule's measured activation memory per stage and its step time, on a GPT-style model.

    PYTHONPATH=$PWD python bench/bench_memory.py                 # CPU, process mode, N = 4 processes (~3 min)
    PYTHONPATH=$PWD python bench/bench_memory.py --quick         # a smaller model, fewer steps
    PYTHONPATH=$PWD python bench/bench_memory.py --device cuda   # the same on the host's GPUs
    PYTHONPATH=$PWD python bench/bench_memory.py --json runs/memory.json --only 1f1b --only v-half

The model is examples/gpt.py's GPT (byte vocabulary, learned positions, pre-norm blocks of causal
attention and a 4x GELU MLP, a final LayerNorm and an LM head, untied here so that any cut
works), ``--layers`` blocks (2N: one per stage of a V) of ``--d-model`` features, ``--context`` tokens, a batch of
``--batch`` sequences in ``--microbatches`` microbatches, AdamW, float32. It is cut by blocks into
as many stages as each schedule plans on ``--processes`` processes: N stages for fill-drain, 1F1B,
ZB-H1 and ZB-H2, 2N (two per process) for interleaved 1F1B, looped BFS, ZBV, DualPipeV, V-Half and
V-Min; stage 0 also holds the embeddings, the last stage the final norm and head. Each schedule
runs in a fresh ``PipelineRunner`` (forkserver, one thread per stage process on CPU): ``--warmup``
steps (the first is the one measured), then ``--steps`` timed ones, whose median is the step time.

Per schedule, from ``runner.memory()`` (:mod:`pipeq.stage.memory`: saved-tensor hooks, CPU and CUDA
alike): each stage's measured activation peak, the busiest process's (a V process holds two
stages) and the plan's prediction for it, that peak against 1F1B's and ZBV's, and, for a split
backward, what a microbatch holds waiting for its ``W`` against what it holds after its ``F``
("W/F": the ``I`` frees what the ``W`` will not read, and the ``W`` keeps each Linear's input and
output gradient). Then data parallelism:
1F1B with ``data_parallel=2``, each replica's parameter + gradient + optimizer bytes (summed over
its stages) beside ``data_parallel=1``'s, and ``sharding="fsdp"``'s when the runner takes that
keyword (a note when it refuses it). ``--json PATH`` also writes every figure.
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import os
import statistics
import sys
import time
from typing import Any

import torch
from torch import nn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # examples.gpt, importable in the stage processes too (PYTHONPATH)
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)

import pipeq  # noqa: E402
from pipeq import schedules  # noqa: E402
from pipeq.control.reports import size  # noqa: E402
from examples.gpt import GPT, GPTConfig, lm_loss  # noqa: E402

#: the built-in synchronous schedules, each once (an alias such as gpipe or zb1p runs what it names)
SCHEDULES = ["fill-drain", "1f1b", "zb-h1", "zb-h2", "interleaved-1f1b", "looped-bfs", "zbv", "dualpipev",
             "v-half", "v-min"]


def cut(model: GPT, n: int) -> list[nn.Module]:
    """``model`` cut by blocks into ``n`` stages (GPT's forward skips the modules a stage lacks)."""
    blocks = list(model.blocks)
    if len(blocks) < n:
        raise ValueError(f"{len(blocks)} blocks cannot make {n} stages: raise --layers")
    out = []
    for k in range(n):
        s = copy.deepcopy(model)
        s.blocks = nn.ModuleList(copy.deepcopy(blocks[k * len(blocks) // n:(k + 1) * len(blocks) // n]))
        if k > 0:
            s.tok_emb = s.pos_emb = None
        if k < n - 1:
            s.norm = s.lm_head = None
        out.append(s)
    return out


def make_model(a: argparse.Namespace) -> GPT:
    torch.manual_seed(0)
    model = GPT(GPTConfig(context=a.context, d_model=a.d_model, n_layers=a.layers, n_heads=a.heads))
    model.lm_head.weight = nn.Parameter(model.tok_emb.weight.detach().clone())  # untied: any cut works
    return model


def batch(a: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 256, (a.batch, a.context + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def run(a: argparse.Namespace, schedule: str, mode: str | None = None, **settings: Any) -> dict[str, Any]:
    """One fresh runner of ``schedule`` (in ``mode``, default ``--mode``): its step times and
    ``runner.memory()`` rows."""
    v = schedules.resolve(schedule).stages_per_process
    n = a.processes * v
    stages = cut(make_model(a), n)
    devices = ["cpu"] * n if a.device == "cpu" else None  # CUDA: cuda:k round-robin
    extra = {"threads_per_stage": 1} if a.device == "cpu" else {}
    runner = pipeq.PipelineRunner(stages, lm_loss, functools.partial(torch.optim.AdamW, lr=1e-3), schedule=schedule,
                                  microbatches=a.microbatches, mode=mode or a.mode, devices=devices,
                                  start_method="forkserver", **extra, **settings)
    x, y = batch(a)
    times = []
    with runner:
        for i in range(a.warmup + a.steps):
            t0 = time.perf_counter()
            loss = runner.step(x, y)
            if i >= a.warmup:
                times.append(time.perf_counter() - t0)
        rows = runner.memory()  # the first step's (measured); the timed ones ran without hooks
    return {"schedule": schedule, "stages": n, "processes": a.processes, "step_ms": 1e3 * statistics.median(times),
            "loss": loss, "rows": [r.as_dict() for r in rows]}


def busiest(rows: list[dict[str, Any]], key: str) -> int:
    return max(r[key] for r in rows if r["replica"] == 0)


def schedules_table(results: list[dict[str, Any]]) -> str:
    peaks = {r["schedule"]: busiest(r["rows"], "process_activation_peak_bytes") for r in results}
    head = ["schedule", "stages", "step ms", "busiest process", "predicted", "vs 1F1B", "vs ZBV", "W/F",
            "per stage (stage 0 first)"]
    body = []
    for r in results:
        peak = peaks[r["schedule"]]
        body.append([r["schedule"], str(r["stages"]), f"{r['step_ms']:.0f}", size(peak),
                     size(busiest(r["rows"], "predicted_process_activation_bytes")),
                     f"{peak / peaks['1f1b']:.2f}x" if "1f1b" in peaks else "-",
                     f"{peak / peaks['zbv']:.2f}x" if "zbv" in peaks else "-", waiting_share(r["rows"]),
                     " ".join(size(x["activation_peak_bytes"]).replace(" ", "") for x in r["rows"])])
    return _table(head, body)


def waiting_share(rows: list[dict[str, Any]]) -> str:
    """A split backward's microbatch waiting for its ``W`` against one after its ``F`` (the
    median over the stages after the first, whose ``W`` is its whole backward), "-" without."""
    shares = [x["activation_bytes_waiting_w"] / x["activation_bytes_per_microbatch"] for x in rows
              if x["stage"] > 0 and x["activation_bytes_waiting_w"] and x["activation_bytes_per_microbatch"]]
    return f"{statistics.median(shares):.2f}" if shares else "-"


def replicas_table(results: list[dict[str, Any]]) -> str:
    head = ["run", "replica", "params", "grads", "optimizer", "params+grads+optimizer", "vs data_parallel=1"]
    base = None
    body = []
    for r in results:
        for rep in sorted({x["replica"] for x in r["rows"]}):
            mine = [x for x in r["rows"] if x["replica"] == rep]
            p, g, o = (sum(x[k] for x in mine) for k in ("param_bytes", "grad_bytes", "optimizer_bytes"))
            base = base or p + g + o
            body.append([r["label"], str(rep), size(p), size(g), size(o), size(p + g + o), f"{(p + g + o) / base:.2f}x"])
    return _table(head, body)


def _table(head: list[str], body: list[list[str]]) -> str:
    widths = [max(len(row[i]) for row in [head, *body]) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in [head, *body]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def data_parallel(a: argparse.Namespace) -> tuple[list[dict[str, Any]], str | None]:
    """1F1B replicated (data_parallel 1 and 2), and sharded with FSDP2 where the runner has it
    (process mode: replicas are processes)."""
    out = []
    for label, settings in (("data_parallel=1", {}), ("data_parallel=2", {"data_parallel": 2})):
        r = run(a, "1f1b", "process", **settings)
        out.append({**r, "label": label})
    try:
        r = run(a, "1f1b", "process", data_parallel=2, sharding="fsdp")
    except (TypeError, ValueError) as exc:
        if "sharding" not in str(exc):
            raise
        return out, f"sharding=\"fsdp\" skipped: the runner refuses it ({str(exc).splitlines()[0][:120]})"
    out.append({**r, "label": "data_parallel=2, fsdp"})
    return out, None


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="d_model 64, 4 layers, context 64, batch 8, 1 + 2 steps")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--mode", choices=["process", "simulated"], default="process")
    p.add_argument("--processes", type=int, default=4, help="pipeline processes N (default 4)")
    p.add_argument("--layers", type=int, default=None, help="GPT blocks (default 2N: one per stage of a V)")
    p.add_argument("--d-model", type=int, default=None, help="default 128 (--quick: 64)")
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--context", type=int, default=None, help="tokens per sequence (default 128; --quick: 64)")
    p.add_argument("--batch", type=int, default=None, help="sequences per step (default 16; --quick: 8)")
    p.add_argument("--microbatches", type=int, default=None, help="default 8 (--quick: 4)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps first, the first measured (default 2)")
    p.add_argument("--steps", type=int, default=None, help="timed steps per schedule (default 5; --quick: 2)")
    p.add_argument("--only", action="append", choices=SCHEDULES, help="these schedules only (repeatable)")
    p.add_argument("--no-replicas", action="store_true", help="skip the data-parallel runs")
    p.add_argument("--json", metavar="PATH", help="also write every figure as JSON")
    a = p.parse_args(argv)
    q = a.quick
    a.layers = a.layers or 2 * a.processes
    a.d_model = a.d_model or (64 if q else 128)
    a.context = a.context or (64 if q else 128)
    a.batch = a.batch or (8 if q else 16)
    a.microbatches = a.microbatches or (4 if q else 8)
    a.warmup = a.warmup or (1 if q else 2)
    a.steps = a.steps or (2 if q else 5)
    if a.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: this host has no CUDA device")
    names = a.only or SCHEDULES
    print(f"GPT d_model {a.d_model}, {a.layers} blocks, {a.heads} heads, context {a.context}; batch {a.batch} in "
          f"{a.microbatches} microbatches; AdamW, float32; {a.processes} processes, {a.mode} mode, {a.device}; "
          f"{a.warmup} warm-up (the first measured) + {a.steps} timed steps", flush=True)
    results = []
    for name in names:
        results.append(run(a, name))
        r = results[-1]
        print(f"  {name}: {r['step_ms']:.0f} ms/step, busiest process "
              f"{size(busiest(r['rows'], 'process_activation_peak_bytes'))}", flush=True)
    print("\nactivations (measured over the first step; a V process holds two stages):")
    print(schedules_table(results))
    out: dict[str, Any] = {"torch": torch.__version__, "config": {k: v for k, v in vars(a).items() if k != "json"},
                           "schedules": results}
    if not a.no_replicas:
        reps, note = data_parallel(a)
        print("\nper replica, 1F1B:")
        print(replicas_table(reps))
        if note:
            print(note)
        out["replicas"], out["fsdp_note"] = reps, note
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
        print(f"\njson: {a.json}")
    return out


if __name__ == "__main__":
    main()
