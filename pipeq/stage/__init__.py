"""One stage's compute: its spec, forward and backward, optimizer step, state, numerics, microbatches, lr schedulers."""

__all__ = ["executor", "info", "loss", "lr_schedulers", "microbatch", "numerics", "spec", "state", "step", "ties", "transfer"]
