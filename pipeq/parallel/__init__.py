"""Parallelism beside and inside the pipeline: data-parallel replicas, tensor-parallel shards, and tied weights across stages."""

__all__ = ["data", "tensor", "ties"]
