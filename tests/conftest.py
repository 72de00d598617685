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

import gc
import os
import sys

import pytest

TESTS = os.path.dirname(os.path.abspath(__file__))
SUPPORT = os.path.join(TESTS, "support")
if SUPPORT not in sys.path:
    sys.path.insert(0, SUPPORT)
# the shared test cases' checks report like the tests' own asserts (pytest rewrites them too)
pytest.register_assert_rewrite(*sorted(f[:-3] for f in os.listdir(SUPPORT) if f.endswith("_cases.py")))

from strays import wait_no_strays  # noqa: E402

#: The test processes' garbage collector (not the stage processes'): a young-generation pass
#: every 20,000 allocations instead of 700. The tests build and drop many graphs, modules and
#: tensors; with the default, 8,500 passes over them took 8 of the unit tests' 75 s of CPU.
GC_THRESHOLD = (20_000, 10, 10)
gc.set_threshold(*GC_THRESHOLD)

#: a test folder -> the marker its tests carry
FOLDER_MARKERS = {"unit": "unit", "process": "process", "launch": "launch", "hosts": "hosts",
                  "smoke": "smoke", "docs": "docs", "gpu": "cuda"}
#: the order folders run in: the longest tests first, so that with several workers (pytest-xdist)
#: the many short unit tests fill the gaps at the end instead of one long test running alone
FOLDER_ORDER = ["hosts", "launch", "smoke", "docs", "process", "gpu", "unit"]


def _runs_tests(config) -> bool:
    """False in pytest-xdist's controller: it hands the tests to its workers and runs none."""
    return hasattr(config, "workerinput") or not getattr(config.option, "numprocesses", None) or \
        getattr(config.option, "dist", "no") == "no"


def _unit_only(config) -> bool:
    """The run selects unit tests only (``-m unit``, or paths under tests/unit): nothing will fork."""
    if (config.option.markexpr or "").strip() == "unit":
        return True
    paths = [a.split("::")[0] for a in config.args]
    return bool(paths) and all(folder_of(p) == "unit" for p in paths)


def _a_few_unit_files(config) -> bool:
    """The run names unit test files (or tests in them), not the whole folder."""
    paths = [a.split("::")[0] for a in config.args]
    return bool(paths) and all(folder_of(p) == "unit" and os.path.abspath(p) != os.path.join(TESTS, "unit")
                               for p in paths)


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config) -> None:
    """A run of a few unit test files goes faster in this one process: each xdist worker would
    first import torch and collect them. (Unless the command line asks for workers itself.) The
    whole unit folder (``-m unit``, ``tests/unit``) keeps its two workers: its 1,600 tests take a
    minute of CPU, which two cores share."""
    asked = any(a == "-n" or a.startswith(("-n", "--numprocesses")) for a in config.invocation_params.args)
    if not asked and _a_few_unit_files(config) and getattr(config.option, "numprocesses", None):
        config.option.numprocesses = 0
        config.option.dist = "no"


def pytest_ignore_collect(collection_path, config) -> bool | None:
    """``-m unit`` collects tests/unit only: the other folders' modules (and their imports) would
    be imported and rewritten by every worker, to be deselected."""
    if (config.option.markexpr or "").strip() != "unit":
        return None
    path = str(collection_path)
    folder = folder_of(path)
    if folder is not None and folder != "unit" and os.path.dirname(path) == TESTS:
        return True
    return None


def pytest_configure(config) -> None:
    if not _runs_tests(config):
        return  # the xdist controller: no torch, no fork server
    if not _unit_only(config):
        # The fork server that process-mode tests fork their stages from (start_method=
        # "forkserver") imports torch while this process imports it and the test modules, and
        # torch.compile's machinery, which the compile tests' stages would each import again.
        from pipeq.control import forkserver

        forkserver.start(compiles=True)
    import torch

    # Simulated-mode tests train tiny models in this process: one thread, like each stage process
    # (two threads only contend with the stage processes and the other tests for the cores).
    torch.set_num_threads(1)
    _font_cache()


def _font_cache() -> None:
    """matplotlib builds its font cache the first time it is used on a machine, by running
    ``fc-list``: build it now, before a unit test that plots (and may start no process of its own)
    would. Once per machine: later sessions find it."""
    try:
        import matplotlib
    except ImportError:
        return
    import glob

    if not glob.glob(os.path.join(matplotlib.get_cachedir(), "fontlist-*.json")):
        import matplotlib.font_manager  # noqa: F401  (builds and saves the cache)


def folder_of(path: str) -> str | None:
    """The first folder under tests/ of a test file or folder (None for a file directly in tests/,
    or for tests/ itself)."""
    path = os.path.abspath(path)
    rel = os.path.relpath(path, TESTS).split(os.sep)
    if rel[0] in (os.curdir, os.pardir):
        return None
    return rel[0] if len(rel) > 1 or os.path.isdir(path) else None


def _shared_runs(item) -> set[str]:
    """What ``item`` shares with other tests: the module- and session-scoped fixtures of this
    suite that it uses (a launch, a set of runs), by scope and name."""
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return set()
    keys = set()
    for name in info.names_closure:
        for fd in info.name2fixturedefs.get(name, ()):
            if not fd.baseid:  # a plugin's (tmp_path_factory, ...): shares nothing costly
                continue
            if fd.scope == "session":
                keys.add(f"session:{name}")
            elif fd.scope in ("module", "package", "class"):
                keys.add(f"module:{item.path}")
    return keys


def _xdist_groups(items) -> dict[int, str]:
    """Tests that share a module or session fixture run on one worker (``--dist loadgroup``),
    so that it runs once; the others are spread one by one. Tests tied by any shared fixture
    form one group (a union of the fixtures' users)."""
    parent: dict[str, str] = {}

    def find(k: str) -> str:
        while parent.setdefault(k, k) != k:
            k = parent[k]
        return k

    keys = {id(item): sorted(_shared_runs(item)) for item in items}
    for ks in keys.values():
        for k in ks:
            parent[find(k)] = find(ks[0])
    # a group is named after its session fixture if it has one (a test that asks for it by
    # request.getfixturevalue joins it with an explicit xdist_group mark of that name), else its file
    members: dict[str, list[str]] = {}
    for k in list(parent):
        members.setdefault(find(k), []).append(k)
    names = {root: min(ks, key=lambda k: (not k.startswith("session:"), k)) for root, ks in members.items()}
    return {i: names[find(ks[0])].split(":", 1)[1].replace(os.sep, "/").rsplit("/tests/", 1)[-1]
            for i, ks in keys.items() if ks}


def pytest_collection_finish(session) -> None:
    """What collection made (torch, the test modules, 2,000 test items) lives to the end: the
    collector need not walk it again in every full pass (:func:`gc.freeze`)."""
    gc.freeze()


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items) -> None:
    """Each test carries its folder's marker (and, for pytest-xdist, the group of tests it shares
    a fixture with); the folders run in FOLDER_ORDER, each file's tests together and in order."""
    groups = _xdist_groups(items)
    for item in items:
        marker = FOLDER_MARKERS.get(folder_of(str(item.path)) or "")
        if marker is not None:
            item.add_marker(marker)
        if id(item) in groups and item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(groups[id(item)]))
    rank = {f: i for i, f in enumerate(FOLDER_ORDER)}
    order = {id(item): i for i, item in enumerate(items)}
    items.sort(key=lambda item: (rank.get(folder_of(str(item.path)) or "", len(rank)), order[id(item)]))


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
