"""The processes a test left behind: live descendants of the test process (Linux /proc).

A test process's own descendants only: with pytest-xdist each worker judges its own tests, and
multiprocessing's long-lived helpers (the fork server, the resource tracker) are not strays.
"""

from __future__ import annotations

import os
import signal
import time


def _children(pid: int) -> list[int] | None:
    """The children of process ``pid`` (every thread's: a child belongs to the thread that made
    it), from /proc/PID/task/TID/children; [] if ``pid`` is gone, None where the kernel has no
    such file (built without CONFIG_PROC_CHILDREN)."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return []
    out: list[int] = []
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out += [int(c) for c in f.read().split()]
        except FileNotFoundError:
            if not os.path.exists(f"/proc/{pid}/task/{tid}"):
                continue  # the thread ended meanwhile
            return None
        except OSError:
            continue
    return out


def _info(pid: int) -> tuple[str, str, str] | None:
    """(state, comm, cmdline) of process ``pid``; None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return None
    return stat[stat.rindex(")") + 2 :].split()[0], stat[stat.index("(") + 1 : stat.rindex(")")], cmd


def _descendants(root: int) -> list[tuple[int, str, str]]:
    """(pid, comm, cmdline) of every live descendant of ``root`` (Linux /proc): the tree under
    ``root`` read from the kernel's lists of children (a test's tree is a handful of processes;
    a machine may run hundreds), else every process's parent from a scan of /proc."""
    out, todo = [], [root]
    while todo:
        children = _children(todo.pop())
        if children is None:
            return _descendants_by_scan(root)
        for c in children:
            info = _info(c)
            if info is None:
                continue
            todo.append(c)  # a zombie's children (it is not reaped yet) still run
            if info[0] != "Z":  # a zombie is already dead
                out.append((c, info[1], info[2]))
    return out


def _descendants_by_scan(root: int) -> list[tuple[int, str, str]]:
    """As :func:`_descendants`, from every process's parent (a scan of all of /proc)."""
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


def gone(pid: int, timeout: float = 10.0) -> bool:
    """Process ``pid`` has exited (a zombie waiting for its reaper counts)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return True
        except OSError:
            return True
        time.sleep(0.05)
    return False


def session_left(sid: int) -> list[int]:
    """The processes still in session ``sid`` (a command started with ``start_new_session``: its
    driver, fork server, resource tracker, stages), zombies left out."""
    left = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid and fields[0] != "Z":  # (state, ppid, pgrp, session, ...)
            left.append(int(entry))
    return left


def assert_session_ends(sid: int, what: str, timeout: float = 10.0) -> None:
    """No process of session ``sid`` (``what``'s, started with ``start_new_session``) outlives it
    by ``timeout`` s: those left are killed, and the assertion names them."""
    deadline = time.monotonic() + timeout
    while session_left(sid) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = session_left(sid)
    if left:
        os.killpg(sid, signal.SIGKILL)
    assert not left, f"processes left behind by {what}: {left}"
