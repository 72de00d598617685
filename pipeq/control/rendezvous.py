"""Multi-host rendezvous: who is node 0, where the store is, which stages run where.

pipeq reuses torch.distributed's rendezvous store (the ``TCPStore`` torchrun uses) instead of
inventing one. Node 0 runs the driver (the control plane) and hosts the store, unless torchrun's
agent already hosts it; the driver publishes its control address and the stage placement there.
Every other node runs an agent (:mod:`pipeq.launch.agent`) that reads them and starts its stages; each
stage publishes its own endpoints. Activations then flow directly between neighbour stages.

Settings follow torchrun's conventions, flags first, then the environment::

    --nnodes      WORLD_SIZE   SLURM_NTASKS       how many pipeq nodes (agents) there are
    --node-rank   RANK         SLURM_PROCID       this node's rank (0 runs the driver)
    --master-addr MASTER_ADDR                     where the store is (node 0)
    --master-port MASTER_PORT                     its port
                  LOCAL_RANK, LOCAL_WORLD_SIZE    ranks sharing this host split its CPU cores/GPUs

Under torchrun every worker process is one pipeq node, so ``torchrun --nproc-per-node 2 -m
pipeq launch job.toml`` gives two nodes on one host.

Every node needs the job's secret (``--secret-file`` or ``PIPEQ_SECRET``: :mod:`pipeq.wire.keys`).
Anyone who can reach the store's port can read and write it, so every entry a node publishes is
signed (:meth:`Rendezvous.sign`: an HMAC of the entry's full key and its JSON value) and every
entry a node reads is checked (:meth:`Rendezvous.read`); an entry that does not verify is
ignored, whoever wrote it. A store ``set`` overwrites, so a reader waits for a valid entry
instead of giving up on a forged one, and node 0 writes its entries again every half second
while the run starts (:class:`Republisher`)::

    node 0 (driver):  "control", "placement", "job", "options"   (re-published until all READY,
                                                                  then removed)
    node r (agent):   "agent/r"                                  (node 0 names a node with
    stage process g:  "stage/g"                                   another secret from these)

A run that restarts (``--max-restarts``, multi-host: :mod:`pipeq.launch.elastic`) starts its
stages again as a new *generation* n: its entries live under ``g<n>/`` (:attr:`Rendezvous.prefix`),
so an entry of an earlier start, signed for its own full key, never verifies as one of this
start's; node 0 keeps the signed entry "generation" (``{"generation": n, "rejoin_timeout": s}``,
outside every generation) pointing at the start the agents are to join, and each agent says it
is there for it with "g<n>/agent/r".
"""

from __future__ import annotations

import dataclasses
import datetime
import ipaddress
import os
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from pipeq.control.waiting import THREAD_STOP_S
from pipeq.wire.keys import HOW_TO_MAKE, JobSecret
from pipeq.wire.netif import interface_address

DEFAULT_PORT = 29500
#: A value no signed entry can have: :func:`peek` reads a key's value without waiting with it.
_ABSENT = b"\0pipeq: no entry"
#: What :meth:`Rendezvous.read` found under a key.
VALID, FOREIGN, MISSING = "valid", "foreign", "missing"
#: Node 0's entry naming the generation (start) of the run the agents are to join.
GENERATION = "generation"


