"""Imported by the fork server too when the run that starts it compiles its stages (``compile=``).

A stage's first ``torch.compile`` imports AOTAutograd, its partitioner (networkx) and inductor's
front end (jinja2, sympy's pattern matcher): 1.2-1.6 s in each stage process here, before it compiles
anything. Imported once in the fork server, each stage forked from it starts its compile with them
(``python -c "import pipeq.runtime.preload, pipeq.runtime.preload_compile"`` times it). Importing
them starts no thread. Runs that do not compile do not import them: they would only delay the first
stage by that much.
"""

import torch._dynamo.backends.common  # noqa: F401
import torch._dynamo.backends.debugging  # noqa: F401  (aot_eager)
import torch._functorch.aot_autograd  # noqa: F401
import torch._functorch.partitioners  # noqa: F401
import torch._inductor.compile_fx  # noqa: F401

import pipeq.stage.split_backward  # noqa: F401
