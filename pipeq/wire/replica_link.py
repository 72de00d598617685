"""Data parallelism's channel: stage k of one replica to stage k of every other replica.

::

    stage k, replica r <--replicas (PUSH->PULL, both ways)--> stage k, replica r'

What travels is gradient buckets, and replica 0's weights at start (:mod:`pipeq.parallel.data`).
"""

from __future__ import annotations

from typing import Sequence

from pipeq.wire import control
from pipeq.wire.errors import Stopped
from pipeq.wire.group_link import GroupLink
from pipeq.wire.messages import Kind
from pipeq.wire.sockets import BindTo
from pipeq.wire.stage_inbox import StageInbox
from pipeq.wire.stage_link import StageSender

__all__ = ["ReplicaLink"]


class ReplicaLink(GroupLink):
    """Stage k's channel to the same stage of the other replicas (data parallelism): a
    :class:`~pipeq.wire.group_link.GroupLink` whose members are the replicas, numbered from 0.

    Replica r of stage k binds one more inbound socket and pushes to each sibling on a socket of
    its own. What travels is whole tensors for one ``(step, index)``: the gradient buckets of a
    step, replica 0's weights at start. In "authenticate" mode a message's MAC is that of the link
    ``origin -> this replica`` (its label names the stage, the shard and both ends).

    With ``fault_tolerance="replicas"`` the driver's LOST names a replica that is gone and the
    first gradient round it misses: :meth:`wait_replica` gives up on it at once for that round
    and later ones, even in the middle of a wait (the notice is taken from the stage's queued
    commands), but still waits for its buckets of an earlier round, which its processes, still
    running, send; unless its process of this stage is dead (LOST's ``dead``): then what it sent
    before it died is all there is. The stage ACKs the LOST once its rounds before the first one
    missed are summed (:meth:`round_done`), naming the rounds from there on it summed with the lost
    replica: only then does the driver stop the lost replica's other processes. REJOIN brings the
    replica back.

    The lost replica's own stages that still run get the LOST too (they are parting). One that
    has not sent its buckets of the round before ``from_round`` and finds itself waiting (for
    anything) while a stage of its replica downstream of it is dead gives that round up at once:
    it raises :class:`~pipeq.wire.errors.Stopped` and its process exits, which the driver tells the
    other replicas (``dead``), so that none of them waits for a round that cannot come. One with
    no dead stage downstream finishes the round (its inputs still come) and sends its buckets; its
    sends to a dead previous stage are dropped (``StageSender.backward_gone``:
    that stage's shared-memory slots are never freed again)."""

    def __init__(self, receiver: StageInbox, sender: StageSender, bind: BindTo, *, stage: int, replica: int,
                 replicas: int, capacity: int, shard: int = 0) -> None:
        """``receiver``, ``sender``: the stage's own channels (the link reads LOST notices from
        its commands and ACKs them); ``shard``: with tensor parallelism, the stage's shard this
        link sums (its MACs name it)."""
        if not 0 <= replica < replicas:
            raise ValueError(f"replica {replica} of {replicas}")
        self.stage, self.shard = stage, shard
        self.replica, self.replicas = replica, replicas
        self.commands, self.reply = receiver.control_queue, sender.send_control
        self._out_of_stage = sender  # (its sends to the previous stage: see _check_parting)
        prefix = f"R{stage}" + (f".{shard}" if shard else "")
        super().__init__(receiver.inbox, bind, auth=receiver.auth, max_frame_bytes=receiver.max_frame_bytes,
                         me=replica, members=range(replicas), kind=Kind.REPLICA, capacity=capacity,
                         label=lambda a, b: f"{prefix}:{a}>{b}", who=f"stage {stage}, replica {replica}",
                         peer="replica", socket_name=f"s{receiver.process}-replicas")
        self.dead: set[int] = set()  # lost replicas whose process of this stage is dead
        self.done_round = 0  # the last gradient round summed (pipeq.parallel.data.GradSync)
        self.sent_round = 0  # the last gradient round whose buckets this stage sent
        self.summed: dict[int, list[int]] = {}  # the last rounds summed -> the replicas summed in each
        # LOSTs to ACK: (the round to sum first, their step, the lost replica)
        self._acks: list[tuple[int, int, int]] = []
        self.parting: control.Lost | None = None  # this stage's own replica is lost (see the class)
        receiver.inbox.on_check(self._check_parting)

    def connect(self, addresses: Sequence[str | None]) -> None:
        """Connect to every other replica; ``addresses[r]`` is replica r's bound address."""
        if len(addresses) != self.replicas or not all(type(a) is str for a in addresses):
            raise ValueError(f"stage {self.stage}, replica {self.replica}: expected the addresses of "
                             f"{self.replicas} replicas, got {addresses!r}")
        super().connect(addresses)

    def take_notices(self) -> None:
        """Act on every LOST the driver has sent that is queued for the event loop (and take it
        out of the queue): that replica is forgotten until it rejoins (this stage's own: it parts)."""
        queue = self.commands
        if not queue or not any(m.kind is Kind.LOST for m in queue):
            return
        notices = [m for m in queue if m.kind is Kind.LOST]
        rest = [m for m in queue if m.kind is not Kind.LOST]
        queue.clear()
        queue.extend(rest)
        for m in notices:  # out of the queue first: lose() looks at it again (_check_parting)
            self.lose(control.read(m, control.Lost), m.step)

    def lose(self, notice: control.Lost, request: int) -> None:
        """LOST (message step ``request``): forget its replica for the rounds from its
        ``from_round`` on (for every round when it has none, or when this stage is among its
        ``dead`` and nothing more comes); ACK once the rounds before are summed. This stage's
        own replica: it is parting (see the class)."""
        if notice.replica == self.replica:
            self.parting = notice
            self._check_parting()
            return
        self.forget(notice.replica, notice.from_round or 0)
        if self.stage in (notice.dead or ()):
            self.dead.add(notice.replica)
        if notice.from_round is not None:
            self._acks.append((notice.from_round - 1, request, notice.replica))
            self.round_done(self.done_round)

    def _check_parting(self) -> None:
        """(Where a wait looks for EXIT.) Parting, with the round before the lost one unsent and a
        dead stage of this replica downstream: give the round up (:class:`Stopped`). With the
        previous stage dead, what this stage sends it is dropped (a send never waits for room there)."""
        self.take_notices()
        part = self.parting
        if part is not None and self.stage - 1 in (part.dead or ()):  # sends there could wait for ever
            self._out_of_stage.backward_gone = True
        if part is None or part.from_round is None or self.sent_round >= part.from_round - 1:
            return
        if any(k > self.stage for k in part.dead or ()):
            raise Stopped(f"stage {self.stage}, replica {self.replica}: gives gradient round "
                          f"{part.from_round - 1} up (its replica is lost, stages {part.dead} dead)")

    def round_done(self, n: int, summed: Sequence[int] | None = None) -> None:
        """Gradient round ``n`` is summed (over the replicas ``summed``): ACK every LOST that
        waited for it, naming the rounds from there on summed with its replica."""
        self.done_round = n
        if summed is not None:
            self.summed[n] = list(summed)
            self.summed.pop(n - 8, None)  # (a LOST asks about the last two rounds at most)
        due = [(before, req, r) for before, req, r in self._acks if before <= n]
        self._acks = [a for a in self._acks if a[0] > n]
        for before, req, r in due:
            with_lost = [k for k in range(max(before, 1), n + 1) if r in self.summed.get(k, ())]
            self.reply(control.message(control.Ack(with_lost=with_lost), req))

    def skips(self, sender: int, step: int) -> bool:
        """Whether round ``step`` goes on without replica ``sender`` (once what it sent is read)."""
        return step >= self.gone.get(sender, step + 1) or (sender in self.gone and sender in self.dead)

    def wait_replica(self, sender: int, step: int, index: int) -> Sequence | None:
        """Replica ``sender``'s message ``(step, index)``, or None once it is known that it
        will not come (its replica is lost for that round, or its process is dead)."""
        gave_up = False

        def lost() -> bool:
            nonlocal gave_up
            self.take_notices()
            if not self.skips(sender, step):
                return False
            if step < self.gone[sender]:  # its process died: what it sent may be in the socket still
                self.drain()
                if (sender, step, index) in self.queue:
                    return False
            gave_up = True
            return True

        got = self.wait(sender, step, index, give_up=lost)
        return None if gave_up else got

    def rejoin(self, member: int, address: str, after_step: int) -> None:
        self.dead.discard(member)
        super().rejoin(member, address, after_step)
