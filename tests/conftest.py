"""The suite's layout, its markers, and a guard against stray workers.

A test file's folder says what its tests start, and so which marker they carry (``-m unit`` runs
the tests that start no process)::

    tests/unit/     unit      start no process (the package's modules, in this process)
    tests/process/  process   start stage processes (a PipelineRunner in process mode)
    tests/launch/   launch    run ``pipeq launch`` (in this process, or as a command)
    tests/hosts/    hosts     several hosts: network namespaces, multi-node launches
    tests/smoke/    smoke     the examples and the benches, run as a user runs them
    tests/gpu/      cuda      need CUDA (skipped without it)

``tests/support/`` holds the helper modules (no tests): it is put on ``sys.path`` here, before the
fork server starts, so that the test modules, the stage processes (which take this process's
``sys.path``) and the job files (``launch_jobs:NAME``) import them by name.
"""

from __future__ import annotations

import os
import sys
import time

import pytest

TESTS = os.path.dirname(os.path.abspath(__file__))
SUPPORT = os.path.join(TESTS, "support")
if SUPPORT not in sys.path:
    sys.path.insert(0, SUPPORT)

from pipeq.control import forkserver  # noqa: E402

#: a test folder -> the marker its tests carry
FOLDER_MARKERS = {"unit": "unit", "process": "process", "launch": "launch", "hosts": "hosts",
                  "smoke": "smoke", "gpu": "cuda"}

# The fork server that process-mode tests fork their stages from (start_method="forkserver")
# imports torch while this process imports it and the test modules.
forkserver.start()

import torch  # noqa: E402

# Simulated-mode tests train tiny models in this process: one thread, like each stage process
# (two threads only contend with the stage processes and the other tests for the two cores).
torch.set_num_threads(1)


def folder_of(path: str) -> str | None:
    """The first folder under tests/ of a test file (None for a file directly in tests/)."""
    rel = os.path.relpath(os.path.abspath(path), TESTS).split(os.sep)
    return rel[0] if len(rel) > 1 else None


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items) -> None:
    """Each test carries its folder's marker."""
    for item in items:
        marker = FOLDER_MARKERS.get(folder_of(str(item.path)) or "")
        if marker is not None:
            item.add_marker(marker)


def _descendants(root: int) -> list[tuple[int, str, str]]:
    """(pid, comm, cmdline) of every live descendant of ``root`` (Linux /proc)."""
    children: dict[int, list[int]] = {}
    info: dict[int, tuple[str, str]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        comm = stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2 :].split()
        if fields[0] == "Z":  # a zombie is already dead
            continue
        children.setdefault(int(fields[1]), []).append(int(entry))
        info[int(entry)] = (comm, cmd)
    out, todo = [], [root]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append((c, *info[c]))
            todo.append(c)
    return out


def _is_mp_helper(cmd: str) -> bool:
    # multiprocessing's own long-lived helpers (shared by every runner of this process)
    return "forkserver" in cmd or "resource_tracker" in cmd


def stray_workers() -> list[tuple[int, str, str]]:
    """Descendants of the test process other than multiprocessing's fork server and tracker.

    Stage processes forked from the fork server share its command line, so they are recognised
    by the name every stage gives itself (``pipeq-stage<k>``).
    """
    return [p for p in _descendants(os.getpid())
            if p[1].startswith("pipeq-stage") or not _is_mp_helper(p[2])]


def wait_no_strays(timeout: float = 5.0) -> list[tuple[int, str, str]]:
    end = time.monotonic() + timeout
    while True:
        strays = stray_workers()
        if not strays or time.monotonic() > end:
            return strays
        time.sleep(0.05)


@pytest.fixture(scope="session")
def single_host_digits(tmp_path_factory) -> str:
    """The output directory of ``pipeq launch`` of the digits job on one host for
    ``launch_util.REFERENCE_STEPS`` steps: what every multi-host run must reproduce. One launch
    (in this process: its stages fork from the session's fork server) serves test_workers.py and
    test_multihost.py."""
    from launch_util import REFERENCE_STEPS, launch_here

    out = str(tmp_path_factory.mktemp("single-host"))
    r = launch_here("--steps", str(REFERENCE_STEPS), "--out", out)  # adds --quiet --threads-per-stage 1
    assert r.returncode == 0, r.stderr
    return out


class StartsAProcess(AssertionError):
    """A test of tests/unit/ started a process: it belongs in another folder."""


@pytest.fixture(autouse=True)
def unit_starts_no_process(request):
    """A test marked ``unit`` (tests/unit/) that starts a process fails, saying so."""
    if request.node.get_closest_marker("unit") is None:
        yield
        return
    import multiprocessing.process
    import subprocess

    def refuse(*args, **kwargs):
        raise StartsAProcess(f"{request.node.nodeid} starts a process: a unit test starts none "
                             "(move it to tests/process/, launch/, hosts/ or smoke/)")

    saved = multiprocessing.process.BaseProcess.start, subprocess.Popen.__init__, os.fork
    multiprocessing.process.BaseProcess.start = refuse
    subprocess.Popen.__init__ = refuse
    os.fork = refuse
    try:
        yield
    finally:
        multiprocessing.process.BaseProcess.start, subprocess.Popen.__init__, os.fork = saved


@pytest.fixture(autouse=True)
def no_stray_workers():
    """Every test must leave no worker process behind (checked after it, with 5 s of grace)."""
    yield
    strays = wait_no_strays(5.0)
    for pid, _, _ in strays:  # do not let one test's leak fail the next ones too
        try:
            os.kill(pid, 9)
        except OSError:
            pass
    assert not strays, f"processes left behind: {strays}"
