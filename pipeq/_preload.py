"""Imported once by the fork server that stage processes are forked from.

Importing here what every stage needs (torch, pipeq's worker, and torch.optim's lazily imported
torch._dynamo, about a second on its own) makes starting a stage a fork instead of a fresh
interpreter. Nothing here runs user code or starts threads.
"""

import torch
import torch._dynamo  # noqa: F401  (torch.optim imports it on first use)

from . import worker  # noqa: F401
