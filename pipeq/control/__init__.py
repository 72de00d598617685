"""The control plane: the runner users embed, its checks, and the backends that start and command stages."""

__all__: list[str] = []  # nothing: its modules are imported by their own names
