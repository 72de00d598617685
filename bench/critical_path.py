"""The critical path of one step, slot by slot, on the F/I/W sleep-stage harness (issue 41).

    PYTHONPATH=$PWD python bench/bench_action_overhead.py --critical-path                 # 1f1b zb-h1 zbv dualpipev
    PYTHONPATH=$PWD python bench/bench_action_overhead.py --critical-path --schedule zbv --slots
    PYTHONPATH=$PWD python bench/bench_action_overhead.py --critical-path --processes 2 --spin 0

The harness: 4 stage processes (``--processes``), 8 microbatches of 8 x 16, every process's forward (F), input
gradient (I) and weight gradient (W) sleeping 4 ms (a process of two chunks: 2 ms per chunk; a
whole backward sleeps I + W; stage 0 has no input gradient) - the stages of issue 41 and of
``bench_schedules.py``. The run is traced (``PipelineRunner(trace=...)``), and every stage also
records its own sleeps (:class:`TimedSleepStage`: the stage's compute, inside each action's
span), so that :func:`pipeq.trace.critical.critical_path` can split each critical-path slot
into compute, the sleep's overshoot (``late``), the executor's and the autograd engine's entry and
exit (``autograd``), the interpreter's gaps, the send, the wait for an already-sent message, the
wake-up, the receive, and the codec (the encoding and decoding CPU time of the message's size,
measured in this process: an estimate moved out of ``send`` and ``wake``/``recv``). Everything is
read on the one host's monotonic clock. Times are wall microseconds (median per slot).
"""

from __future__ import annotations

import bisect
import functools
import json
import math
import os
import tempfile
import time
from typing import Any

import torch
from torch import nn

import pipeq.testing

__all__ = ["TimedSleepStage", "run_traced", "codec_cost", "analyse", "SCHEDULES"]

N, M, ROWS, WIDTH = 4, 8, 8, 16
COST_S = 0.004  # F, I and W per process
SCHEDULES = ("1f1b", "zb-h1", "zbv", "dualpipev")


def _logged_sleep(seconds: float, log: list[tuple[int, int, int]]) -> None:
    """``pipeq.testing.sleep(seconds)`` (a SleepStage's: precise, a zero one skipped), logged."""
    if seconds > 0:
        t0 = time.perf_counter_ns()
        pipeq.testing.sleep(seconds)
        log.append((t0, time.perf_counter_ns(), int(seconds * 1e9)))


class _TimedSleep(torch.autograd.Function):
    """``pipeq.testing``'s sleeping identity, each sleep logged as (start ns, end ns, nominal ns)."""

    @staticmethod
    def forward(ctx, x, forward_s, backward_s, log):  # type: ignore[override]
        ctx.backward_s, ctx.log = backward_s, log
        _logged_sleep(forward_s, log)
        return x.clone()

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        _logged_sleep(ctx.backward_s, ctx.log)
        return g, None, None, None


