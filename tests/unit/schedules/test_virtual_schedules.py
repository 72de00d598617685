"""The modern schedules as plans: interleaved 1F1B, looped BFS, ZBV, DualPipeV (several stages per
process) in torch's orders, and ZB-H2 (one stage per process, the pipeline kept full)."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest

import pipeq
import pipeq.schedules as S
from plan_cases import peak_in_flight
from pipeq.errors import ScheduleError
from pipeq.schedules import Action, Op
from pipeq.schedules.bounds import stream_bound
from pipeq.schedules.placement import stage_index

pytestmark = pytest.mark.timeout(30)

UNIT = {Op.FORWARD: 1, Op.INPUT_GRAD: 1, Op.WEIGHT_GRAD: 1, Op.BACKWARD: 2, Op.STEP: 0}
VIRTUAL = {"interleaved-1f1b": S.Interleaved1F1B, "looped-bfs": S.LoopedBFS, "zbv": S.ZBV, "dualpipev": S.DualPipeV}


# -- helpers: torch's order, per-stage lists, and a dry run across processes -------------------------
def _torch(cls_name: str, n: int, **attrs) -> list[list[str]]:
    """torch's per-rank compute order, without a process group (bubbles dropped, overlapped
    F/B pairs flattened into their sub-actions)."""
    from torch.distributed.pipelining import schedules as ts

    fake = SimpleNamespace(pp_group_size=n, **attrs)
    out = []
    for rank in range(n):
        order = []
        for a in getattr(ts, cls_name)._calculate_single_rank_operations(fake, rank):
            if a is not None:
                order += [repr(s) for s in a.sub_actions] if a.sub_actions else [repr(a)]
        out.append(order)
    return out


def _ours(plan: list[list[Action]], n: int, placement: str) -> list[list[str]]:
    """A plan in torch's notation: model stage, op, microbatch (``5F2``); STEPs dropped."""
    return [[f"{stage_index(p, a.chunk, n, placement)}{a.op.value}{a.microbatch}" for a in acts if a.op is not Op.STEP]
            for p, acts in enumerate(plan)]


def _per_stage(plan: list[list[Action]], n: int, chunks: int, placement: str) -> list[list[Action]]:
    """Each model stage's own list (chunk 0 actions), from the processes' lists."""
    stages: list[list[Action]] = [[] for _ in range(n * chunks)]
    for p, acts in enumerate(plan):
        assert acts[-chunks:] == [Action(Op.STEP, -1, c) for c in range(chunks)], f"process {p}'s STEPs"
        for a in acts:
            stages[stage_index(p, a.chunk, n, placement)].append(Action(a.op, a.microbatch))
    return stages


def _run(policy, n: int, m: int, cost=UNIT) -> float:
    """The step's length of ``policy`` on ``n`` processes: :func:`pipeq.schedules.build` (per model
    stage consistency, a deadlock-free dry run across processes) and its dry run at ``cost``."""
    policy = S.resolve(policy)
    n_stages = n * policy.stages_per_process
    timeline = S.dry_run(S.build(policy, n_stages, m), cost=cost, stages=S.process_stages(policy, n_stages))
    return max(t + cost[a.op] for row in timeline for t, a in row if a.op is not Op.STEP)


def _check(policy, n: int, m: int) -> float:
    plan = policy.plan(n, m)
    assert len(plan) == n
    S.check_consistency(_per_stage(plan, n, policy.stages_per_process, policy.placement),
                        n * policy.stages_per_process, m, training=True)
    return _run(policy, n, m)


# -- torch's orders --------------------------------------------------------------------------------
@pytest.mark.parametrize("n,m,v", [(2, 4, 2), (4, 8, 2), (4, 6, 2), (4, 10, 2), (4, 3, 2), (3, 5, 3), (2, 8, 4),
                                   (5, 15, 3)])
