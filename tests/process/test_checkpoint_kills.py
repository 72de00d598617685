"""Checkpoints survive their saver being SIGKILLed at any moment: the last good checkpoint always loads."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from pipeq.checkpoint import StageSnapshot, load, save


# ---------------------------------------------------------------------------- crash safety
#
# A saver process re-saves into a folder that holds a checkpoint and is killed (SIGKILL: no
# cleanup runs) at some moment; the folder must still load, as the last checkpoint whose save
# finished or as the one whose save was being killed, never as a mix, never not at all.

N_FILES = 4  # tiny tensors but several files: a save is mostly file creation and fsyncs


def numbered(gen: int, n_files: int = N_FILES) -> list[StageSnapshot]:
    """Snapshots whose every tensor holds ``gen``: a loaded checkpoint shows which save wrote it."""
    return [StageSnapshot(model={"0.weight": torch.full((4,), float(gen))}, optim={}, sched=None, rng=None,
                          layers=1, sequential=True) for _ in range(n_files)]


def generation(directory: str) -> int:
    """The save that wrote the checkpoint at ``directory`` (it must load, and be of one save)."""
    ckpt = load(directory)
    gen = ckpt.meta["gen"]
    assert len(ckpt.model) == N_FILES and all(torch.equal(t, torch.full((4,), float(gen))) for t in ckpt.model.values())
    return gen


def resave_forever(directory: str, first: int, started: Any, finished: Any) -> None:
    """Save generation first, first + 1, ... into ``directory`` until killed; ``finished`` is the
    last generation whose save returned."""
    started.set()
    gen = first
    while True:
        save(directory, numbered(gen), {"gen": gen})
        finished.value = gen
        gen += 1


def save_and_die_at(directory: str, gen: int, die_at: int) -> None:
    """Save ``gen`` into ``directory``, SIGKILLing this process just before its ``die_at``-th
    file-system step (a directory made, a file fsynced, a rename, a deletion)."""
    import shutil
    import signal

    count = [0]

    def step(fn: Any) -> Any:
        def wrapped(*args: Any, **kw: Any) -> Any:
            if count[0] == die_at:
                os.kill(os.getpid(), signal.SIGKILL)
            count[0] += 1
            return fn(*args, **kw)
        return wrapped

    for mod, name in ((os, "mkdir"), (os, "fsync"), (os, "rename"), (os, "replace"), (os, "remove"),
                      (os, "unlink"), (shutil, "rmtree")):
        setattr(mod, name, step(getattr(mod, name)))
    save(directory, numbered(gen, 2), {"gen": gen})
    print(count[0], flush=True)


def leftovers(parent: str, name: str = "ck") -> list[str]:
    return sorted(e for e in os.listdir(parent) if e != name)


@pytest.fixture()
def ctx():
    from pipeq.control.processes import process_context

    return process_context("forkserver")


@pytest.mark.timeout(90)
def test_sigkill_during_a_resave_never_loses_the_last_good_checkpoint(tmp_path, ctx):
    """20 savers re-saving into a used folder, each SIGKILLed at a random moment: the folder
    always loads, as the last finished save or the one in flight; the next save cleans up."""
    import random
    import time

    ck = str(tmp_path / "ck")
    save(ck, numbered(0), {"gen": 0})
    t0 = time.perf_counter()
    save(ck, numbered(0), {"gen": 0})
    span = max(0.005, 2.5 * (time.perf_counter() - t0))  # kill somewhere in the first two saves
    rng = random.Random(14)
    last, interrupted, procs = 0, 0, []
    try:
        for trial in range(20):
            started, finished = ctx.Event(), ctx.Value("q", last)
            p = ctx.Process(target=resave_forever, args=(ck, last + 1, started, finished), daemon=True)
            procs.append(p)
            p.start()
            assert started.wait(30), "the saver did not start"
            time.sleep(rng.uniform(0, span))
            p.kill()
            p.join(10)
            assert p.exitcode == -9
            done = finished.value
            interrupted += bool(leftovers(str(tmp_path)))  # killed mid-save (temporary dir, .old)
            gen = generation(ck)  # loads (from .ck.old if the kill fell between the renames)
            assert gen in (done, done + 1), (trial, gen, done)  # the last finished save, or the next
            last = max(gen, done)
    finally:
        for p in procs:
            if p.exitcode is None:
                p.kill()
                p.join(5)
    print(f"{interrupted} of 20 kills fell inside a save")
    assert interrupted >= 10, f"only {interrupted} of 20 kills fell inside a save: the test tests little"
    save(ck, numbered(last + 1), {"gen": last + 1})  # the next save puts everything right
    assert leftovers(str(tmp_path)) == [] and generation(ck) == last + 1


@pytest.mark.timeout(60)
def test_a_kill_before_any_step_of_a_save_leaves_a_loadable_checkpoint(tmp_path, ctx):
    """A saver killed just before each of its file-system steps in turn (the last run finishes):
    the folder holds the old checkpoint until the new one is swapped in, then the new one; a
    kill between the two renames leaves only ``.ck.old``, which load, latest and the next save
    all take for the checkpoint."""
    outcomes, between = [], 0
    for die_at in range(30):
        parent = tmp_path / str(die_at)
        ck = str(parent / "ck")
        save(ck, numbered(1, 2), {"gen": 1})
        p = ctx.Process(target=save_and_die_at, args=(ck, 2, die_at), daemon=True)
        p.start()
        p.join(30)
        if p.exitcode is None:
            p.kill()
            p.join(5)
        assert p.exitcode in (0, -9)
        if not os.path.exists(ck):
            between += 1
            assert [e for e in leftovers(str(parent)) if not e.endswith(".tmp")] == [".ck.old"]
        gen = load(ck).meta["gen"]
        outcomes.append(gen)
        save(ck, numbered(3, 2), {"gen": 3})
        assert leftovers(str(parent)) == [] and load(ck).meta["gen"] == 3
        if p.exitcode == 0:
            break
    else:
        raise AssertionError("30 steps and the save has not finished")
    assert outcomes[-1] == 2 and outcomes[0] == 1 and outcomes == sorted(outcomes)
    assert between == 1  # exactly one step falls between the renames
