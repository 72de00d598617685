"""torch.distributed.pipelining's compute-only schedule CSV: round trips, TDP's own files, refusals, a run."""

from __future__ import annotations

import csv
import functools
from types import SimpleNamespace

import pytest
import torch

import pipeq.schedules as S
from pipeq.errors import ScheduleError
from pipeq.launch.cli import main
from pipeq.schedules import B, F, STEP, Action, Op
from pipeq.schedules.tdp_csv import CsvSchedule, dumps, loads, process_chunk, stage_index

TDP = pytest.importorskip("torch.distributed.pipelining.schedules")


@pytest.mark.parametrize("name", ["1f1b", "fill-drain", "zb-h1"])
@pytest.mark.parametrize("n,m", [(2, 3), (4, 8)])
def test_pipeq_schedules_round_trip(name, n, m):
    plan = S.resolve(name).plan(n, m)
    text = dumps(plan)
    assert loads(text, n) == plan
    assert loads(dumps(S.build(name, n, m)), n) == plan  # lowered plans dump their compute actions
    assert text.splitlines()[n - 1].startswith(f"{n - 1}F0,")


def _tdp_csv(tmp_path, order) -> str:
    """The CSV TDP's own PipelineScheduleMulti._dump_csv writes for a pipeline_order."""
    path = tmp_path / "tdp.csv"
    TDP.PipelineScheduleMulti._dump_csv(SimpleNamespace(pipeline_order=order), str(path))
    return path.read_text()


def _tdp_1f1b(n, m):
    return TDP.Schedule1F1B._get_pipeline_order(SimpleNamespace(_num_stages=n, _n_microbatches=m))


def _tdp_gpipe(n, m):
    return TDP.ScheduleGPipe._get_pipeline_order(SimpleNamespace(_num_stages=n, _n_microbatches=m))


def _tdp_zb1p(n, m):
    fake = SimpleNamespace(n_local_stages=1, microbatches_per_round=m, pp_group_size=n, _n_microbatches=m)
    return {k: TDP.ScheduleInterleavedZeroBubble._calculate_single_rank_operations(fake, k) for k in range(n)}


@pytest.mark.parametrize("ours,theirs", [("fill-drain", _tdp_gpipe), ("zb-h1", _tdp_zb1p)])
@pytest.mark.parametrize("n,m", [(2, 2), (4, 4), (3, 6)])
def test_a_csv_tdp_dumps_loads_as_pipeqs_plan_and_ours_parses_as_theirs(tmp_path, ours, theirs, n, m):
    order = theirs(n, m)
    text = _tdp_csv(tmp_path, order)
    assert ",," in text or ours == "fill-drain"  # idle cells in TDP's ZB1P
    assert loads(text, n) == S.resolve(ours).plan(n, m)
    mine = [[TDP._Action.from_str(c) for c in row] for row in csv.reader(dumps(S.resolve(ours).plan(n, m)).splitlines())]
    want = [[a for a in order[k] if a is not None and a.computation_type.value in "FIBW"] for k in range(n)]
    assert mine == want


@pytest.mark.parametrize("n,m", [(2, 2), (4, 4), (3, 6)])
def test_tdp_1f1b_rows_match_but_its_ir_skips_the_last_ranks_F0(tmp_path, n, m):
    """torch's Schedule1F1B._get_pipeline_order (its IR, not what its step runs) starts the last
    rank at F1 and ends at F(m): the file is refused, naming it; every other rank is pipeq's 1F1B."""
    order = _tdp_1f1b(n, m)
    with pytest.raises(ScheduleError, match=rf"stage \d+: no forward for microbatch\(es\) \[{m}\]"):
        loads(_tdp_csv(tmp_path, order), n)
    rows = [[TDP._Action.from_str(c) for c in row] for row in csv.reader(dumps(S.one_f_one_b(n, m)).splitlines())]
    want = [[a for a in order[k] if a is not None and a.computation_type.value in "FIBW"] for k in range(n)]
    assert rows[:-1] == want[:-1] and str(want[-1][0]) == f"{n - 1}F1" and str(rows[-1][0]) == f"{n - 1}F0"


