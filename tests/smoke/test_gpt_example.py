"""The GPT example (examples/gpt.py) and its job file (examples/gpt.toml) run end to end, tiny."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch

import pipeq

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository


def _run(args: list[str], cwd: str) -> subprocess.CompletedProcess:
    # the stages fork from a fork server (one torch import) instead of each importing torch anew
    # (spawn, the default): the example is what is tested, not the start method (tests/process/)
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               PIPEQ_START_METHOD="forkserver")
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=110)


@pytest.mark.timeout(120)
def test_quick_run_trains_saves_and_samples(tmp_path):
    done = _run([os.path.join(ROOT, "examples", "gpt.py"), "--quick", "--stages", "2", "--out", "run"], str(tmp_path))
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    baseline = re.search(r"unigram baseline: held-out loss ([\d.]+) nats, ([\d.]+) bits/byte", out)
    assert baseline and 4.0 < float(baseline[2]) < 5.5, out  # Python source: about 4.5 bits per byte
    assert re.search(r"tokens/s: \d+ overall, \d+ over the last steps", out), out
    assert re.search(r"steps of 8 x 16..32 tokens", out), out  # each batch of its own length
    assert re.search(r"held-out loss [\d.]+ nats, [\d.]+ bits/byte \(unigram baseline", out), out
    assert (tmp_path / "run" / "model.pt").is_file()
    sample = out.split("-" * 60)
    assert len(sample) == 3 and sample[1].strip().startswith("def "), out


@pytest.mark.timeout(120)
def test_the_job_file_launches(tmp_path):
    """examples/gpt.toml's job, made tiny by its functions' arguments, runs under pipeq launch."""
    with open(os.path.join(ROOT, "examples", "gpt.toml")) as f:
        text = f.read()
    tiny = {"stages_args": "{ n_stages = 2, quick = true }",
            "data_args": "{ batch = 8, steps = 10, quick = true }",
            "out": f'"{tmp_path / "run"}"'}
    for key, value in tiny.items():
        text, n = re.subn(rf"^{key} = .*$", f"{key} = {value}", text, flags=re.M)
        assert n == 1, key
    text += 'eval_data_args = { quick = true, n = 16 }\n'
    job = tmp_path / "gpt.toml"
    job.write_text(text)
    from launch_util import launch_here  # in this process: the stages fork from the session's fork server

    done = launch_here("--steps", "3", "--microbatches", "2", job=str(job))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "trained 3 steps (2 stages" in done.stdout and "bits per byte" in done.stdout, done.stdout
    assert (tmp_path / "run" / "model.pt").is_file()


@pytest.mark.timeout(60)
def test_the_model_splits_traced_and_by_module_names():
    """GPT's forward traces (pipeq.split's stages compute the model's logits) and, with the modules
    of other stages removed, runs as a stage of a split by names; the LM head is the embedding."""
    sys.path.insert(0, ROOT)
    from examples.gpt import GPT, QUICK

    torch.manual_seed(0)
    model = GPT(QUICK)
    assert model.lm_head.weight is model.tok_emb.weight
    x = torch.randint(0, 256, (3, QUICK.context))
    by_name = pipeq.split(model, modules=[["tok_emb", "pos_emb", "blocks.0"], ["blocks.1", "norm", "lm_head"]])
    for stages in (pipeq.split(model, (x[:2],), n_stages=2), by_name):
        value = (x,)
        for stage in stages:
            value = stage(*value)
            value = value if isinstance(value, tuple) else (value,)
        torch.testing.assert_close(value[0], model(x))
