"""The fork server that stage processes are forked from (``start_method="forkserver"``).

The server is a fresh interpreter that imports torch and pipeq once (:mod:`pipeq.runtime.preload`,
2-3 s here); each stage is then a fork of it (~50 ms). ``pipeq launch`` starts it first thing,
before it imports torch itself, so that both imports run at once on two cores. This module
imports nothing heavy, so that it can.

The server's socket lives in multiprocessing's temporary directory, which this module names
after the process (``pipeq-mp-<pid>-*``, removed at exit): a process killed by SIGKILL cannot
remove it, so the next start removes those whose process is gone (:func:`remove_stale`).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import re
import shutil
import signal
import stat
import tempfile

PRELOAD = ["pipeq.runtime.preload"]
#: what the server imports too when the run that starts it compiles its stages
PRELOAD_COMPILE = [*PRELOAD, "pipeq.runtime.preload_compile"]
#: multiprocessing's temporary directory of a process that starts the fork server (it holds the
#: server's socket): ``pipeq-mp-<pid>-<random>``, so that one left by a killed process is known
TEMP_PREFIX = "pipeq-mp-"
_SUN_PATH = 108  # the longest path of a unix socket, its NUL included (Linux)
_TEMP_DIR = re.compile(rf"{re.escape(TEMP_PREFIX)}(\d+)-\w+")


def start(compiles: bool = False) -> bool:
    """Start the fork server (once per process; a no-op when it runs) without the current
    directory on its sys.path: it runs ``python -c``, which would put it first, so a ``pipeq/``
    folder there (a source checkout beside a job file) would be preloaded instead of this pipeq,
    and every stage die with "cannot import name ... from 'pipeq'". (Its stages then take this
    process's sys.path.) Returns at once: the server imports in the background, and the first
    stage start waits for it. ``compiles``: the run compiles its stages, so the server imports
    torch.compile's machinery too (:mod:`pipeq.runtime.preload_compile`; a server already running
    is used as it is). True: it was not running (this call started it, see :func:`stop`)."""
    from multiprocessing import forkserver

    was = _running()
    if not was:
        mp.get_context("forkserver").set_forkserver_preload(PRELOAD_COMPILE if compiles else PRELOAD)
    _own_temp_dir()
    saved = os.environ.get("PYTHONSAFEPATH")
    os.environ["PYTHONSAFEPATH"] = "1"  # Python >= 3.11: no script directory or cwd on sys.path
    try:
        forkserver.ensure_running()
    finally:
        if saved is None:
            del os.environ["PYTHONSAFEPATH"]
        else:
            os.environ["PYTHONSAFEPATH"] = saved
    return not was


def _running() -> bool:
    from multiprocessing import forkserver

    pid = forkserver._forkserver._forkserver_pid
    return pid is not None and not _dead(pid)


def stop() -> None:
    """Stop the fork server now (a command that started it ends: one still importing torch would
    outlive it by seconds, and multiprocessing's resource tracker with it). Only once no stage
    runs: none is forked from it any more."""
    from multiprocessing import forkserver

    server = forkserver._forkserver
    pid = server._forkserver_pid
    if pid is None:
        return
    try:
        os.kill(pid, signal.SIGKILL)  # (closing its "alive" pipe is only read once its imports are done)
    except ProcessLookupError:
        pass
    server._stop()  # reaped, its socket removed


def _own_temp_dir() -> None:
    """Give multiprocessing a temporary directory named after this process before the fork server
    binds its socket there (else it makes an anonymous ``pymp-*``). multiprocessing removes it at
    exit; a process killed by SIGKILL cannot, so the next start removes those of dead processes
    (:func:`remove_stale`). A directory multiprocessing already made is left as it is."""
    from multiprocessing import process, util

    config = process.current_process()._config
    if config.get("tempdir") is not None:
        return
    remove_stale()
    tempdir = tempfile.mkdtemp(prefix=f"{TEMP_PREFIX}{os.getpid()}-")
    if len(os.path.join(tempdir, "listener-12345678").encode()) >= _SUN_PATH:  # a deep TMPDIR:
        os.rmdir(tempdir)  # the socket's path would not fit where pymp-*'s might
        return
    util.Finalize(None, _remove_temp_dir, args=(shutil.rmtree, tempdir), exitpriority=-100)
    config["tempdir"] = tempdir


def _remove_temp_dir(rmtree, tempdir: str) -> None:  # as multiprocessing.util's own
    rmtree(tempdir, ignore_errors=True)
    from multiprocessing import process

    current = process.current_process()
    if current is not None and current._config.get("tempdir") == tempdir:
        current._config["tempdir"] = None


def _dead(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:  # another user's pid: alive
        return False
    return False


def remove_stale(root: str | None = None) -> list[str]:
    """Remove the ``pipeq-mp-<pid>-*`` directories in ``root`` (the temp dir) that this user's
    processes left when they were killed: only those whose process is gone. The paths removed."""
    root = root or tempfile.gettempdir()
    gone = []
    try:
        names = os.listdir(root)
    except OSError:
        return gone
    for name in names:
        m = _TEMP_DIR.fullmatch(name)
        if m is None or int(m.group(1)) == os.getpid() or not _dead(int(m.group(1))):
            continue
        path = os.path.join(root, name)
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid():
            shutil.rmtree(path, ignore_errors=True)
            gone.append(path)
    return gone
