"""The per-stage event loop: the worker process, the action interpreter, and the simulated engine."""
