"""The per-stage event loop: the worker process, the action interpreter, and the simulated engine."""

__all__: list[str] = []  # nothing: its modules are imported by their own names
