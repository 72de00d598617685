"""Parallelism beside and inside the pipeline: data-parallel replicas, tensor-parallel shards, and tied weights across stages.

    data.py    R replicas of every stage, their gradients summed in replica order (GradSync)
    fsdp.py    R replicas sharding every stage with torch's FSDP2 (sharding="fsdp")
    tensor.py  T shards of a stage, on torch's DTensor
    ties.py    tied weights' gradients exchanged between stage processes (TieSync)
"""

__all__ = ["data", "fsdp", "tensor", "ties"]