def test_stage_index_for_one_chunk_looped_and_v():
    assert [stage_index(k, c, 4) for c in (0, 1) for k in range(4)] == list(range(8))
    assert [stage_index(k, c, 4, "v") for c in (0, 1) for k in range(4)] == [0, 1, 2, 3, 7, 6, 5, 4]
    assert all(process_chunk(stage_index(k, c, 3, p), 3, p) == (k, c) for p in ("loop", "v")
               for k in range(3) for c in (0, 1))
    with pytest.raises(ValueError, match="placement"):
        stage_index(0, 0, 2, "zigzag")


def test_several_chunks_validate_per_virtual_stage():
    looped = "0F0,2F0,2B0,0B0,0REDUCE_GRAD\n1F0,3F0,3B0,1B0\n"
    plan = loads(looped, 2)
    assert plan[1] == [F(0), Action(Op.FORWARD, 0, 1), Action(Op.BACKWARD, 0, 1), B(0), STEP, Action(Op.STEP, -1, 1)]
    assert dumps(plan) == looped.replace(",0REDUCE_GRAD", "").replace("\n", "\r\n")
    v = loads("0F0,3F0,3B0,0B0\n1F0,2F0,2B0,1B0\n", 2, "v")
    assert v == plan and dumps(v, "v").startswith("0F0,3F0,3B0,0B0")
    with pytest.raises(ScheduleError, match=r"row 0 \(process 0\), TDP stage 2: stage 2: no backward"):
        loads("0F0,2F0,0B0\n1F0,3F0,3B0,1B0\n", 2)


@pytest.mark.parametrize("text,n,match", [
    ("0F0,1F0\n1F0,1B0\n", 2, r"^row 0 \(process 0\), column 1 \(step 1\), '1F0': stage 1 is on process 1"),
    ("0F0,,0X1,0B0\n", 1, r"^row 0 \(process 0\), column 2 \(step 2\), '0X1': not an action"),
    ("0F0,0SEND_F0,0B0\n", 1, r"column 1 \(step 1\), '0SEND_F0': SEND_F is a communication"),
    ("0F,0B0\n", 1, r"column 0 \(step 0\), '0F': F needs a microbatch"),
    ("0F0,,0B0\n1B0,1F0\n", 2, r"^row 1 \(process 1\), column 0 \(step 0\), '1B0': .*before its forward"),
    ("0F0,0I0\n", 1, r"column 1 \(step 1\), '0I0': .*no weight gradient \(W\)"),
    ("0F0,0B0\n", 2, r"the CSV has 1 rows for 2 processes"),
    ("0F0,0I0,0F1,0I1,0W0,0W1\n1F0,1F1,1I1,1I0,1W0,1W1\n", 2,
     r"deadlocks: .*\(waiting: row 0 \(process 0\), column 1 \(step 1\), '0I0'; row 1 \(process 1\), column 1 "
     r"\(step 1\), '1F1'\)"),
])
def test_refusals_name_row_column_and_cell(text, n, match):
    with pytest.raises(ScheduleError, match=match):
        loads(text, n)


def test_cli_writes_the_csv_and_from_csv_reads_it(tmp_path, capsys):
    out = tmp_path / "zb.csv"
    assert main(["schedule", "zb-h1", "--stages", "3", "--microbatches", "4", "--csv", str(out)]) == 0
    assert capsys.readouterr().out.rstrip().endswith(f"csv: {out}")
    from pipeq.launch.csv_schedule import from_csv

    policy = from_csv(str(out))
    assert policy.label == f"csv:{out}" and policy.plan(3, 4) == S.zb_h1(3, 4)
    assert S.build(policy, 3, 4) == S.build("zb-h1", 3, 4)
    with pytest.raises(ScheduleError, match="a CSV of 3 stages x 4 microbatches; the run has 3 x 2"):
        policy.plan(3, 2)


