"""Parallelism beside and inside the pipeline: data-parallel replicas and tensor-parallel shards."""

__all__ = ["data", "tensor"]