@dataclass
class Rendezvous:
    """Where a multi-host run meets, and who this node is: what ``PipelineRunner(...,
    rendezvous=...)`` takes on node 0 (``pipeq launch`` makes one from its flags). Build it with
    :meth:`from_settings`, which reads the flags' values or torchrun's / SLURM's environment."""

    nnodes: int
    node_rank: int
    master_addr: str
    master_port: int
    bind: str  # the address this node's processes bind to and tell their peers
    run_id: str = "pipeq"
    # the store is hosted elsewhere (torchrun's elastic agent, or node 0's pipeq.launch.elastic for a
    # run that restarts): connect as a client
    agent_store: bool = False
    local_rank: int | None = None
    local_world_size: int | None = None
    secret: JobSecret | None = None  # the job's secret: keys of every socket, store signatures
    generation: int = 0  # which start of the run (a restart is a new one): its entries' namespace
    nodes: tuple[int, ...] | None = None  # the nodes that take part (None: all; fewer after a re-placement)

    @classmethod
    def from_settings(
        cls,
        nnodes: int | None = None,
        node_rank: int | None = None,
        master_addr: str | None = None,
        master_port: int | None = None,
        bind: str | None = None,
        run_id: str | None = None,
        env: Mapping[str, str] | None = None,
        secret_file: str | None = None,
    ) -> "Rendezvous | None":
        """The rendezvous from flags, then torchrun's / SLURM's variables; None for one host.

        A multi-host run needs the job's secret (:attr:`Rendezvous.secret`): from ``secret_file``
        (which only its owner may read), else ``$PIPEQ_SECRET``; without one it is refused with a
        ValueError that says how to make one. One host needs none (the runner makes its own)."""
        env = os.environ if env is None else env
        nnodes = nnodes if nnodes is not None else _env_int(env, "WORLD_SIZE", "SLURM_NTASKS")
        if nnodes is None or nnodes == 1 and node_rank in (None, 0) and master_addr is None:
            if bind is not None:
                raise ValueError("--bind only applies to multi-host runs (--nnodes > 1)")
            return None
        if nnodes < 1:
            raise ValueError(f"nnodes must be at least 1, got {nnodes}")
        node_rank = node_rank if node_rank is not None else _env_int(env, "RANK", "SLURM_PROCID")
        if node_rank is None:
            raise ValueError(
                f"a {nnodes}-node run needs this node's rank: pass --node-rank (or set RANK / SLURM_PROCID)"
            )
        if not 0 <= node_rank < nnodes:
            raise ValueError(f"node rank {node_rank} is outside 0..{nnodes - 1} (nnodes={nnodes})")
        master_addr = master_addr or env.get("MASTER_ADDR")
        if not master_addr:
            raise ValueError(
                "a multi-host run needs node 0's address: pass --master-addr (or set MASTER_ADDR)"
            )
        if master_port is None:
            master_port = _env_int(env, "MASTER_PORT") or DEFAULT_PORT
        if not 0 < master_port < 65536:
            raise ValueError(f"master port {master_port} is not a TCP port")
        run_id = run_id or env.get("TORCHELASTIC_RUN_ID") or env.get("SLURM_JOB_ID") or "pipeq"
        secret = JobSecret.load(secret_file, env)
        if secret is None:
            raise ValueError(f"a multi-host run needs the job's secret on every node: {HOW_TO_MAKE}")
        return cls(
            nnodes=nnodes,
            node_rank=node_rank,
            master_addr=master_addr,
            master_port=master_port,
            bind=resolve_bind(bind, master_addr, master_port),
            run_id=run_id,
            agent_store=env.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true",
            local_rank=_env_int(env, "LOCAL_RANK"),
            local_world_size=_env_int(env, "LOCAL_WORLD_SIZE"),
            secret=secret,
        )

    @property
    def prefix(self) -> str:
        """Where this generation's entries are (generation 0's where a run without restarts has them)."""
        return f"pipeq/{self.run_id}/" + (f"g{self.generation}/" if self.generation else "")

    def at(self, generation: int, **changes: Any) -> "Rendezvous":
        """This rendezvous for the run's ``generation`` (and ``changes`` to other fields)."""
        return dataclasses.replace(self, generation=generation, **changes)

    def store(self, timeout: float, *, client: bool = False):  # -> torch.distributed.Store
        """The rendezvous store: hosted here on node 0 (unless torchrun's agent hosts it, or
        ``client``: another connection to it, e.g. node 0's :class:`Republisher`)."""
        from torch.distributed import PrefixStore, TCPStore

        host = self.node_rank == 0 and not self.agent_store and not client
        if not host:
            self._wait_for_store(timeout)
        try:
            base = TCPStore(self.master_addr, self.master_port, is_master=host,
                            timeout=datetime.timedelta(seconds=timeout), wait_for_workers=False)
        except Exception as exc:  # RuntimeError / DistNetworkError, with a long C++ message
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            what = "host" if host else "reach"
            raise RuntimeError(
                f"node {self.node_rank}: cannot {what} the rendezvous store at "
                f"{self.master_addr}:{self.master_port} ({first}); check --master-addr/--master-port "
                "and that node 0 is started" + (" (is the port already in use?)" if host else "")
            ) from None
        return PrefixStore(self.prefix, base)

    def on(self, store: Any) -> Any:
        """``store`` (a connection to this run's store, at any generation's prefix) at this
        generation's prefix: the same connection, no new one."""
        from torch.distributed import PrefixStore

        return PrefixStore(self.prefix, getattr(store, "underlying_store", store))

    def _wait_for_store(self, timeout: float) -> None:
        """Wait until the store's port accepts connections (quietly: TCPStore's own retries log
        a C++ stack trace per attempt)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                socket.create_connection((self.master_addr, self.master_port), timeout=1.0).close()
                return
            except OSError as exc:
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"node {self.node_rank}: no rendezvous store at {self.master_addr}:"
                        f"{self.master_port} after {timeout:.0f} s ({exc}); is node 0 started, and "
                        "are --master-addr/--master-port the same on every node?"
                    ) from None
                time.sleep(0.2)

    def store_address(self) -> tuple[str, int, str]:
        return (self.master_addr, self.master_port, self.prefix)

    # -- signed entries ------------------------------------------------------------------------
    def _secret(self) -> JobSecret:
        if self.secret is None:
            raise ValueError(f"node {self.node_rank}: a multi-host run needs the job's secret: {HOW_TO_MAKE}")
        return self.secret

    def sign(self, key: str, value: object) -> bytes:
        """``value`` (JSON-able) as the store entry ``key``, signed with the job's secret. The
        signature covers the full key (run id included): an entry moved to another key or run
        does not verify."""
        return self._secret().sign(self.prefix + key, value)

    def verify(self, key: str, raw: bytes) -> tuple[bool, object]:
        """``(True, value)`` if ``raw`` is entry ``key`` signed with this node's secret, else
        ``(False, None)`` (unsigned, another secret's, moved from another key, malformed)."""
        return self._secret().verify(self.prefix + key, raw)

    def read(self, store: Any, key: str) -> tuple[str, object]:
        """Entry ``key`` of ``store`` now, without waiting: ``(VALID, value)``, ``(FOREIGN,
        None)`` if what is there is not signed with this node's secret, ``(MISSING, None)``."""
        raw = peek(store, key)
        if raw is None:
            return MISSING, None
        ok, value = self.verify(key, raw)
        return (VALID, value) if ok else (FOREIGN, None)


def peek(store: Any, key: str) -> bytes | None:
    """``key``'s value in ``store`` now, or None if it has none. Never waits: a ``get`` of a
    missing key waits for it (up to the store's timeout), and a foreign client may delete a key
    between a ``check`` and a ``get``. A ``compare_set`` whose expected and new values are both
    ``_ABSENT`` changes nothing and answers the current value (or ``_ABSENT`` if there is none)."""
    raw = bytes(store.compare_set(key, _ABSENT, _ABSENT))
    return None if raw == _ABSENT else raw


class Republisher:
    """Node 0's signed entries, written again every ``interval`` seconds until :meth:`stop`.

    Any client of the store may overwrite or delete an entry; readers ignore what does not
    verify and keep polling, and this puts the real entry back, so a forger cannot stall the
    start. It runs in a daemon thread with its own store connection (a TCPStore client is not
    shared between threads); connection errors are retried, never raised.
    """

    def __init__(self, rz: Rendezvous, entries: Mapping[str, bytes], *, interval: float = 0.5,
                 timeout: float = 10.0) -> None:
        self.rz = rz
        self.entries = dict(entries)
        self.interval = interval
        self.timeout = timeout
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pipeq-republish", daemon=True)

    def start(self) -> "Republisher":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._done.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(THREAD_STOP_S)

    def _run(self) -> None:
        store = None
        while not self._done.wait(self.interval):
            try:
                if store is None:
                    store = self.rz.store(self.timeout, client=True)
                for key, raw in self.entries.items():
                    if self._done.is_set():
                        return
                    store.set(key, raw)
            except Exception:  # the store is going away, or a hiccup: reconnect next round
                store = None


def _env_int(env: Mapping[str, str], *names: str) -> int | None:
    for name in names:
        value = env.get(name)
        if value not in (None, ""):
            try:
                return int(value)  # type: ignore[arg-type]
            except ValueError:
                raise ValueError(f"environment variable {name}={value!r} is not an integer") from None
    return None


def resolve_bind(bind: str | None, master_addr: str, master_port: int) -> str:
    """The address to bind to: ``bind`` as an IP, an interface name or a host name; by default
    the local address this host uses to reach the master (so peers can reach it back)."""
    if bind:
        try:
            return str(ipaddress.ip_address(bind))
        except ValueError:
            pass
        addr = interface_address(bind)
        if addr is not None:
            return addr
        try:
            return socket.gethostbyname(bind)
        except OSError:
            raise ValueError(f"--bind {bind!r} is neither an address, an interface nor a host name") from None
    try:
        target = socket.gethostbyname(master_addr)
    except OSError:
        raise ValueError(f"master address {master_addr!r} does not resolve") from None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((target, master_port))  # UDP: no packet is sent, the route is looked up
        except OSError as exc:
            raise ValueError(f"no route to the master address {master_addr} ({exc})") from None
        return s.getsockname()[0]


def placement_over(n_stages: int, nnodes: int, alive: Sequence[int] | None,
                   nodes: Sequence[Sequence[int]] | None = None) -> list[list[int]]:
    """Which stages run on which node when only the nodes ``alive`` take part (None: all): the
    job's placement with every node, else contiguous and even over the nodes alive (in rank
    order; a node not alive runs nothing, its list empty)."""
    if alive is None or sorted(alive) == list(range(nnodes)):
        return placement(n_stages, nnodes, nodes)
    alive = sorted(set(alive))
    if not alive or alive[0] != 0 or alive[-1] >= nnodes:
        raise ValueError(f"nodes {alive} cannot run a {nnodes}-node run: node 0 (the driver) must be one of them")
    plan: list[list[int]] = [[] for _ in range(nnodes)]
    for r, stages in zip(alive, placement(n_stages, len(alive))):
        plan[r] = stages
    return plan


def placement(n_stages: int, nnodes: int, nodes: Sequence[Sequence[int]] | None = None) -> list[list[int]]:
    """Which stages run on which node: ``nodes`` as given (checked), else contiguous and even."""
    if nodes is None:
        if nnodes > n_stages:
            raise ValueError(
                f"{nnodes} nodes for {n_stages} stages: some nodes would run nothing; use at most "
                f"{n_stages} nodes or give a placement"
            )
        return [list(range(r * n_stages // nnodes, (r + 1) * n_stages // nnodes)) for r in range(nnodes)]
    plan = [list(node) for node in nodes]
    if len(plan) != nnodes:
        raise ValueError(f"the placement lists {len(plan)} node(s) but the run has {nnodes}")
    flat = sorted(k for node in plan for k in node)
    if flat != list(range(n_stages)):
        raise ValueError(
            f"the placement {plan} must name every stage 0..{n_stages - 1} exactly once"
        )
    for r, node in enumerate(plan):
        if not node:
            raise ValueError(f"the placement gives node {r} no stage")
    return plan
