"""Asynchronous 1F1B (PipeDream, Narayanan et al. 2019): a step after every microbatch, weight stashing."""
