"""pipeq.runtime.interpreter.execute driven by hand: each stage process's generator (one stage each) is advanced
by a small loop that plays the transport (a dict mailbox), so what is tested is the interpreter and the executor alone,
with no engine, process or socket in between."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from torch import nn

from pipeq import schedules
from pipeq.trace import format as trace
from pipeq.control.batching import split_sizes
from pipeq.runtime.executors import make_executor
from pipeq.stage.spec import StageSpec
from pipeq.runtime.interpreter import execute
from pipeq.runtime.requests import Emit, Recv, Send
from pipeq.schedules import Op
from pipeq.stage.loss import microbatch_weights

from models import float64_data, float64_stages3, reference_train

pytestmark = pytest.mark.timeout(60)

SGD = functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9)
CPU = torch.device("cpu")
TOL = dict(atol=1e-12, rtol=0)


def executors(stages, schedule="1f1b", loss_fn=None):
    n = len(stages)
    loss_fn = loss_fn or nn.CrossEntropyLoss()
    return [make_executor(schedule, k, n, StageSpec(copy.deepcopy(m), SGD, loss_fn if k == n - 1 else None), CPU)
            for k, m in enumerate(stages)]


def drive(exs, plan, *, traces=None, log=None):
    """Advance one generator per stage until all are done, carrying messages through a mailbox.

    Returns {microbatch: tensors} of the EMIT requests and, per stage, the requests it yielded."""
    n = len(exs)
    gens = [execute([ex], plan[k], [traces[k]] if traces else None) for k, ex in enumerate(exs)]
    mailbox: dict[tuple[int, str, int], tuple] = {}
    requests: list[list[tuple]] = [[] for _ in range(n)]
    emitted: dict[int, tuple] = {}
    waiting: list[tuple | None] = [None] * n
    value: list = [None] * n
    done = [False] * n
    while not all(done):
        moved = False
        for k in range(n):
            while not done[k]:
                if waiting[k] is not None:
                    op, j = waiting[k].op, waiting[k].microbatch
                    key = (k, "act" if op is Op.RECV_ACT else "grad", j)
                    if key not in mailbox:
                        break
                    value[k], waiting[k] = mailbox.pop(key), None
                try:
                    req = gens[k].send(value[k])
                except StopIteration:
                    done[k] = moved = True
                    break
                moved, value[k] = True, None
                requests[k].append(req)
                assert req.chunk == 0  # one stage per process
                if log is not None:
                    log[k].append(f"{req.op.value}{req.microbatch}" if type(req) is not Emit else f"emit{req.microbatch}")
                if type(req) is Recv:
                    waiting[k] = req
                elif type(req) is Send and req.op is Op.SEND_ACT:
                    mailbox[(k + 1, "act", req.microbatch)] = tuple(t.clone() for t in req.tensors)
                elif type(req) is Send:
                    mailbox[(k - 1, "grad", req.microbatch)] = tuple(t.clone() for t in req.tensors)
                else:
                    assert type(req) is Emit
                    emitted[req.microbatch] = req.tensors
        assert moved, f"hand-driven pipeline stalled: {waiting}"
    assert not mailbox, f"messages never received: {list(mailbox)}"
    return emitted, requests


def train_step(exs, step, x, y, m, schedule="1f1b", **kw):
    sizes = split_sizes(x.shape[0], m)
    weights = microbatch_weights(exs[-1].loss_fn, y, sizes)
    for k, ex in enumerate(exs):
        ex.begin(step, sizes, True, x if k == 0 else None, y if ex.needs_target else None, weights)
    plan = schedules.build(schedule, len(exs), len(sizes), training=True)
    out = drive(exs, plan, **kw)
    return exs[-1].mean_loss(), plan, out


@pytest.mark.parametrize("n_stages", [2, 3])
def test_hand_driven_1f1b_equals_single_process_training(n_stages):
    stages = float64_stages3()
    if n_stages == 2:  # 6 -> 10 -> 4
        stages = [nn.Sequential(*stages[0], *stages[1]), stages[2]]
    model = nn.Sequential(*copy.deepcopy(stages))
    opt = SGD(model.parameters())
    exs = executors(stages)
    for step, seed in enumerate((1, 2, 3)):  # momentum: later steps depend on the earlier ones
        x, y = float64_data(10, seed)  # 4 microbatches of 3, 3, 2, 2
        loss, _, _ = train_step(exs, step, x, y, m=4)
        _, (ref,) = reference_train([], nn.functional.cross_entropy, SGD, [(x, y)], model=model, opt=opt)
        assert loss == pytest.approx(ref, abs=1e-12)
    ref_state = model.state_dict()
    # the pipeline's parameters, in the order of nn.Sequential(*stages)
    got = [v for ex in exs for v in ex.module.state_dict().values()]
    assert len(got) == len(ref_state)
    for (name, ref), v in zip(ref_state.items(), got):
        torch.testing.assert_close(v, ref, **TOL, msg=name)
    # and training moved them: this is not a comparison of two untouched models
    initial = nn.Sequential(*stages).state_dict()
    assert all(not torch.equal(v, initial[name]) for name, v in ref_state.items())


@pytest.mark.parametrize("schedule", ["1f1b", "fill-drain"])
def test_requests_and_compute_follow_the_lowered_plan(schedule):
    """Every action runs once, in the stage's plan order: the communication as yielded requests,
    the compute as calls on the executor (recorded by wrapping them) in between."""
    exs = executors(float64_stages3(), schedule)
    log: list[list[str]] = [[] for _ in exs]
    for k, ex in enumerate(exs):
        def wrap(fn, tag, k=k):
            def run(*args):
                log[k].append(tag if tag == "STEP" else f"{tag}{args[0]}")
                return fn(*args)
            return run
        ex.forward = wrap(ex.forward, "F")
        ex.backward = wrap(ex.backward, "B")
        ex.optimizer_step = wrap(ex.optimizer_step, "STEP")
    x, y = float64_data(10)
    _, plan, (emitted, requests) = train_step(exs, 0, x, y, m=4, schedule=schedule, log=log)
    assert emitted == {}  # training emits nothing
    for k in range(len(exs)):
        assert log[k] == [str(a) for a in plan[k]], f"stage {k}"
        comm = [(a.op, a.microbatch) for a in plan[k] if a.op not in schedules.COMPUTE_OPS]
        assert [(r.op, r.microbatch) for r in requests[k]] == comm, f"stage {k}"
    # the plan really interleaves (1F1B: stage 0 runs B0 before F3), so the order is checked
    if schedule == "1f1b":
        assert log[0].index("B0") < log[0].index("F3")


def test_forward_only_emits_each_microbatch_output_from_the_last_stage():
    stages = float64_stages3()
    exs = executors(stages)
    x, _ = float64_data(10)
    sizes = split_sizes(10, 4)
    for k, ex in enumerate(exs):
        ex.begin(5, sizes, False, x if k == 0 else None)
    plan = schedules.build("1f1b", 3, len(sizes), training=False)
    emitted, requests = drive(exs, plan)
    assert [type(r) for r in requests[2]].count(Emit) == len(sizes)
    assert all(type(r) is not Emit for k in (0, 1) for r in requests[k])  # only the last stage emits
    assert [r.microbatch for r in requests[2] if type(r) is Emit] == list(range(len(sizes)))  # in order
    with torch.no_grad():
        full = nn.Sequential(*stages)(x)
    for j, chunk in enumerate(full.split(sizes)):
        (out,) = emitted[j]
        assert out.grad_fn is None
        torch.testing.assert_close(out, chunk, **TOL)


def test_tensors_yielded_for_sending_carry_no_autograd_graph():
    exs = executors(float64_stages3())
    x, y = float64_data(10)
    _, _, (_, requests) = train_step(exs, 0, x, y, m=4)
    sent = [(k, r) for k, reqs in enumerate(requests) for r in reqs if type(r) is Send]
    # stages 0 and 1 send activations, stages 1 and 2 gradients: 4 microbatches each
    assert sorted((k, r.op.value) for k, r in sent) == sorted(
        [(0, "sendF")] * 4 + [(1, "sendF")] * 4 + [(1, "sendB")] * 4 + [(2, "sendB")] * 4)
    for k, (op, _, j, tensors) in ((k, (r.op, r.chunk, r.microbatch, r.tensors)) for k, r in sent):
        assert isinstance(tensors, tuple) and tensors
        for t in tensors:
            assert t.grad_fn is None and not t.requires_grad, f"stage {k} {op.value}{j}"


def test_trace_rows_one_per_compute_action():
    exs = executors(float64_stages3())
    traces = [[] for _ in exs]
    x, y = float64_data(10)
    _, plan, _ = train_step(exs, 7, x, y, m=4, traces=traces)
    codes = {Op.FORWARD: trace.F, Op.BACKWARD: trace.B, Op.STEP: trace.OPT_STEP}
    for k, rows in enumerate(traces):
        compute = [a for a in plan[k] if a.op in schedules.COMPUTE_OPS]
        assert [(r[0], r[2]) for r in rows] == [(codes[a.op], a.microbatch) for a in compute], f"stage {k}"
        assert rows[-1][0] == trace.OPT_STEP and rows[-1][2] == -1
        prev_end = 0
        for code, step, j, start, end, nbytes in rows:
            assert step == 7 and nbytes == 0
            assert prev_end <= start <= end  # rows are spans, in the order they ran
            prev_end = end
        assert len(trace.rows_to_tensor(rows)) == len(rows)  # the shape the driver fetches
        trace.check_rows(trace.rows_to_tensor(rows), k)


def test_error_in_forward_propagates_out_of_the_generator_naming_microbatch_and_shapes():
    torch.manual_seed(0)
    # stage 1 expects width 7 but receives width 10
    stages = [nn.Linear(6, 10).double(), nn.Linear(7, 4).double()]
    exs = executors(stages)
    x, y = float64_data(10)
    sizes = split_sizes(10, 4)
    for k, ex in enumerate(exs):
        ex.begin(3, sizes, True, x if k == 0 else None, y if k == 1 else None)
    plan = schedules.build("1f1b", 2, 4)
    g0 = execute([exs[0]], plan[0])
    g1 = execute([exs[1]], plan[1])
    req = next(g0)
    while not (type(req) is Send and req.op is Op.SEND_ACT):
        req = g0.send(None)
    assert next(g1) == Recv(Op.RECV_ACT, 0, 0)
    with pytest.raises(RuntimeError, match=r"forward of microbatch 0 \(step 3\) failed on input of shape "
                                           r"\(3, 10\) float64: .*mat1 and mat2") as info:
        g1.send(req.tensors)
    assert isinstance(info.value.__cause__, RuntimeError)  # the module's own error is kept
    with pytest.raises(StopIteration):  # the generator is finished, not left half-way
        next(g1)
