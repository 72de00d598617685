"""Imported once by the fork server that stage processes are forked from.

Importing here what every stage needs (torch, pipeq's worker, torch.optim's lazily imported
torch._dynamo, about a second on its own, and cloudpickle) makes starting a stage a fork instead of a fresh
interpreter. Nothing here runs user code or starts threads.

The fork server ignores SIGTERM, as its stages do: a SIGTERM to the whole process group (a
batch system's cancel) must not take it down, because the driver learns its stages' exit codes
through it (a dead server reads as every stage dead, code 255) while it checkpoints and stops
them. It still exits when the driver does (multiprocessing closes its pipe).
"""

import signal

import torch
import torch._dynamo  # noqa: F401  (torch.optim imports it on first use)

from pipeq.runtime import worker  # noqa: F401  (what every stage process imports)

try:  # a payload from a main without a file (stdin, a notebook) is unpickled with it
    import cloudpickle  # noqa: F401
except ImportError:  # then no such payload can come (pipeq.control.main_guard refuses them)
    pass

signal.signal(signal.SIGTERM, signal.SIG_IGN)
