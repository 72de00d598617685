"""Parallelism beside and inside the pipeline: one mesh per stage (replicas, FSDP shards, tensor-parallel shards), and tied weights across stages.

    mesh.py        a stage process's place in its stage's mesh (replicate x shard x tp): torch
                   process groups, a DeviceMesh, the replicate group rebuilt after a loss
    layers.py      StageParallel: what those add to a stage's F / B / I / W / STEP, composed
    data.py        the replicas' gradients summed with torch's collectives (GradSync)
    membership.py  fault_tolerance="replicas": which replicas each gradient round sums
    fsdp.py        the replicas of a slice sharding a stage with torch's FSDP2 (fsdp, hsdp)
    tensor.py      T shards of a stage, on torch's DTensor
    ties.py        tied weights' gradients exchanged between stage processes (TieSync)
"""

__all__ = ["data", "fsdp", "layers", "membership", "mesh", "tensor", "ties"]
