"""Sharded replicas on torch's FSDP2 (``sharding="fsdp"`` or ``"hsdp"``).

The S replicas of a replicate slice (:mod:`pipeq.parallel.mesh`: S = R with ``"fsdp"``, S =
``shard_size`` with ``"hsdp"``) shard each stage's module with ``torch.distributed.fsdp.fully_shard``
over their slice's ``mesh["shard"]`` (:func:`shard`): replica r holds the (r mod S)-th piece
(dim 0) of every parameter, of its gradient and of the optimizer's state (the optimizer is built
on the sharded parameters). With tensor parallelism too, the module is split over ``mesh["tp"]``
first and FSDP2 shards the DTensor pieces over ``mesh["shard"]`` (a 2-D ``shard x tp`` mesh, as
torchtitan composes them). Nothing here shards anything: FSDP2 does. :class:`Sharding` is what a
stage's compute does with it, one step at a time::

    begin         gather (module.unshard(): an all-gather); fsdp_reshard="step": once, kept
    F / B / I / W the gathered parameters compute; their gradients accumulate, whole, in the
                  gathered parameters' .grad (FSDP's per-backward reduce-scatter is off);
                  fsdp_reshard="microbatch" gathers before each action and frees after it
    last B / W    the step's one reduce-scatter (:meth:`Sharding.reduce`): each replica gets the
                  SUM of the slice's gradients of its piece (the divide factor is 1: every
                  microbatch's loss is weighted by its share of the whole batch already), and the
                  gathered parameters are freed; with ``"hsdp"`` the replicate slices then
                  all-reduce their pieces (:class:`~pipeq.parallel.data.GradSync`)

The zero-bubble schedules' ``W`` differentiates into the module's parameters: while gathered,
FSDP2 registers the gathered ones on the module, which are what the forward used. The V
schedules' two chunks per process are two FSDP roots over one group; every replica runs the same
actions in the same order, so their collectives line up. A compiled stage compiles its forward
only (:mod:`pipeq.stage.compiled`): FSDP2's hooks run around it, on the module's call.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["shard", "Sharding"]


def shard(module: nn.Module, mesh: Any) -> nn.Module:
    """``module`` (on its device) with slice rank 0's parameters and buffers (broadcast: replicas
    never start apart), then ``fully_shard``-ed over ``mesh``: gathered parameters kept after the
    forward (pipeq decides when to free them), the reduce-scatter a sum (divide factor 1)."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    group = mesh.get_group()
    with torch.no_grad():
        for t in [*module.parameters(), *module.buffers()]:
            data = t.data.to_local() if hasattr(t.data, "to_local") else t.data
            dist.broadcast(data, src=dist.get_global_rank(group, 0), group=group)
    fully_shard(module, mesh=mesh, reshard_after_forward=False)
    module.set_gradient_divide_factor(1.0)  # type: ignore[operator]
    module.set_force_sum_reduction_for_comms(True)  # type: ignore[operator]  # a plain SUM (gloo has no PREMUL_SUM)
    # a parameter one replica's microbatches left unused still takes part (a zero gradient), so that
    # every replica's reduce-scatter holds the same tensors, as the replicated run's sum does
    module.set_reduce_scatter_unused_params(True)  # type: ignore[operator]
    _accumulating(module)
    return module


def _accumulating(module: Any) -> None:
    """Within a step: FSDP's hooks accumulate whole gradients and free nothing (pipeq does)."""
    module.set_requires_gradient_sync(False)
    module.set_reshard_after_backward(False)
    module.set_is_last_backward(False)


class Sharding:
    """What a sharded stage's compute does with its FSDP2 module (see the module):
    ``reshard`` is ``"step"`` or ``"microbatch"``."""

    def __init__(self, module: nn.Module, reshard: str) -> None:
        self.module = module
        self.per_action = reshard == "microbatch"
        self.training = False
        self.reduced = False

    def gather(self) -> None:
        self.module.unshard()  # type: ignore[operator]  # a no-op when gathered already (no collective then)

    def free(self) -> None:
        self.module.reshard()  # type: ignore[operator]  # local: the pieces are the module's again

    def begin(self, training: bool) -> None:
        self.training = training
        self.reduced = False
        if training and not self.per_action:
            self.gather()

    def gathered(self, fn: Any) -> bool:
        """Whether an action runs on parameters gathered already (a training step gathered at its begin)."""
        return self.training and not self.per_action

    def around(self, fn: Any, *args: Any) -> Any:
        """``fn(*args)`` on the gathered parameters: gathered per action with ``"microbatch"``, and
        in a forward-only step (predict, evaluate) whatever the policy, which no reduce-scatter
        ends: a replica keeps only its pieces after it (every replica runs the same forwards)."""
        if self.training and not self.per_action:
            return fn(*args)
        self.gather()
        try:
            return fn(*args)
        finally:
            self.free()

    def reduce(self) -> None:
        """The step's reduce-scatter, as torch's own pipelining stage does it: FSDP's post-backward of
        every parameter group by hand, with gradient sync on, then its root's final callback (which
        waits for the reductions and frees the gathered parameters). Once per step."""
        from torch.distributed.fsdp import fully_shard

        if self.reduced:
            return
        self.reduced = True
        module: Any = self.module
        module.set_requires_gradient_sync(True)
        module.set_reshard_after_backward(True)
        module.set_is_last_backward(True)
        root = fully_shard.state(module)
        for state in root._state_ctx.all_states:
            for group in state._fsdp_param_groups:
                group.post_backward()
        root._root_post_backward_final_callback()
        _accumulating(module)
