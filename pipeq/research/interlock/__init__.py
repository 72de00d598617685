"""Interlocking backpropagation (Gomez et al., arXiv 2010.04116): auxiliary heads and exact gradient routing."""

__all__ = ["executor", "routing", "schedule"]
