"""One stage's compute: its spec, forward and backward, optimizer step, state, numerics, tied weights.

Nothing here opens a socket or knows of processes: the event loop and the simulated engine drive
an executor alike. Its modules:

    executor.py       StageExecutor: the forward; holds a Stepper, a Backprop and a StateIO
    step.py           Stepper: the optimizer step, clipping, loss scaling, the replicas' sync
    backprop.py       Backprop: the backward, whole (B) or as input and weight gradients (I, W)
    grad_graph.py     where a split backward's weight gradients start
    compiled.py       torch.compile of a stage in its process, and what compiling it cost
    split_backward.py a compiled backward cut into an I graph and a W graph
    state.py          StateIO: state tensors, checkpoint layout, snapshots and restores
    memory.py         MemoryMeter: the bytes a stage holds, its activations measured over a step
    spec.py           StageSpec and StageBuilder: what a stage is built from
    info.py           what a stage module says of itself (StageInfo, Tie)
    loss.py           each microbatch's loss weight
    numerics.py       mixed precision, loss scaling, clipping, finiteness, recomputation
    microbatch.py     batches of trees split into microbatches and joined
    lr_schedulers.py  when the stages step their lr schedulers
    tie_groups.py     tied weights declared (the runner's ties= and pipeq.split's alike)
    ties.py           TiedGrads: a stage's tied gradients, summed in stage order
    transfer.py       host copies; ordered_sum, the one ordered sum
"""

__all__ = ["backprop", "compiled", "executor", "grad_graph", "info", "loss", "lr_schedulers", "microbatch",
           "numerics", "spec", "split_backward", "state", "step", "tie_groups", "ties", "transfer"]