def test_a_loaded_tdp_csv_trains_as_1f1b_in_simulated_mode(tmp_path):
    from models import float64_data, float64_stages3
    from runner_cases import run

    sgd = functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9)
    policy = CsvSchedule(_tdp_csv(tmp_path, _tdp_zb1p(3, 4)), label="tdp-zb1p")
    batches = [float64_data(8, seed) for seed in (1, 2)]
    got, got_state, _ = run(float64_stages3(), batches, schedule=policy, microbatches=4, mode="simulated", opt=sgd)
    want, want_state, _ = run(float64_stages3(), batches, schedule="1f1b", microbatches=4, mode="simulated", opt=sgd)
    assert got == pytest.approx(want, abs=1e-12)
    assert all(torch.allclose(got_state[k], want_state[k], atol=1e-12, rtol=0) for k in want_state)


def test_a_job_file_runs_a_csv_next_to_it(tmp_path):
    from job_files import MLP_MOMENTUM
    from pipeq.launch.job import load_job

    (tmp_path / "plan.csv").write_text(dumps(S.zb_h1(2, 4)))
    path = tmp_path / "job.toml"
    path.write_text(MLP_MOMENTUM + 'schedule = "csv:plan.csv"\nsteps = 1\n')
    job = load_job(str(path))
    assert isinstance(job.schedule, CsvSchedule) and job.schedule.plan(2, 4) == S.zb_h1(2, 4)
    (tmp_path / "plan.csv").write_text("0F0,0B0\n1B0,1F0\n")
    with pytest.raises(ValueError, match=r"job file .*: row 1 \(process 1\), column 0 \(step 0\), '1B0'"):
        load_job(str(path))


def _tdp_virtual(cls_name, n, m, **attrs):
    """torch's per-rank order of a schedule of several stages per rank (overlapped pairs flattened)."""
    fake = SimpleNamespace(pp_group_size=n, _n_microbatches=m, **attrs)
    order = {}
    for rank in range(n):
        acts = []
        for a in getattr(TDP, cls_name)._calculate_single_rank_operations(fake, rank):
            if a is not None:
                acts += list(a.sub_actions) if a.sub_actions else [a]
        order[rank] = acts
    return order


@pytest.mark.parametrize("ours,cls_name,placement,attrs", [
    ("interleaved-1f1b", "ScheduleInterleaved1F1B", "loop", dict(n_local_stages=2)),
    ("looped-bfs", "ScheduleLoopedBFS", "loop", dict(_stages=[None, None])),
    ("zbv", "ScheduleZBVZeroBubble", "v", {}),
    ("dualpipev", "ScheduleDualPipeV", "v", {}),
])
@pytest.mark.parametrize("n,m", [(2, 4), (4, 8)])
def test_tdp_csvs_of_two_stages_per_rank_load_as_pipeqs_plan_and_run(tmp_path, ours, cls_name, placement, attrs, n, m):
    if cls_name == "ScheduleInterleaved1F1B":
        attrs = {**attrs, "microbatches_per_round": m // max(1, m // n)}
    if cls_name == "ScheduleZBVZeroBubble":
        attrs = {**attrs, "num_stages": 2 * n}
    text = _tdp_csv(tmp_path, _tdp_virtual(cls_name, n, m, **attrs))
    plan = loads(text, n, placement)
    assert plan == S.resolve(ours).plan(n, m)  # torch's own action lists, read back as pipeq's
    assert dumps(plan, placement) == dumps(S.resolve(ours).plan(n, m), placement)
    schedule = CsvSchedule(text, "tdp.csv", placement)
    assert (schedule.stages_per_process, schedule.placement) == (2, placement)
    assert S.build(schedule, 2 * n, m) == S.build(ours, 2 * n, m)


def test_a_virtual_csv_in_the_wrong_placement_is_refused_naming_it(tmp_path):
    text = dumps(S.resolve("zbv").plan(2, 4), "v")
    with pytest.raises(ScheduleError, match=r"'3F0': stage 3 is on process 1 \(loop placement\), not on this row's"):
        loads(text, 2, "loop")
    with pytest.raises(ScheduleError, match=r"the CSV \(loop placement\): schedule deadlocks: process 0 \(stage 1\) "
                                            r"waits for the act of microbatch 0 from stage 0"):
        loads("1F0,0F0,1B0,0B0\n", 1)  # one process holding stages 0 and 1: stage 1's forward first
