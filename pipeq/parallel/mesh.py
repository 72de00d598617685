"""One mesh per stage: a stage process's place among the processes that hold the same stages.

With ``data_parallel=R`` replicas of the pipeline and ``tensor_parallel=T`` shards of each stage,
the R x T processes holding one place of the pipeline (a stage, or a process's stages) form one
mesh, as torchtitan's ``ParallelDims`` lays it out::

    replicate  R / S   replicate slices: whole copies of the stage, gradients all-reduced
    shard      S       FSDP: the slice's S replicas each hold a piece of every parameter
    tp         T       tensor parallelism: each replica's stage split over T processes

``sharding="none"``: S = 1; ``"fsdp"``: S = R; ``"hsdp"``: S = ``shard_size`` (shard inside a
group of S, replicate across the R / S groups). Replica r is in slice ``r // S`` at place
``r % S`` of its shard dimension; process (r, t) is rank ``(r % S) * T + t`` of its slice.

Each slice's S x T processes make one torch process group (``init_process_group``, the
process's default) and a :class:`~torch.distributed.device_mesh.DeviceMesh` over it with the
dimensions it has (``"shard"``, ``"tp"``): FSDP2 shards over ``mesh["shard"]``, DTensor splits
over ``mesh["tp"]``, and the statistics a step combines (the norm term, found-inf) are summed over
the whole slice. Across slices, the processes of one slice rank make a :class:`ReplicaGroup`:
the replicate dimension, whose gradient all-reduce (:mod:`pipeq.parallel.data`) is pipeq's to
rebuild when a replica is lost (``fault_tolerance="replicas"``: abort and a new group without
it, as TorchFT does), so it is a process group of its own, made from the same store under a
name per membership. Every collective runs on torch: gloo for CPU tensors, NCCL for CUDA ones
(which never leave the device).

The groups meet in a store: a FileStore in the run's private directory on one host (gloo then
binds to loopback only), or the multi-host rendezvous TCPStore when the job declares its network
trusted (``trusted_network``: torch's collectives carry no authentication).
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

__all__ = ["GROUP_TIMEOUT", "PEER_FAILURE_GRACE_S", "MeshPlan", "StageMesh", "ReplicaGroup", "CollectiveError",
           "Waiter", "open_store", "gloo_interface", "peer_failure"]

#: how long one process waits for another in a collective: a follower waits for its lead's next
#: command for as long as the caller pauses between calls, so torch's default of 30 minutes would
#: end idle runs; a process that dies is noticed by the driver, which watches every process
GROUP_TIMEOUT = datetime.timedelta(days=30)

#: how long a process whose collective failed (a peer's connection closed) waits for the driver's
#: word before it reports the failure as its own: a peer that died is the driver's to name (it
#: watches every process and notices a death within a second), not the survivor that noticed it
PEER_FAILURE_GRACE_S = 5.0

#: ``wait(done, what)``: block until ``done()`` is true, serving the process's other traffic
#: meanwhile (the stage's inbox: a driver's EXIT or LOST interrupts it), ``what`` named in errors
Waiter = Callable[[Callable[[], bool], str], None]


def _plain_wait(done: Callable[[], bool], what: str) -> None:
    import time

    while not done():
        time.sleep(0.0005)


@dataclass(frozen=True)
class MeshPlan:
    """Where a stage process stands in its stage's mesh (plain data, made by the control plane).

    ``place``: the name of the process's place in its replica's pipeline (the same in every
    replica and shard); ``store``: where the groups meet, ``("file", path)`` or ``("tcp", host,
    port, prefix)``; ``generation``: 0, or how often this replica was started again (its slice's
    group then meets under a new name); ``ifname``: the network interface gloo binds to (None: loopback)."""

    replicas: int
    shard_size: int
    shards: int
    replica: int
    shard: int
    place: str
    store: tuple[Any, ...]
    generation: int = 0
    ifname: str | None = None

    @property
    def slices(self) -> int:
        """Replicate slices: R / S."""
        return self.replicas // self.shard_size

    @property
    def slice(self) -> int:
        return self.replica // self.shard_size

    @property
    def slice_size(self) -> int:
        return self.shard_size * self.shards

    @property
    def slice_rank(self) -> int:
        return (self.replica % self.shard_size) * self.shards + self.shard

    def dims(self) -> list[tuple[str, int]]:
        """The slice mesh's dimensions (only those of more than one process)."""
        return [(name, size) for name, size in (("shard", self.shard_size), ("tp", self.shards)) if size > 1]

    def slice_replicas(self, replica: int) -> list[int]:
        """The replicas of ``replica``'s slice (they are lost and rebuilt together)."""
        first = replica // self.shard_size * self.shard_size
        return list(range(first, first + self.shard_size))