def test_interleaved_1f1b_orders_as_torch(n, m, v):
    rounds = max(1, m // n)
    assert m % rounds == 0
    theirs = _torch("ScheduleInterleaved1F1B", n, n_local_stages=v, microbatches_per_round=m // rounds,
                    _n_microbatches=m)
    assert _ours(S.interleaved_1f1b(n, m, v), n, "loop") == theirs


@pytest.mark.parametrize("n,m,v", [(2, 2, 2), (4, 8, 2), (3, 5, 3)])
def test_looped_bfs_orders_as_torch(n, m, v):
    theirs = _torch("ScheduleLoopedBFS", n, _stages=[None] * v, _n_microbatches=m)
    assert _ours(S.looped_bfs(n, m, v), n, "loop") == theirs


@pytest.mark.parametrize("n,m", [(1, 1), (2, 3), (2, 8), (4, 8), (4, 5), (3, 9), (5, 4)])
def test_zbv_orders_as_torch(n, m):
    assert _ours(S.zbv(n, m), n, "v") == _torch("ScheduleZBVZeroBubble", n, _n_microbatches=m, num_stages=2 * n)


@pytest.mark.parametrize("n,m", [(2, 4), (2, 7), (4, 8), (4, 9), (3, 10), (5, 16)])
def test_dualpipev_orders_as_torch_with_overlapped_pairs_flattened(n, m):
    assert _ours(S.dualpipev(n, m), n, "v") == _torch("ScheduleDualPipeV", n, _n_microbatches=m)
    if n > 1:  # a forward of one chunk, then a full backward of the other: torch's OVERLAP_F_B pair
        acts = S.dualpipev(n, m)[0]
        first_b0 = acts.index(Action(Op.BACKWARD, 0, 0))
        assert acts[first_b0 - 3:first_b0] == [Action(Op.FORWARD, 2 * n - 1, 0), Action(Op.BACKWARD, n - 1, 1),
                                               Action(Op.FORWARD, n, 1)]


# -- every model stage's list is consistent, and the processes run without deadlock -------------------
@pytest.mark.parametrize("name", sorted(VIRTUAL))
@pytest.mark.parametrize("n,m", [(1, 2), (2, 4), (3, 6), (4, 8), (4, 10), (4, 5)])
def test_each_model_stage_runs_every_microbatch_once_and_nothing_deadlocks(name, n, m):
    policy = S.resolve(name)
    if name == "interleaved-1f1b" and m % max(1, m // n):
        pytest.skip("rounds do not divide m")
    if name == "dualpipev" and m < 2 * n:
        pytest.skip("dualpipev needs m >= 2N")
    assert _check(policy, n, m) > 0
    if name != "dualpipev":  # more chunks per process
        assert _check(policy.with_options(stages_per_process=3) if policy.option_names else policy, n, m) > 0


def test_the_checks_can_fail():
    swapped = S.interleaved_1f1b(2, 4, 2)
    swapped[0] = sorted(swapped[0][:-2], key=lambda a: a.op is Op.FORWARD) + swapped[0][-2:]  # backwards first
    with pytest.raises(ScheduleError, match="before its forward"):
        S.check_consistency(_per_stage(swapped, 2, 2, "loop"), 4, 4, training=True)
    crossed = [[Action(Op.FORWARD, 0, 1), Action(Op.FORWARD, 0, 0), Action(Op.BACKWARD, 0, 1),  # stage 1's F first
                Action(Op.BACKWARD, 0, 0), Action(Op.STEP, -1, 0), Action(Op.STEP, -1, 1)]]
    S.check_consistency(_per_stage(crossed, 1, 2, "loop"), 2, 1, training=True)

    class Crossed(S.SchedulePolicy):
        name, stages_per_process = "crossed", 2

        def plan(self, n_stages, n_microbatches):
            return crossed

    with pytest.raises(ScheduleError, match=r"deadlocks: process 0 \(stage 1\) waits for the act of microbatch 0"):
        _run(Crossed(), 1, 1)


def test_interleaving_and_the_v_shorten_the_step():
    half = {op: c / 2 for op, c in UNIT.items()}  # a chunk is half a 1F1B stage
    one_f_one_b = _run("1f1b", 4, 8)
    assert one_f_one_b == 3 * (8 + 4 - 1)
    assert _run("interleaved-1f1b", 4, 8, half) < one_f_one_b
    assert _run("zbv", 4, 8, half) <= 3 * 8 + 2  # about zero bubble at F = I = W
    assert _run("dualpipev", 4, 8, half) < one_f_one_b


# -- ZB-H2 ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n,m", [(1, 1), (1, 3), (2, 1), (2, 5), (3, 4), (4, 8), (4, 16), (5, 7), (6, 20)])
def test_zb_h2_is_valid_deadlock_free_fills_the_pipeline_and_holds_2n_minus_1(n, m):
    plan = S.zb_h2(n, m)
    S.build("zb-h2", n, m)  # consistency and dry run
    for k, acts in enumerate(plan):
        warm = next(i for i, a in enumerate(acts) if a.op is not Op.FORWARD)
        assert warm == min(m, 2 * n - 1 - 2 * k)
        assert peak_in_flight(acts) <= 2 * n - 1
    assert peak_in_flight(plan[0]) == min(m, 2 * n - 1)


def test_zb_h2_is_a_parallelogram_at_equal_costs_and_beats_zb_h1_when_w_is_cheaper():
    timeline = S.dry_run(S.build("zb-h2", 4, 8), cost=UNIT)
    for k, row in enumerate(timeline):  # stage k works from k to 3m + k without a gap
        starts = [t for t, a in row if a.op is not Op.STEP]
        assert starts == list(range(k, 3 * 8 + k))
    table = S.format_table("zb-h2", 4, 8, costs=(1, 1, 1)).splitlines()
    assert table[1].split("|")[1].split()[:10] == ["F0", "F1", "F2", "F3", "F4", "F5", "F6", "I0", "W0", "I1"]
    # a synchronized STEP: 3m + N - 1, the floor at these costs, which ZB-H1 reaches as well
    assert table[-2] == "step 27 units before STEP; bubble 11.1% (12 idle units)"
    assert table[-1] == "bubble per process: 3 units; formula (N-1)·max(F, F+I-2W) = 3 units (pipeq.schedules.bubbles)"
    assert S.format_table("zb-h1", 4, 8, costs=(1, 1, 1)).splitlines()[-2] == table[-2]
    for costs, h1, h2 in (((1, 2, 1), 38, 35), ((2, 2, 1), 49, 46)):  # ZB-H1: (N-1)(F+I-W); ZB-H2: (N-1)F
        assert S.format_table("zb-h1", 4, 8, costs=costs).splitlines()[-2].startswith(f"step {h1} units")
        assert S.format_table("zb-h2", 4, 8, costs=costs).splitlines()[-2].startswith(f"step {h2} units")
    cost = {Op.FORWARD: 1, Op.INPUT_GRAD: 1, Op.WEIGHT_GRAD: 1}
    assert stream_bound("zb-h2", 4, 8, cost).stream == 3 * 8 + 1  # streamed: no bubble (+ its STEP)
    assert stream_bound("zb-h1", 4, 8, cost).stream > 3 * 8 + 1


# -- names, options, labels, refusals ---------------------------------------------------------------------
def test_registry_names_options_and_labels_round_trip():
    for name, cls in VIRTUAL.items():
        policy = S.resolve(name)
        assert name in pipeq.SCHEDULES and type(policy) is cls and policy.label == name and policy.name == name
        assert policy.plain_backprop and not policy.streams_across_batches and policy.stages_per_process == 2
        assert policy.placement == ("v" if name in ("zbv", "dualpipev") else "loop")
        assert S.from_label(policy.label) == policy
    assert S.resolve("interleaved") == S.Interleaved1F1B() and S.resolve("zb-h2").label == "zb-h2"
    four = S.resolve("interleaved-1f1b").with_options(stages_per_process=4)
    assert four.options == {"stages_per_process": 4} and four.stages_per_process == 4
    assert four.label == "interleaved-1f1b(v=4)" and S.from_label("interleaved-1f1b(v=4)") == four
    assert S.from_label("looped-bfs(v=3)") == S.LoopedBFS(3) != S.LoopedBFS()
    assert S.from_label("interleaved-1f1b(v=x)") is None
    assert S.resolve("looped-bfs").option_names == ("stages_per_process",) and S.resolve("zbv").option_names == ()
    assert max(a.chunk for acts in four.plan(2, 4) for a in acts) == 3


def test_a_job_file_gives_stages_per_process(tmp_path):
    from job_files import MLP_MOMENTUM
    from pipeq.launch.job import load_job

    path = tmp_path / "job.toml"
    path.write_text(MLP_MOMENTUM + 'schedule = { name = "interleaved-1f1b", stages_per_process = 3 }\nsteps = 1\n')
    assert S.resolve(load_job(str(path)).schedule) == S.Interleaved1F1B(3)


def test_refusals_say_what_to_give():
    with pytest.raises(ScheduleError, match=r"dualpipev needs at least as many microbatches as model stages: 4 "
                                            r"processes hold 8 stages, got 7 microbatches"):
        S.DualPipeV().plan(4, 7)
    with pytest.raises(ScheduleError, match=r"2 rounds of microbatches, and 9 microbatches do not divide into them: "
                                            r"give e\.g\. 8 or 10"):
        S.Interleaved1F1B().plan(4, 9)
    for bad in (1, 0, "2", 2.0):
        with pytest.raises(ScheduleError, match="needs stages_per_process >= 2"):
            S.Interleaved1F1B(bad)
    with pytest.raises(ScheduleError, match="looped-bfs needs stages_per_process >= 2"):
        S.resolve("looped-bfs").with_options(stages_per_process=1)
    with pytest.raises(ValueError, match="takes the option stages_per_process, got \\['chunks'\\]"):
        S.resolve("interleaved").with_options(chunks=2)
    with pytest.raises(ScheduleError, match="at least one microbatch"):
        S.zbv(2, 0)


@pytest.mark.parametrize("name,formula", [("zbv", "(N-1)·max(F, F+I-2W)"), ("interleaved-1f1b", "(N-1)(F+B)"),
                                          ("zb-h1", "(N-1)·max(F, F+I-W)"), ("1f1b", "(N-1)(F+B)")])
@pytest.mark.parametrize("costs", [None, "1,1,1", "2,2,1"])
def test_pipeq_schedule_prints_a_bubble_that_matches_its_formula(capsys, name, formula, costs):
    from pipeq.launch.cli import main

    if costs is None and name in ("interleaved-1f1b", "1f1b"):
        costs = "1,1,1"  # (without costs a table of whole backwards prints no bubble)
    assert main(["schedule", name, "--stages", "4", "--microbatches", "8"] + (["--costs", costs] if costs else [])) == 0
    last = capsys.readouterr().out.splitlines()[-1]
    got, want = re.fullmatch(rf"bubble per process: (\d+) units; formula {re.escape(formula)} = (\d+) units "
                             r"\(pipeq.schedules.bubbles\)", last).groups()
    assert got == want
