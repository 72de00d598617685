"""Data parallelism's channel: stage k of one replica to stage k of every other replica.

::

    stage k, replica r <--replicas (PUSH->PULL, both ways)--> stage k, replica r'

What travels is gradient buckets, and replica 0's weights at start (:mod:`pipeq.parallel.data`).
"""

from __future__ import annotations

import struct
from typing import Any, Sequence

import torch
import zmq

from pipeq.wire import codec
from pipeq.wire.errors import ProtocolError
from pipeq.wire.messages import Kind
from pipeq.wire.security import FrameMac, seals_data
from pipeq.wire.sockets import BindTo, data_inlet, data_outlet
from pipeq.wire.stage_inbox import SLICE_MS
from pipeq.wire.stage_link import StageTransport

__all__ = ["ReplicaLink"]


class ReplicaLink:
    """Stage k's channel to the same stage of the other replicas (data parallelism).

    Replica r of stage k binds one more inbound socket (PULL, where its :class:`BindTo` says; on
    tcp it demands the job's keys like the data channels, and its frames are capped alike) and,
    once told its siblings' addresses (:meth:`connect`), pushes to each of them on a socket of its
    own. What travels is whole tensors for one ``(step, index)``: the gradient buckets of a step,
    replica 0's weights at start. A message is::

        [origin, header, tensor frames...]           ipc, or tcp "encrypt" (CURVE)
        [origin, seq + MAC, header, tensor frames...]  tcp "authenticate"

    where ``origin`` is the sender's replica number (4 bytes, big-endian). In "authenticate" mode
    it picks the :class:`~pipeq.wire.security.FrameMac` of the link ``origin -> this replica`` (its
    label names the stage and both ends), so a message verifies only on the link it was sealed for; a
    forged, replayed or misdirected one is dropped without a word, like on the pipeline's channels.

    Arrivals are filed under ``(sender, step, index)`` (at most ``capacity`` at once);
    :meth:`wait` blocks for one, and an EXIT from the driver (read from the stage's control
    socket, which it polls too) interrupts it with :class:`~pipeq.wire.errors.Stopped`: a replica
    whose sibling died waits until the driver, which watches every process, ends the run. The link
    shares the stage transport's ZeroMQ context (and so its ZAP handler); close it before the transport.
    """

    def __init__(self, transport: StageTransport, bind: BindTo, *, stage: int, replica: int, replicas: int,
                 capacity: int, shard: int = 0) -> None:
        """``shard``: with tensor parallelism, the stage's shard this link sums (its MACs name it)."""
        if not 0 <= replica < replicas:
            raise ValueError(f"replica {replica} of {replicas}")
        tcp = bind.scheme == "tcp"
        if tcp and transport.auth is None:
            raise ValueError("a replica link bound on tcp needs the job's secret (WireAuth)")
        self.transport = transport
        self.stage = stage
        self.shard = shard
        self.replica = replica
        self.replicas = replicas
        self.capacity = capacity
        auth = transport.auth
        self.sock = data_inlet(transport.ctx, auth, tcp, transport.max_frame_bytes)
        self.address = bind.bind(self.sock, f"s{transport.process}-replicas")
        others = [r for r in range(replicas) if r != replica] if seals_data(auth, tcp) else []
        self._mac_in = {r: FrameMac(auth, self._label(r, replica)) for r in others}  # type: ignore[arg-type]
        self._mac_out = {r: FrameMac(auth, self._label(replica, r)) for r in others}  # type: ignore[arg-type]
        self._origin = struct.pack(">I", replica)
        self._out: dict[int, zmq.Socket] = {}
        self._inbox: dict[tuple[int, int, int], Sequence[torch.Tensor]] = {}
        self._bad_origin = 0
        self.poller = zmq.Poller()
        self.poller.register(self.sock, zmq.POLLIN)
        self.poller.register(transport.ctrl, zmq.POLLIN)
        # data keeps being filed while this replica waits: a neighbour waiting for one of this
        # stage's shared-memory slots to come free must not wait on the all-reduce
        self.poller.register(transport.fwd_in, zmq.POLLIN)
        self.poller.register(transport.bwd_in, zmq.POLLIN)

    def _label(self, sender: int, receiver: int) -> str:
        return f"R{self.stage}" + (f".{self.shard}" if self.shard else "") + f":{sender}>{receiver}"

    def connect(self, addresses: Sequence[str]) -> None:
        """Connect to every other replica; ``addresses[r]`` is replica r's bound address."""
        if len(addresses) != self.replicas or not all(type(a) is str for a in addresses):
            raise ValueError(f"stage {self.stage}, replica {self.replica}: expected the addresses of "
                             f"{self.replicas} replicas, got {addresses!r}")
        for r, addr in enumerate(addresses):
            if r == self.replica or r in self._out:
                continue
            self._out[r] = data_outlet(self.transport.ctx, self.transport.auth, addr)

    @property
    def dropped(self) -> int:
        """Inbound messages dropped as forged, replayed or misdirected ("authenticate" mode)."""
        return self._bad_origin + sum(m.dropped for m in self._mac_in.values())

    # -- sending -------------------------------------------------------------------------------
    def send(self, step: int, index: int, tensors: Sequence[torch.Tensor], to: Sequence[int] | None = None) -> None:
        """Send ``tensors`` (CPU tensors ZeroMQ may read until it is done with them: never
        modify them after) as ``(step, index)`` to replicas ``to`` (default: every other one).
        Does not block (short of ZeroMQ's high-water mark, far above what a step sends)."""
        frames = codec.encode(Kind.REPLICA, step, index, tensors)
        for i, f in enumerate(frames[1:]):
            if f.nbytes > self.transport.max_frame_bytes:
                raise ValueError(
                    f"stage {self.stage}, replica {self.replica}: tensor {i} of message ({step}, {index}) to the "
                    f"other replicas is {f.nbytes / 2**20:.1f} MiB, over the "
                    f"{self.transport.max_frame_bytes / 2**20:.0f} MiB cap of a data frame")
        targets = [r for r in range(self.replicas) if r != self.replica] if to is None else to
        for r in targets:
            sock = self._out.get(r)
            if sock is None:
                raise RuntimeError(f"stage {self.stage}, replica {self.replica}: not connected to replica {r}")
            mac = self._mac_out.get(r)
            sock.send_multipart([self._origin, *(mac.seal(frames) if mac is not None else frames)], copy=False)

    # -- receiving -----------------------------------------------------------------------------
    def _sender(self, frame: Any) -> int | None:
        head = memoryview(frame).tobytes()
        if len(head) == 4:
            (r,) = struct.unpack(">I", head)
            if r < self.replicas and r != self.replica:
                return r
        return None

    def _drain(self) -> None:
        """File every message waiting on the inbound socket."""
        while True:
            try:
                frames = self.sock.recv_multipart(flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            sender = self._sender(frames[0])
            body: Sequence[Any] | None = frames[1:]
            if self._mac_in:
                if sender is None:
                    self._bad_origin += 1
                    continue
                body = self._mac_in[sender].open(frames[1:])
                if body is None:
                    continue  # forged, replayed or sealed for another link: dropped
            elif sender is None:  # only the job's processes get this far: a bug, not an attack
                raise ProtocolError(f"stage {self.stage}, replica {self.replica}: a message from the other "
                                    f"replicas names no valid sender ({memoryview(frames[0]).tobytes()!r})")
            self._file(sender, body)  # type: ignore[arg-type]

    def _file(self, sender: int, body: Sequence[Any]) -> None:
        """Decode a message from replica ``sender`` and keep its tensors until :meth:`wait` asks."""
        msg = codec.decode(body)
        if msg.kind is not Kind.REPLICA:
            raise ProtocolError(f"stage {self.stage}, replica {self.replica}: {msg.kind.name} on the "
                                "replicas' channel")
        key = (sender, msg.step, msg.microbatch)
        if key in self._inbox:
            raise ProtocolError(f"stage {self.stage}, replica {self.replica}: duplicate message "
                                f"({msg.step}, {msg.microbatch}) from replica {sender}")
        if len(self._inbox) >= self.capacity:
            raise ProtocolError(f"stage {self.stage}, replica {self.replica}: {self.capacity} messages "
                                "from the other replicas are waiting; one is running ahead")
        self._inbox[key] = msg.tensors

    def wait(self, sender: int, step: int, index: int) -> Sequence[torch.Tensor]:
        """Block until replica ``sender``'s message ``(step, index)`` is here and return its
        tensors (views over the received frames: this replica's to keep, and to write to).
        An EXIT from the driver interrupts the wait (:class:`~pipeq.wire.errors.Stopped`)."""
        key = (sender, step, index)
        got = self._inbox.pop(key, None)
        slice_ms = 5 if self.transport.has_lanes else SLICE_MS  # lanes are not in this poller: look often
        while got is None:
            events = dict(self.poller.poll(slice_ms))
            if self.sock in events:
                self._drain()
            self.transport.file_ready(events)  # commands and data queue up for the event loop
            got = self._inbox.pop(key, None)
            if got is None:
                self.transport.check_exit()
        return got

    def close(self, linger_ms: int = 0) -> None:
        for s in (self.sock, *self._out.values()):
            s.close(linger=linger_ms)
        self._out.clear()