def gloo_interface(address: str | None) -> str | None:
    """The name of the network interface holding IPv4 ``address`` (None: loopback, or not found)."""
    import socket

    from pipeq.wire.netif import interface_address

    if address is None or address.startswith("127."):
        return None
    for _, name in socket.if_nameindex():
        try:
            if interface_address(name) == address:
                return name
        except ValueError:
            continue
    return None


def open_store(spec: Sequence[Any]) -> Any:
    """The store a mesh's groups meet in (see :class:`MeshPlan`)."""
    import torch.distributed as dist

    if spec[0] == "file":
        return dist.FileStore(spec[1], -1)
    if spec[0] == "tcp":
        _, host, port, prefix = spec
        store = dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=60),
                              wait_for_workers=False)
        return dist.PrefixStore(f"{prefix}mesh/", store)
    raise ValueError(f"unknown store {spec!r}")


def _bind_gloo(plan: MeshPlan, device: torch.device) -> None:
    """Gloo (and NCCL's bootstrap) bind to loopback on one host, to the run's interface across hosts."""
    ifname = plan.ifname or "lo"
    os.environ["GLOO_SOCKET_IFNAME"] = ifname
    if device.type == "cuda":
        os.environ["NCCL_SOCKET_IFNAME"] = ifname  # NCCL's bootstrap sockets (its data takes NVLink / IB)


def _quiet() -> None:
    """What torch says in a stage process that is no news to a pipeq user: FSDP2's warning that a
    sharded stage's output is a view (pipeq never writes into a stage's output: it detaches it and
    sends it on), and DTensor's notes on gathering a 2-D piece in two steps (a state read whole)."""
    import logging
    import warnings

    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)


