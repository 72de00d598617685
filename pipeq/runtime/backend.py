"""What runs a runner's stages: the :class:`Backend` protocol both backends implement.

:class:`~pipeq.control.driver.ProcessBackend` (``mode="process"``: one process per stage,
commanded over the control channel) and :class:`~pipeq.runtime.simulated.SimulatedBackend`
(``mode="simulated"``: every stage in this process) implement it; the runner and its
collaborators (:mod:`pipeq.control.streaming`, :mod:`pipeq.control.state`,
:mod:`pipeq.control.snapshots`) know a backend only through it. It is structural: neither class
names it, and tests/unit/runtime/test_backend_protocol.py checks that both have every member,
each method with the protocol's parameters (names, kinds, defaults and types).

Steps are numbered by the runner (training and prediction alike, counting up); a backend sends a
training step with :meth:`~Backend.submit` without waiting, and :meth:`~Backend.result` waits for
its loss, so several steps can be in flight (a stream). Every state call happens with no step in
flight (the runner settles them first).
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from pipeq.stage.executor import Tensors

__all__ = ["Backend", "Shard", "StageInputs", "StageState"]

#: One replica's part of a step: microbatch sizes, loss weights, auxiliary heads' loss weights.
Shard = tuple[list[int], list[float], "list[float] | None"]
#: One batch's stage inputs: per stage, the keyword arguments of its forward (None: it takes none).
StageInputs = list["dict[str, Any] | None"]
#: One stage's parameters and buffers: their names in the stage, and the tensors.
StageState = tuple[list[str], list[torch.Tensor]]


class Backend(Protocol):
    """The stages of one pipeline (and its replicas), driven by step: train, predict, state."""

    #: step -> the learning rate it trained with (the last stage's first group's), until the runner takes it
    step_lrs: dict[int, float | None]

    @property
    def failing(self) -> bool:
        """A stage has failed in a step sent ahead of the one the caller waits for (a stream stops sending)."""
        ...

    def start(self) -> None:
        """Start the stages (one process each in process mode); returns once every one is ready."""
        ...

    def close(self, failed: bool = False) -> None:
        """Stop every stage, letting them finish what they were sent. ``failed``: the caller ends
        the run on an error of its own (not a stage's): other nodes are told the run failed."""
        ...

    def submit(self, step: int, shards: list[Shard], x: Any, target: Any, stream: bool = False,
               inputs: StageInputs | None = None) -> None:
        """Send training step ``step``: replica r trains on the r-th shard of ``x`` and ``target``
        (and of each stage's ``inputs``). With ``stream``, a schedule that need not drain between
        batches does not (:meth:`drain` ends the stream)."""
        ...

    def result(self, step: int) -> float:
        """Wait for submitted step ``step``'s loss (the whole batch's mean); raise its failure."""
        ...

    def train(self, step: int, shards: list[Shard], x: Any, target: Any, stream: bool = False,
              inputs: StageInputs | None = None) -> float:
        """:meth:`submit` and then :meth:`result`: one step, its loss."""
        ...

    def drain(self) -> None:
        """End a stream: every stage finishes its leftover work (asynchronous 1F1B's last backwards)."""
        ...

    def predict(self, step: int, sizes: list[int], x: Any, inputs: StageInputs | None = None) -> list[Tensors]:
        """Forward only, microbatches of ``sizes``: the output stage's outputs, one per microbatch."""
        ...

    def stats(self, reset: bool = False, memory: bool = False) -> list[dict[str, Any]]:
        """Every stage's statistics (``PipelineRunner.stats``), its peak memory reset with ``reset``,
        with the bytes it holds (:mod:`pipeq.stage.memory`). ``memory``: every replica's stages
        (replica r's stage k at ``r * n_stages + k``), and each measures its next training step's
        activations (``PipelineRunner.memory``)."""
        ...

    def get_state(self) -> list[StageState]:
        """Every stage's parameters and buffers (replica 0's), copies."""
        ...

    def set_state(self, per_stage: list[StageState]) -> None:
        """Load each stage's named tensors (into every replica)."""
        ...

    def get_snapshots(self) -> list[dict[str, Any]]:
        """Every stage's snapshot: what a checkpoint holds of it (parameters, optimizer, RNG...)."""
        ...

    def request_snapshots(self, step: int) -> None:
        """Ask every stage for its snapshot after the steps sent so far, labelled ``step``; never waits."""
        ...

    def take_snapshots(self) -> list[tuple[int, list[dict[str, Any]]]]:
        """The requested snapshots complete since the last call, as (step, per stage); never waits."""
        ...

    def restore(self, snapshots: list[dict[str, Any]]) -> None:
        """Load each stage's snapshot into it (every replica)."""
        ...

    def layouts(self) -> list[dict[str, Any]]:
        """Every stage's layout: its names, layers, shapes and dtypes (:class:`pipeq.checkpoint.StageLayout`)."""
        ...

    def declared_inputs(self) -> list[tuple[str, ...]]:
        """The stage inputs each stage declares (:class:`pipeq.stage.info.StageInfo`)."""
        ...

    def scheduler_step(self, metric: float | None) -> None:
        """Step every stage's lr scheduler once (every replica's), with ``metric`` when it takes one."""
        ...

    def learning_rates(self) -> list[list[float]]:
        """Every stage's current learning rates, per parameter group (replica 0's)."""
        ...
