"""``fault_tolerance="replicas"``, a stage's side: which replicas each gradient round sums.

A stage's copies in the replicate slices sum their gradients in a torch process group
(:class:`~pipeq.parallel.mesh.ReplicaGroup`). When a replica is lost, the driver's LOST names it
and the first round it misses (``from_round``: the round of the oldest step outstanding); the
stages of the other slices go on in a group rebuilt without the lost replica's slice, as TorchFT
does (abort, and a new group under a new name), and the driver stops the lost replica's
processes once every survivor ACKed the LOST, naming the rounds it summed with the lost replica
(:mod:`pipeq.control.replica_loss` keeps the record).

A round is a ring all-reduce: when a member dies during one, some survivors may finish it and
others not. So that every survivor of a stage sums the same replicas, with fault tolerance each
round ends with a *confirm* (a one-element MIN all-reduce over the same group): a survivor whose
confirm completes knows that every member's sum completed. Any other ends in :meth:`Membership.settle`:

1. it waits for the LOST that explains the failure, and makes the new group of the live slices
   (every survivor names it alike: the lost replica and its ``from_round``);
2. the first collective of the new group is an exchange of each member's round and status:
   ``OK`` (its sum completed), ``FAILED``, or ``FRESH`` (a member that learned of the loss
   between rounds and starts this round in the new group);
3. a round is kept, summed with the lost replica, when a member is past it (its confirm
   completed, so every sum of it did) or when every member's sum of it completed; else every
   member sums it again in the new group, without the lost replica (its sum scaled by
   :func:`~pipeq.parallel.data.survivor_scale`).

A member can be at most one round ahead of another (a round's confirm needs everyone), so the
rule decides alike everywhere. The round before ``from_round`` still sums the lost replica where
its process of the stage is alive and delivers (a slow first stage finishing the step before).
A lost replica's own stages that still run part: one that has not issued the round before
``from_round`` and waits (for anything) while a stage of its replica downstream of it is dead
gives that round up and exits (:class:`~pipeq.wire.errors.Stopped`), so that nobody waits for a
round that cannot come; its sends to a dead previous stage are dropped. REJOIN (and a rebuilt
replica's PEERS) makes the group of every slice again.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from pipeq.wire import control
from pipeq.wire.errors import Stopped
from pipeq.wire.messages import Kind

__all__ = ["Membership", "FRESH", "OK", "FAILED"]

FAILED, OK, FRESH = 0, 1, 2


class Membership:
    """Stage ``stage`` of replica ``replica`` (of ``replicas``, ``shard_size`` per slice): its
    replicate ``group``, the LOST and REJOIN notices it takes from its ``commands`` queue, and the
    ACKs it sends with ``reply`` (see the module). ``sender``: the stage's sending half (its sends
    to a dead previous stage are dropped while it parts)."""

    def __init__(self, group: Any, commands: Any, reply: Callable[[Any], None], sender: Any, *, stage: int,
                 replica: int, replicas: int, shard_size: int = 1) -> None:
        self.group, self.commands, self.reply, self.sender = group, commands, reply, sender
        self.stage, self.replica, self.replicas, self.shard_size = stage, replica, replicas, shard_size
        self.lost: dict[int, control.Lost] = {}  # lost slice -> the LOST that named it (until REJOIN)
        self.done_round = 0  # the last round summed
        self.sent_round = 0  # the last round whose buckets this stage issued
        self.summed: dict[int, list[int]] = {}  # the last rounds summed -> the replicas summed in each
        self._acks: list[tuple[int, int, int]] = []  # (the round to sum first, the LOST's request, its replica)
        self.parting: control.Lost | None = None  # this stage's own replica is lost

    @property
    def slices(self) -> int:
        return self.replicas // self.shard_size

    def slice_of(self, replica: int) -> int:
        return replica // self.shard_size

    # -- the driver's notices -------------------------------------------------------------------
    def take_notices(self) -> None:
        """Act on every LOST queued for this stage (taken out of the queue)."""
        queue = self.commands
        if not queue or not any(m.kind is Kind.LOST for m in queue):
            return
        notices = [m for m in queue if m.kind is Kind.LOST]
        rest = [m for m in queue if m.kind is not Kind.LOST]
        queue.clear()
        queue.extend(rest)
        for m in notices:
            self.lose(control.read(m, control.Lost), m.step)

    def lose(self, notice: control.Lost, request: int) -> None:
        """LOST (message step ``request``): its replica's slice is left out from ``from_round`` on;
        ACK once the rounds before are summed. This stage's own replica: it parts."""
        if self.slice_of(notice.replica) == self.slice_of(self.replica):
            self.parting = notice
            self.check_parting()
            return
        self.lost[self.slice_of(notice.replica)] = notice
        if notice.from_round is not None:
            self._acks.append((notice.from_round - 1, request, notice.replica))
            self.round_done(self.done_round)

    def check_parting(self) -> None:
        """(Wherever a wait looks for EXIT.) Parting with the round before the lost one not issued
        and a dead stage of this replica downstream: give the round up (:class:`Stopped`). With
        the previous stage dead, what this stage sends it is dropped."""
        self.take_notices()
        part = self.parting
        if part is None:
            return
        if self.stage - 1 in (part.dead or ()):
            self.sender.backward_gone = True
        if part.from_round is None or self.sent_round >= part.from_round - 1:
            return
        if any(k > self.stage for k in part.dead or ()):
            raise Stopped(f"stage {self.stage}, replica {self.replica}: gives gradient round "
                          f"{part.from_round - 1} up (its replica is lost, stages {part.dead} dead)")

    def rejoin(self, replica: int, after_round: int) -> None:
        """REJOIN: ``replica``'s slice is back (rebuilt) from round ``after_round + 1``: the group of
        every slice again."""
        from pipeq.parallel.data import rejoin_tag

        self.lost.pop(self.slice_of(replica), None)
        self.group.form(range(self.slices), rejoin_tag(self.slice_of(replica), after_round))

    # -- rounds ---------------------------------------------------------------------------------
    def round_done(self, n: int, summed: Sequence[int] | None = None) -> None:
        """Round ``n`` is summed (over the replicas ``summed``): ACK every LOST that waited for it,
        naming the rounds from there on summed with its replica."""
        self.done_round = n
        if summed is not None:
            self.summed[n] = list(summed)
            self.summed.pop(n - 8, None)  # (a LOST asks about the last two rounds at most)
        due = [(before, req, r) for before, req, r in self._acks if before <= n]
        self._acks = [a for a in self._acks if a[0] > n]
        for before, req, r in due:
            with_lost = [k for k in range(max(before, 1), n + 1) if r in self.summed.get(k, ())]
            self.reply(control.message(control.Ack(with_lost=with_lost), req))

    def _gone(self, x: int) -> list[int]:
        """The members of the group that are lost for round ``x`` (their LOST's ``from_round`` <= x)."""
        return [s for s, n in self.lost.items() if s in self.group.members and (n.from_round or 0) <= x]

    def before_round(self, x: int) -> None:
        """Round ``x`` starts: a member lost for it is left behind first (this stage is FRESH)."""
        self.take_notices()
        if self._gone(x):
            self._rebuild(x, FRESH)

    def settle(self, x: int, ok: bool, members: Sequence[int]) -> str:
        """Round ``x``'s sum in the group of ``members`` completed (``ok``) or failed: ``"keep"`` it,
        or ``"redo"`` it in the group rebuilt without the lost (see the module)."""
        if ok and len(members) > 1:
            flag = torch.ones(1, device=self.group.device)
            try:
                self.group.finish([self.group.all_reduce(flag, "min")], f"round {x}'s confirm")
                return "keep"
            except Exception as exc:
                from pipeq.parallel.mesh import CollectiveError

                if not isinstance(exc, CollectiveError):
                    raise
        elif ok:
            return "keep"
        rows = self._rebuild(x, OK if ok else FAILED)
        if any(rx > x for rx, _ in rows) or all(st == OK for rx, st in rows if rx == x):
            if not ok:
                raise RuntimeError(f"stage {self.stage}, replica {self.replica}: round {x} failed here but "
                                   f"completed elsewhere ({rows}): the replicas disagree")
            return "keep"
        return "redo"

    def _rebuild(self, x: int, status: int) -> list[tuple[int, int]]:
        """The group without the lost slices (waiting for the LOST that names one, if none is known
        yet), and every member's (round, status) exchanged in it."""
        group = self.group
        while True:
            self.check_parting()
            if self.parting is not None:
                raise Stopped(f"stage {self.stage}, replica {self.replica}: its replica is lost")
            gone = [s for s in self.lost if s in group.members]
            if gone:
                break
            group.wait(self._notice_came, f"the driver's word on round {x}'s lost replica")
        first = min(gone)
        notice = self.lost[first]
        group.form([m for m in group.members if m not in gone],
                   f"lost{notice.replica}@{notice.from_round}")
        mine = torch.tensor([x, status], dtype=torch.int64, device=self.group.device)
        return [(int(t[0]), int(t[1])) for t in group.all_gather(mine)]

    def _notice_came(self) -> bool:
        self.take_notices()
        return self.parting is not None or any(s in self.group.members for s in self.lost)