class StageMesh:
    """This process's slice (a torch process group and its DeviceMesh, None for a slice of one
    process) and the store its replicate group meets in (see the module)."""

    def __init__(self, plan: MeshPlan, device: torch.device) -> None:
        import torch.distributed as dist

        self.plan, self.device = plan, device
        _bind_gloo(plan, device)
        _quiet()
        self.store = open_store(plan.store)
        self.mesh: Any = None
        self.tp_group: Any = None  # the CPU group of this process's tp row (the shard link's)
        if plan.slice_size == 1:
            return
        backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
        prefix = f"{plan.place}/slice{plan.slice}/gen{plan.generation}/"
        dist.init_process_group(backend, store=dist.PrefixStore(prefix, self.store), rank=plan.slice_rank,
                                world_size=plan.slice_size, timeout=GROUP_TIMEOUT)
        from torch.distributed.device_mesh import DeviceMesh

        names, sizes = zip(*plan.dims())
        self.mesh = DeviceMesh(device.type, torch.arange(plan.slice_size).reshape(sizes), mesh_dim_names=names)
        if plan.shards > 1:
            self.tp_group = self._tp_cpu_group()

    def _tp_cpu_group(self) -> Any:
        """The gloo group of this process's tp row: the mesh's on the CPU; with CUDA, one of its
        own (every row made by every process of the slice, in order)."""
        import torch.distributed as dist

        if self.device.type != "cuda":
            return self.mesh["tp"].get_group()
        t, mine = self.plan.shards, None
        for row in range(self.plan.shard_size):
            group = dist.new_group(list(range(row * t, (row + 1) * t)), backend="gloo", timeout=GROUP_TIMEOUT)
            if row == self.plan.slice_rank // t:
                mine = group
        return mine

    @property
    def tp_mesh(self) -> Any:
        return self.mesh["tp"] if self.mesh is not None and self.plan.shards > 1 else None

    @property
    def shard_mesh(self) -> Any:
        return self.mesh["shard"] if self.mesh is not None and self.plan.shard_size > 1 else None

    def all_reduce(self, t: torch.Tensor, op: str) -> None:
        """``t`` (a CPU tensor) reduced over the slice: ``"sum"``, ``"max"`` or ``"min"``."""
        if self.mesh is None:
            return
        import torch.distributed as dist

        ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
        if self.device.type == "cuda":
            dev = t.to(self.device)
            dist.all_reduce(dev, op=ops[op])
            t.copy_(dev.cpu())
        else:
            dist.all_reduce(t, op=ops[op])

    def replica_group(self, name: str, wait: Waiter | None = None) -> "ReplicaGroup | None":
        """This process's replicate group for one of its stages (None with one slice)."""
        if self.plan.slices == 1:
            return None
        return ReplicaGroup(self.store, f"{self.plan.place}/{name}/rank{self.plan.slice_rank}", self.plan.slice,
                            self.device, wait or _plain_wait)

    def close(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


class ReplicaGroup:
    """The replicate dimension of one stage of a process: the same slice rank in every live slice,
    a torch process group (gloo; NCCL for CUDA tensors) that :meth:`form` makes for a membership,
    again after a replica is lost or rebuilt. Members are slice numbers; ``me`` is this process's.

    A group is made once every member has arrived in the store under its name (each waits through
    ``wait``, so a driver's EXIT still reaches a process that waits for a member that will never
    come); a name is used once (``tag``), so a rebuilt process never meets a stale group."""

    def __init__(self, store: Any, name: str, me: int, device: torch.device, wait: Waiter) -> None:
        self.store, self.name, self.me, self.device, self.wait = store, name, me, device, wait
        self.members: list[int] = []
        self.tag = ""
        self.backend: Any = None

    @property
    def rank(self) -> int:
        return self.members.index(self.me)

    @property
    def size(self) -> int:
        return len(self.members)

    def form(self, members: Sequence[int], tag: str) -> None:
        """Make the group of ``members`` (this process among them) under ``tag``. CUDA members on
        GPUs of their own sum with NCCL (on the device); members that share a GPU (NCCL refuses
        them: a test on one GPU) sum with gloo, through host memory, which is said once."""
        import torch.distributed as dist

        members = sorted(members)
        if self.me not in members:
            raise ValueError(f"{self.name}: slice {self.me} is not among the members {members}")
        self.abort()
        self.members, self.tag = members, tag
        if len(members) == 1:
            self.backend = None
            return
        base = f"{self.name}/{tag}/m{'.'.join(map(str, members))}/"
        here = [f"{base}here{m}" for m in members]
        mine = f"{self.device.type}:{self.device.index if self.device.type == 'cuda' else 0}"
        self.store.set(here[self.rank], mine)
        self.wait(lambda: self.store.check(here), f"the other replicas to meet ({tag})")
        store = dist.PrefixStore(base, self.store)
        devices = [self.store.get(key).decode() for key in here]
        if self.device.type == "cuda" and len(set(devices)) == len(devices):
            self.backend = dist.ProcessGroupNCCL(store, self.rank, len(members), dist.ProcessGroupNCCL.Options())
            return
        if self.device.type == "cuda":
            _say_once(f"pipeq: the replicas of a stage share {mine} (NCCL needs a GPU for each): their gradients are "
                      "summed with gloo, through host memory")
        self.backend = dist.ProcessGroupGloo(store, self.rank, len(members), GROUP_TIMEOUT)

    def all_reduce(self, t: torch.Tensor, op: str = "sum") -> Any:
        """Start a sum (or ``"min"``) of ``t`` in place over the group: its Work (None with one member)."""
        if self.backend is None:
            return None
        import torch.distributed as dist

        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MIN if op == "min" else dist.ReduceOp.SUM
        return self.backend.allreduce([t], opts)

    def broadcast(self, t: torch.Tensor, root: int) -> Any:
        """Start a broadcast of member ``root``'s ``t``: its Work (None with one member)."""
        if self.backend is None:
            return None
        import torch.distributed as dist

        opts = dist.BroadcastOptions()
        opts.rootRank = self.members.index(root)
        opts.rootTensor = 0
        return self.backend.broadcast([t], opts)

    def all_gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        """Every member's ``t``, in member order (waited for)."""
        if self.backend is None:
            return [t]
        out = [torch.empty_like(t) for _ in self.members]
        self.finish([self.backend.allgather([out], [t])], "the replicas' exchange")
        return out

    def finish(self, works: Sequence[Any], what: str) -> None:
        """Wait for ``works`` (None entries: nothing), serving the process meanwhile; a failed
        collective raises :class:`CollectiveError`."""
        works = [w for w in works if w is not None]
        if not works:
            return
        self.wait(lambda: all(w.is_completed() for w in works), what)
        for w in works:
            try:
                w.wait()
            except Exception as exc:
                raise CollectiveError(f"{self.name}: {what} failed: {str(exc).splitlines()[0][:200]}") from exc

    def abort(self) -> None:
        """Leave the current group (its pending collectives fail: NCCL's are aborted)."""
        backend, self.backend = self.backend, None
        if backend is not None and hasattr(backend, "abort"):
            try:
                backend.abort()
            except Exception:  # already broken: nothing left to abort
                pass


_said: set[str] = set()


def _say_once(line: str) -> None:
    import sys

    if line not in _said:
        _said.add(line)
        print(line, file=sys.stderr)


class CollectiveError(RuntimeError):
    """A collective of a replicate group failed (a member is gone)."""


#: what torch's backends say when a peer of a collective is gone (gloo's pair, NCCL's watchdog)
_PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "remote process exited",
              "Socket closed")


def peer_failure(exc: BaseException) -> bool:
    """Whether ``exc`` (or what it was raised from) is a collective's peer gone: the peer's
    failure, not this process's."""
    seen: BaseException | None = exc
    for _ in range(8):
        if seen is None:
            return False
        if isinstance(seen, CollectiveError) or any(m in str(seen) for m in _PEER_GONE):
            return True
        seen = seen.__cause__ or seen.__context__
    return False
