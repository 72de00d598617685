"""The control plane: the runner users embed, its checks, and the backends that start and command stages."""
