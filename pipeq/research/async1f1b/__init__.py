"""Asynchronous 1F1B (PipeDream, Narayanan et al., SOSP 2019): a step after every microbatch, weight stashing."""

__all__ = ["executor", "schedule"]
