"""The fork server that stage processes are forked from (``start_method="forkserver"``).

The server is a fresh interpreter that imports torch and pipeq once (:mod:`pipeq.runtime.preload`,
2-3 s here); each stage is then a fork of it (~50 ms). ``pipeq launch`` starts it first thing,
before it imports torch itself, so that both imports run at once on two cores. This module
imports nothing heavy, so that it can.
"""

from __future__ import annotations

import multiprocessing as mp
import os

PRELOAD = ["pipeq.runtime.preload"]


def start() -> None:
    """Start the fork server (once per process; a no-op when it runs) without the current
    directory on its sys.path: it runs ``python -c``, which would put it first, so a ``pipeq/``
    folder there (a source checkout beside a job file) would be preloaded instead of this pipeq,
    and every stage die with "cannot import name ... from 'pipeq'". (Its stages then take this
    process's sys.path.) Returns at once: the server imports in the background, and the first
    stage start waits for it."""
    from multiprocessing import forkserver

    mp.get_context("forkserver").set_forkserver_preload(PRELOAD)
    saved = os.environ.get("PYTHONSAFEPATH")
    os.environ["PYTHONSAFEPATH"] = "1"  # Python >= 3.11: no script directory or cwd on sys.path
    try:
        forkserver.ensure_running()
    finally:
        if saved is None:
            del os.environ["PYTHONSAFEPATH"]
        else:
            os.environ["PYTHONSAFEPATH"] = saved