class TimedSleepStage(nn.Module):
    """``pipeq.testing.SleepStage(width, forward_s, input_s, weight_s=weight_s)`` whose sleeps are
    logged in its process and written to ``path`` (JSON) at its ``dump_at``-th forward."""

    def __init__(self, width: int, forward_s: float, input_s: float, weight_s: float, path: str,
                 dump_at: int) -> None:
        super().__init__()
        self.bias = nn.Parameter(torch.zeros(width))
        self.forward_s, self.input_s, self.weight_s = forward_s, input_s, weight_s
        self.path, self.dump_at, self.calls = path, dump_at, 0
        self.log: list[tuple[int, int, int]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == self.dump_at:
            with open(self.path, "w") as f:
                json.dump(self.log, f)
        return (_TimedSleep.apply(x, self.forward_s, self.input_s, self.log)
                + _TimedSleep.apply(self.bias, 0.0, self.weight_s, self.log))


def layout(schedule: str) -> int:
    from pipeq import schedules

    return schedules.resolve(schedule).stages_per_process


def run_traced(schedule: str, warmup: int, steps: int, out_dir: str, n: int = N, m: int = M,
               cost_s: float = COST_S, spin: float | None = None) -> list[float]:
    """``warmup + steps + 1`` traced steps of ``schedule`` on the harness (the last one only to
    write the stages' logs), the trace at ``out_dir/trace.json``, stage k's sleeps at
    ``out_dir/stage{k}.json``; the step times (s) of the timed steps."""
    from pipeq import PipelineRunner

    v = layout(schedule)
    s = cost_s / v
    stages: list[nn.Module] = [TimedSleepStage(WIDTH, s, s, s, os.path.join(out_dir, f"stage{k}.json"),
                                               (warmup + steps) * m + 1) for k in range(n * v)]
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(m * ROWS, WIDTH, generator=g), torch.randn(m * ROWS, WIDTH, generator=g)
    kw: dict[str, Any] = {"stages_per_process": v} if v > 1 else {}
    if spin is not None:
        kw["spin"] = spin
    times = []
    with PipelineRunner(stages, nn.MSELoss(), functools.partial(torch.optim.SGD, lr=0.01), schedule=schedule,
                        microbatches=m, threads_per_stage=1, trace=os.path.join(out_dir, "trace.json"), **kw) as r:
        for _ in range(warmup + steps + 1):
            t0 = time.perf_counter()
            r.step(x, y)
            times.append(time.perf_counter() - t0)
    return times[warmup:warmup + steps]


def cpu_us(fn: Any, n: int = 2000) -> float:
    """``fn``'s CPU time (this thread's), microseconds per call: the best of 5 rounds of ``n``."""
    for _ in range(200):
        fn()
    best = math.inf
    for _ in range(5):
        t0 = time.thread_time()
        for _ in range(n):
            fn()
        best = min(best, (time.thread_time() - t0) / n * 1e6)
    return best


@functools.lru_cache(maxsize=None)
def codec_cost(nbytes: int) -> tuple[float, float]:
    """The CPU us of encoding and of decoding one float32 activation message of ``nbytes`` bytes
    (pipeq.wire's codec, in this process); (0, 0) if the codec's interface changed."""
    try:
        from pipeq.wire import codec
        from pipeq.wire.frames import decode_aligned
        from pipeq.wire.messages import Kind

        x = torch.randn(max(1, nbytes // 4))
        frames = [memoryview(bytes(f)) for f in codec.encode(Kind.ACTIVATION, 1, 2, [x])]
        return (cpu_us(lambda: codec.encode(Kind.ACTIVATION, 1, 2, [x])),
                cpu_us(lambda: decode_aligned(frames)))
    except Exception:  # a changed codec: no estimate
        return (0.0, 0.0)


def inner_spans(out_dir: str, n_stages: int, origin_ns: float) -> dict[int, list[tuple[float, float, float]]]:
    """Each stage's logged sleeps on the trace's host-clock axis (us from the file's origin)."""
    spans: dict[int, list[tuple[float, float, float]]] = {}
    for k in range(n_stages):
        try:
            with open(os.path.join(out_dir, f"stage{k}.json")) as f:
                log = json.load(f)
        except OSError:
            continue
        spans[k] = sorted(((a - origin_ns) / 1e3, (b - origin_ns) / 1e3, nom / 1e3) for a, b, nom in log)
    return spans


class InnerIndex(dict):
    """``(stage, step, microbatch, op) -> spans`` looked up by time: the spans inside the action."""

    def __init__(self, spans: dict[int, list[tuple[float, float, float]]]) -> None:
        super().__init__()
        self.spans = spans
        self.starts = {k: [s[0] for s in v] for k, v in spans.items()}

    def within(self, stage: int, t0: float, t1: float) -> list[tuple[float, float, float]]:
        starts = self.starts.get(stage)
        if starts is None:
            return []
        i = bisect.bisect_left(starts, t0)
        out = []
        while i < len(starts) and starts[i] < t1:
            out.append(self.spans[stage][i])
            i += 1
        return out


def analyse(schedule: str, warmup: int, steps: int, codec: bool = True, n: int = N,
            spin: float | None = None) -> tuple[Any, list[float]]:
    """Run the harness traced on ``n`` processes and return (the critical path of the timed
    steps, step times)."""
    from pipeq.trace import load_trace
    from pipeq.trace.critical import critical_path

    out_dir = tempfile.mkdtemp(prefix="pipeq-cpath-")
    times = run_traced(schedule, warmup, steps, out_dir, n=n, spin=spin)
    trace = load_trace(os.path.join(out_dir, "trace.json"))
    origin = trace.meta.get("clock_origin_ns")
    inner = InnerIndex(inner_spans(out_dir, trace.n_stages, origin)) if origin is not None else None
    first = min(e.step for e in trace.events)
    cp = critical_path(trace, inner=inner, codec=codec_cost if codec else None,
                       steps=range(first + warmup, first + warmup + steps))
    return cp, times
