"""A hostile peer for tests/hosts/test_attacks.py: what someone without a run's secret can throw at its
tcp ports, from a process of its own (so that it can run in another network namespace).

    python tests/support/attacker.py attack SPEC   # attack in rounds until "stop" arrives on stdin
    python tests/support/attacker.py victim SPEC   # a training run driven line by line from stdin

From a test, :class:`Attack` and :class:`Victim` start and drive those processes (``popen``
may start them elsewhere, e.g. ``TwoHosts.popen`` in a network namespace).

``attack``: SPEC is JSON::

    {"control": "tcp://...",          the driver's control ROUTER
     "data": ["tcp://...", ...],      every stage's forward and backward PULL port
     "marker": "/path",               what the pickle in the menu would create if unpickled
     "server_key": "z85" | null,      the run's CURVE server public key (public by nature)
     "password": "..." | null,        the data channels' PLAIN password ("authenticate" mode
                                      sends it in the clear: what an eavesdropper has)
     "menu": "/path",                 the messages to send (msgpack; :func:`menu`)
     "other": {...}}                  another secret's keys (:func:`other_secret`)

(:class:`Attack` adds the last two.) Round 0 also sends every port a handshake frame in its own
mechanism claiming 300 MiB (64 MiB of it sent), 16 GiB, 1 TiB and 2**63 - 1 bytes, one stage a
64 MiB one, and holds 50 half-open connections per port.

Each round it attacks every port, then prints ``round <n>``; on a line ``stop`` it prints
``report <json>`` (what it sent, what its sockets saw) and exits. Persistent ZeroMQ sockets of
every type, with every kind of wrong key, stay connected (and keep re-trying their handshake)
for the whole attack; raw TCP connections are made afresh each round.

``victim``: SPEC is JSON ``{"host", "mode", "schedule", "out"}``; it prints ``ready <json>``
(the addresses and the public material above), then on each line ``step`` trains one step
(``stepped <loss>``), on ``finish`` writes losses, predict's output and the final state_dict to
``out`` (torch.save; ``finished``), and on ``close`` closes the run and exits.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import pickle
import queue
import random
import socket
import struct
import subprocess
import sys
import threading
import time
from collections import Counter
from typing import Any, Iterator

import msgpack
import zmq
from pipeq.testing import backend_of

# The attacker process imports neither torch nor pipeq (it starts in 0.1 s instead of 2): the
# test's side builds the messages it sends (with pipeq's codec) and another secret's keys, and
# hands them over in a file and in SPEC.

HERE = os.path.abspath(__file__)
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))  # the repository (this is tests/support/)

# -- the victim: a tiny run, the same in every test and in the reference -----------------------
STEPS = 4
BATCH = 48
MICROBATCHES = 4


def batches() -> list[tuple[Any, Any]]:
    import torch

    g = torch.Generator().manual_seed(1)
    return [(torch.randn(BATCH, 8, generator=g), torch.randint(0, 3, (BATCH,), generator=g))
            for _ in range(STEPS)]


def make_runner(mode: str, schedule: str, host: str = "127.0.0.1") -> Any:
    """Three Linear stages (8 -> 16 -> 16 -> 3) over tcp; seeded, so every run is the same run."""
    import pipeq
    import torch
    from torch import nn

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from models import mlp_stages

    torch.manual_seed(0)  # the stages' weights and (through the driver's RNG) the stage seeds
    return pipeq.PipelineRunner(
        mlp_stages((8, 16, 16, 3)), nn.CrossEntropyLoss(),
        functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9), schedule=schedule,
        microbatches=MICROBATCHES, transport="tcp", host=host, tcp_security=mode,
        threads_per_stage=1, start_method="forkserver")


@contextlib.contextmanager
def recorded_secret() -> Iterator[list[Any]]:
    """The secret the runner started in this block makes for itself (appended to the list)."""
    import pipeq.control.startup as driver  # where the driver makes its secret

    real, got = driver.JobSecret, []

    class Recording(real):  # type: ignore[misc, valid-type]
        @classmethod
        def generate(cls) -> Any:
            secret = real.generate()
            got.append(secret)
            return secret

    driver.JobSecret = Recording
    try:
        yield got
    finally:
        driver.JobSecret = real


def targets(runner: Any, secret: Any, mode: str) -> dict[str, Any]:
    """What an attacker can know of a running ``runner``: its ports, its CURVE server public key
    (never secret in CURVE), and in "authenticate" mode the PLAIN password its data channels
    send in the clear. Never the secret, the client key or the MAC key."""
    from pipeq.wire.security import WireAuth

    backend = backend_of(runner)
    auth = WireAuth(secret, mode)
    where = {
        "control": backend.server.address,
        "data": [info[d] for info in runner.stage_processes for d in ("forward", "backward")],
        "server_key": auth.curve("server")[0].decode(),
        "password": auth.plain_password().decode() if mode == "authenticate" else None,
    }
    # every port the run listens on: the stages' are these and no other (this process may have
    # listeners of its own besides the control port)
    port = lambda addr: int(addr.rsplit(":", 1)[1])  # noqa: E731
    stages = listening_ports([p["pid"] for p in runner.stage_processes])
    assert stages == {port(a) for a in where["data"]}, (stages, where)
    assert port(where["control"]) in listening_ports([os.getpid()])
    return where


def listening_ports(pids: Any) -> set[int]:
    """The TCP ports processes ``pids`` listen on (Linux /proc)."""
    return {port for _, port in listening_addresses(pids)}


def listening_addresses(pids: Any) -> list[tuple[str, int]]:
    """(address, port) of every TCP socket processes ``pids`` listen on (Linux /proc)."""
    import ipaddress

    inodes = set()
    for pid in pids:
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    link = os.readlink(f"/proc/{pid}/fd/{fd}")
                    if link.startswith("socket:["):
                        inodes.add(link[8:-1])
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError), open(table) as f:
            for row in f.read().splitlines()[1:]:
                cols = row.split()
                if cols[3] == "0A" and cols[9] in inodes:  # LISTEN
                    hexaddr, hexport = cols[1].rsplit(":", 1)
                    raw = bytes.fromhex(hexaddr)  # each 32-bit word in host (little-endian) order
                    raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
                    found.append((str(ipaddress.ip_address(raw)), int(hexport, 16)))
    return found


def victim(spec: dict[str, Any]) -> None:
    import torch

    data = batches()
    with recorded_secret() as secrets_made:
        runner = make_runner(spec["mode"], spec["schedule"], spec["host"])
        runner.start()
    try:
        print("ready", json.dumps(targets(runner, secrets_made[0], spec["mode"])), flush=True)
        losses = []
        for line in sys.stdin:
            if line.strip() == "step":
                losses.append(runner.step(*data[len(losses)]))
                print("stepped", repr(losses[-1]), flush=True)
            elif line.strip() == "finish":
                out = runner.predict(data[0][0])
                torch.save({"losses": losses, "out": out, "state": runner.state_dict()}, spec["out"])
                print("finished", flush=True)
            elif line.strip() == "close":
                break
    finally:
        runner.close()


# -- what the attacker sends ----------------------------------------------------------------------
class _Boom:
    """Unpickling this creates the directory ``path``: proof that a pickle was run."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return (os.mkdir, (self.path,))


def pickle_payload(path: str) -> bytes:
    return pickle.dumps(_Boom(path))  # refers to os.mkdir only: loads anywhere


def other_secret() -> dict[str, str]:
    """The keys of another run's secret (``WireAuth(JobSecret.generate())``), as the attacker
    uses them: the CURVE server public key, a client key pair, the PLAIN password."""
    from pipeq.wire.keys import JobSecret
    from pipeq.wire.security import WireAuth

    other = WireAuth(JobSecret.generate(), "authenticate")
    public, secret = other.curve("client")
    return {"server_key": other.curve("server")[0].decode(), "public": public.decode(),
            "secret": secret.decode(), "password": other.plain_password().decode()}


def _raw(frames: list[Any]) -> list[bytes]:
    return [bytes(memoryview(f).cast("B")) if not isinstance(f, bytes) else f for f in frames]


def menu(marker: str) -> list[tuple[str, list[bytes]]]:
    """(name, frames) of every message the attacker sends: well-formed pipeq messages of every
    kind (encoded by pipeq's own codec: perfectly valid), duplicates, and malformed ones."""
    import torch

    from pipeq.wire import codec
    from pipeq.wire.messages import Kind

    big = torch.full((BATCH // MICROBATCHES, 16), 1e6)  # a microbatch's activation, poisoned
    items: list[tuple[str, list[bytes]]] = []
    for step in (-2, -1, 0, 1, 2, 3, 4, 5, 6):
        for mb in range(MICROBATCHES):
            for kind in (Kind.ACTIVATION, Kind.GRADIENT, Kind.OUTPUT):
                frames = _raw(codec.encode(kind, step, mb, [big]))
                items += [(f"forged-{kind.name}", frames)] * 2  # every one twice: duplicates
        items += [
            ("forged-LOSS", _raw(codec.encode(Kind.LOSS, step, 0, [], {"loss": 1e9}))),
            ("forged-ERROR", _raw(codec.encode(Kind.ERROR, step, 0, [], {
                "message": "forged failure", "traceback": "none", "step": step}))),
            ("forged-HEARTBEAT", _raw(codec.encode(Kind.HEARTBEAT, step))),
            ("forged-ACK", _raw(codec.encode(Kind.ACK, step))),
            ("forged-STATE", _raw(codec.encode(Kind.STATE, step, 0, [big], {"names": ["0.weight"]}))),
        ]
    for kind in Kind:  # every kind, commands included (wrong on every channel it reaches)
        items.append((f"kind-{kind.name}", _raw(codec.encode(kind, 1, 0, [], {
            "forward": "tcp://10.0.0.1:1", "backward": "tcp://10.0.0.1:2", "next_forward": "tcp://10.0.0.1:3",
            "sizes": [1], "weights": [1.0]}))))
    good_header = _raw(codec.encode(Kind.ACTIVATION, 1, 0, [big]))
    pk = lambda *h: msgpack.packb(list(h))  # noqa: E731
    items += [
        ("random-bytes", [os.urandom(n) for n in (1, 17, 600)]),
        ("empty-frames", [b"", b"", b""]),
        ("truncated-msgpack", [good_header[0][:-5], good_header[1]]),
        ("truncated-tensor", [good_header[0], good_header[1][:-3]]),
        ("pickle", [pickle_payload(marker)]),
        ("pickle-as-tensor", [pk(1, 1, 1, 0, [[8, [40], 40]], None), pickle_payload(marker).ljust(40)[:40]]),
        ("pickle-in-extra", [pk(1, 1, 1, 0, [], {"obj": pickle_payload(marker)})]),
        ("absurd-shape", [pk(1, 1, 1, 0, [[0, [2**40, 2**40], 16]], None), b"\0" * 16]),
        ("negative-shape", [pk(1, 1, 1, 0, [[0, [-1, 4], 16]], None), b"\0" * 16]),
        ("deep-shape", [pk(1, 1, 1, 0, [[0, [1] * 64, 4]], None), b"\0" * 4]),
        ("absurd-nbytes", [pk(1, 1, 1, 0, [[0, [4], 2**64 - 1]], None), b"\0" * 16]),
        ("absurd-frame-count", [pk(1, 1, 1, 0, [[0, [1], 4]] * 70000, None), b"\0" * 4]),
        ("frames-beyond-header", [pk(1, 1, 1, 0, [[0, [1], 4]], None)] + [b"\0" * 4] * 1000),
        ("wrong-version", [pk(2, 1, 1, 0, [], None)]),
        ("wrong-kind", [pk(1, 255, 1, 0, [], None)]),
        ("kind-as-text", [pk(1, "ACTIVATION", 1, 0, [], None)]),
        ("float-step", [pk(1, 1, 1.5, 0, [], None)]),
        ("huge-ints", [pk(1, 1, 2**64 - 1, -(2**63), [], None)]),
        ("extra-not-a-map", [pk(1, 21, 1, 0, [], [1, 2])]),
        ("header-over-limit", [pk(1, 1, 1, 0, [], {"pad": "x" * (2 << 20)})]),
        ("nested-msgpack", [b"\x91" * 100_000 + b"\xc0"]),
        ("sealed-looking", [b"\0" * 7 + b"\x09" + os.urandom(16), *good_header]),
        ("sealed-huge-seq", [b"\xff" * 8 + os.urandom(16), *good_header]),
    ]
    return items


# -- ZMTP 3 by hand (raw TCP) -------------------------------------------------------------------
SIGNATURE = b"\xff" + b"\0" * 8 + b"\x7f"


def greeting(mechanism: bytes, major: int = 3, minor: int = 0, as_server: int = 0) -> bytes:
    return SIGNATURE + bytes([major, minor]) + mechanism.ljust(20, b"\0")[:20] + bytes([as_server]) + b"\0" * 31


def zframe(body: bytes, more: bool = False, command: bool = False, claim: int | None = None) -> bytes:
    size = len(body) if claim is None else claim
    flags = (1 if more else 0) | (4 if command else 0)
    if size > 255:
        return bytes([flags | 2]) + struct.pack(">Q", size) + body
    return bytes([flags, size]) + body


def command(name: bytes, data: bytes) -> bytes:
    return zframe(bytes([len(name)]) + name + data, command=True)


def props(**kw: bytes) -> bytes:
    return b"".join(bytes([len(k)]) + k.encode() + struct.pack(">I", len(v)) + v
                    for k, v in ((k.replace("_", "-"), v) for k, v in kw.items()))


def message(frames: list[bytes]) -> bytes:
    return b"".join(zframe(f, more=i < len(frames) - 1) for i, f in enumerate(frames))


def raw_scripts(items: list[tuple[str, list[bytes]]], rng: random.Random) -> list[tuple[str, bytes]]:
    """(name, bytes) written on fresh TCP connections: junk, and fake ZMTP sessions that claim
    every mechanism and carry the menu's messages."""
    small = [f for _, f in items if sum(map(len, f)) < 4096]
    msgs = b"".join(message(f) for f in small[::3])  # forged and malformed, ~100 KiB
    scripts = [
        ("raw-random", rng.randbytes(4096)),
        ("raw-signature-then-random", SIGNATURE + rng.randbytes(2048)),
        ("raw-zmtp1", b"\x03\x00s1" + msgs[:4096]),  # ZMTP 1.0 framing, identity "s1"
        ("raw-zmtp2", SIGNATURE[:-1] + b"\x7f\x01\x05" + b"\0\x02s1" + msgs[:4096]),
        ("raw-version-99", greeting(b"NULL", 99, 99) + msgs[:4096]),
        ("raw-as-server", greeting(b"NULL", as_server=1) + msgs[:4096]),
        ("raw-bad-mechanism", greeting(b"\x00\xffEVIL") + msgs[:4096]),
        ("raw-gssapi", greeting(b"GSSAPI") + command(b"HELLO", rng.randbytes(64)) + msgs[:4096]),
    ]
    for sock_type in (b"DEALER", b"PUSH", b"ROUTER", b"PUB", b"REQ", b"PAIR"):
        for ident in (b"s0", b"s1", b"h1", b"a1", b"s01"):
            ready = command(b"READY", props(Socket_Type=sock_type, Identity=ident))
            scripts.append((f"raw-null-{sock_type.decode()}-{ident.decode()}", greeting(b"NULL") + ready + msgs))
    scripts += [
        ("raw-plain-guess", greeting(b"PLAIN") + command(b"HELLO", b"\x05pipeq\x05guess")
         + command(b"INITIATE", props(Socket_Type=b"PUSH", Identity=b"s1")) + msgs),
        ("raw-plain-empty", greeting(b"PLAIN") + command(b"HELLO", b"\0\0") + msgs),
        ("raw-curve-hello", greeting(b"CURVE") + command(b"HELLO", b"\x01\x00" + b"\0" * 72 + rng.randbytes(120))
         + command(b"INITIATE", rng.randbytes(300)) + msgs),
        ("raw-curve-short-hello", greeting(b"CURVE") + command(b"HELLO", b"\x01")),
        ("raw-null-absurd-length", greeting(b"NULL") + command(b"READY", props(Socket_Type=b"DEALER"))
         + zframe(b"", claim=2**63 - 1) + rng.randbytes(1024)),
        ("raw-null-max-length", greeting(b"NULL") + command(b"READY", props(Socket_Type=b"PUSH"))
         + zframe(b"", claim=2**64 - 1) + rng.randbytes(1024)),
        ("raw-command-absurd-length", greeting(b"CURVE") + bytes([4 | 2]) + struct.pack(">Q", 2**62)
         + rng.randbytes(1024)),
        ("raw-ready-absurd-property", greeting(b"NULL") + zframe(b"\x05READY\x0bSocket-Type" + struct.pack(
            ">I", 2**31) + b"DEALER", command=True)),
    ]
    return scripts


# -- the attacker ----------------------------------------------------------------------------------
SOCKET_TYPES = {name: getattr(zmq, name) for name in (
    "PAIR", "PUB", "SUB", "REQ", "REP", "DEALER", "ROUTER", "PULL", "PUSH", "XPUB", "XSUB")}
IDENTITIES = (b"s0", b"s1", b"h1", b"a1", b"s01")
EVENT_NAMES = {getattr(zmq, n): n[6:] for n in dir(zmq) if n.startswith("EVENT_") and "ALL" not in n}
MiB = 1 << 20


class Attacker:
    def __init__(self, spec: dict[str, Any]) -> None:
        self.spec = spec
        self.rng = random.Random(spec.get("seed", 0))
        with open(spec["menu"], "rb") as f:
            self.menu = [(name, frames) for name, frames in msgpack.unpackb(f.read())]
        self.scripts = raw_scripts(self.menu, self.rng)
        self.ports = [(spec["control"], "control")] + [(a, "data") for a in spec["data"]]
        self.ctx = zmq.Context(io_threads=1)
        self.ctx.set(zmq.MAX_SOCKETS, 8192)
        self.socks: list[tuple[zmq.Socket, zmq.Socket, str, str]] = []  # (socket, monitor, variant, port kind)
        self.sent: Counter[str] = Counter()  # messages handed to ZeroMQ, by variant
        self.events: dict[str, Counter[str]] = {}  # by variant: the monitor events its sockets saw
        self.raw: Counter[str] = Counter()  # raw TCP: connections made, bytes written, resets seen
        self.took: Counter[str] = Counter()  # seconds spent, by phase
        self.menu_sent: set[str] = set()  # the menu's messages that went out (or into a queue)
        self.other = spec["other"]  # another run's keys
        t0 = time.monotonic()
        self._setup()
        self.took["setup"] = time.monotonic() - t0

    # ZeroMQ sockets ---------------------------------------------------------------------------
    def _variants(self, kind: str) -> list[str]:
        out = ["null", "other-secret-curve", "other-secret-plain", "plain-guess"]
        if self.spec.get("server_key"):
            out.append("server-key")  # the right server key, a key pair of its own
        if kind == "data" and self.spec.get("password"):
            out.append("sniffed-password")  # passes the PLAIN handshake; the MACs stop it
        return out

    def _secure(self, s: zmq.Socket, variant: str) -> None:
        if variant == "other-secret-curve":
            s.curve_serverkey = self.other["server_key"].encode()
            s.curve_publickey, s.curve_secretkey = self.other["public"].encode(), self.other["secret"].encode()
        elif variant == "other-secret-plain":
            s.plain_username, s.plain_password = b"pipeq", self.other["password"].encode()
        elif variant == "plain-guess":
            s.plain_username, s.plain_password = b"pipeq", b"guess"
        elif variant == "server-key":
            s.curve_serverkey = self.spec["server_key"].encode()
            s.curve_publickey, s.curve_secretkey = zmq.curve_keypair()
        elif variant == "sniffed-password":
            s.plain_username, s.plain_password = b"pipeq", self.spec["password"].encode()

    def _setup(self) -> None:
        for addr, kind in self.ports:
            for variant in self._variants(kind):
                for name, st in SOCKET_TYPES.items():
                    idents = IDENTITIES if kind == "control" and name in ("DEALER", "REQ", "ROUTER") else (b"s1",)
                    for ident in idents:
                        s = self.ctx.socket(st)
                        s.setsockopt(zmq.LINGER, 0)
                        s.setsockopt(zmq.SNDHWM, 100_000)
                        s.setsockopt(zmq.RECONNECT_IVL, 250)
                        s.setsockopt(zmq.IDENTITY, ident)
                        if name == "ROUTER":
                            s.setsockopt(zmq.CONNECT_ROUTING_ID, b"peer")
                        self._secure(s, variant)
                        mon = s.get_monitor_socket()
                        s.connect(addr)
                        self.socks.append((s, mon, variant, kind))

    def _send(self, s: zmq.Socket, name: str, frames: list[bytes], variant: str) -> bool:
        try:
            if s.type == zmq.ROUTER:
                frames = [b"peer", *frames]
            s.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
            self.sent[variant] += 1
            self.menu_sent.add(name)
            return True
        except zmq.ZMQError:  # cannot send on this type, full, or in the wrong state (REQ)
            return False

    def _flood(self, n: int) -> None:
        """50 of the menu's messages from every socket that can send, the next 50 each round; in
        round 0 the whole menu from the sockets without keys, with the right server key and with
        the eavesdropped password; four times as many from the eavesdropper's PUSH sockets
        (whose messages get through the handshake)."""
        some = [self.menu[(50 * n + i) % len(self.menu)] for i in range(50)]
        for s, _, variant, _ in self.socks:
            if s.type in (zmq.SUB, zmq.PULL, zmq.REP):
                continue
            items = self.menu if n == 0 and variant in ("null", "server-key", "sniffed-password") else some
            sniffer = variant == "sniffed-password" and s.type == zmq.PUSH
            for name, frames in items * 4 if sniffer else items:
                # a socket that never gets in keeps what it was given: large ones from a few only
                if sum(map(len, frames)) > 64 << 10 and s.type not in (zmq.PUSH, zmq.DEALER):
                    continue
                if not self._send(s, name, frames, variant):
                    break

    def _stream(self, addr: str) -> None:
        """A ZeroMQ STREAM socket (raw TCP through ZeroMQ): the server's greeting, then junk."""
        s = self.ctx.socket(zmq.STREAM)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.CONNECT_ROUTING_ID, b"raw")
        try:
            s.connect(addr)
            if s.poll(300):
                s.recv_multipart()  # the connection notice
                for name, data in self.rng.sample(self.scripts, 6):
                    s.send_multipart([b"raw", data], flags=zmq.NOBLOCK)
                    self.sent["stream"] += 1
                while s.poll(10):  # the server's greeting; then it hangs up
                    s.recv_multipart()
                    self.raw["stream-replies"] += 1
        except zmq.ZMQError:
            pass
        finally:
            s.close()

    def _events(self) -> None:
        for _, mon, variant, _ in self.socks:
            seen = self.events.setdefault(variant, Counter())
            while mon.poll(0):
                try:
                    frames = mon.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                (event,) = struct.unpack("=H", frames[0][:2])
                seen[EVENT_NAMES.get(event, str(event))] += 1

    # raw TCP ------------------------------------------------------------------------------------
    @staticmethod
    def _hostport(addr: str) -> tuple[str, int]:
        host, port = addr[len("tcp://"):].rsplit(":", 1)
        return host, int(port)

    def _write(self, addr: str, data: bytes) -> None:
        try:
            with socket.create_connection(self._hostport(addr), timeout=2) as c:
                self.raw["connections"] += 1
                c.sendall(data)
                self.raw["bytes"] += len(data)
                c.settimeout(0.05)
                with contextlib.suppress(OSError):
                    c.recv(65536)  # whatever the server says (its greeting, an ERROR)
        except OSError:  # reset or closed by the server part-way: expected
            self.raw["refused-or-reset"] += 1

    def _big(self, addr: str, claim: int, send_mb: int, name: str) -> None:
        """Read the server's greeting, answer with its own mechanism, then a handshake command
        claiming ``claim`` bytes, and send ``send_mb`` MiB of it (the server reads it, unlike
        what follows a greeting it refuses)."""
        try:
            with socket.create_connection(self._hostport(addr), timeout=5) as c:
                self.raw["connections"] += 1
                c.sendall(SIGNATURE + b"\x03")
                theirs = b""
                while len(theirs) < 64:
                    got = c.recv(64 - len(theirs))
                    if not got:
                        raise ConnectionResetError
                    theirs += got
                mechanism = theirs[12:32].rstrip(b"\0")
                self.raw[f"greeting-{mechanism.decode()}"] += 1
                c.sendall(greeting(mechanism)[11:] + bytes([4 | 2]) + struct.pack(">Q", claim) + b"\x05HELLO")
                chunk = self.rng.randbytes(MiB)
                for _ in range(send_mb):
                    c.sendall(chunk)
                    self.raw["bytes"] += len(chunk)
                self.raw[f"{name}-sent-whole"] += 1
        except OSError:  # refused at the frame header (over the cap), or after reading it
            self.raw[f"{name}-reset"] += 1

    def _raw_round(self, first: bool) -> None:
        t = time.monotonic()
        for addr, _ in self.ports:  # every script in the first round, a dozen in each later one
            for _, data in self.scripts if first else self.rng.sample(self.scripts, 12):
                self._write(addr, data)
        self.took["scripts"] += time.monotonic() - t
        t = time.monotonic()
        for addr, _ in self.ports:
            self._stream(addr)
        self.took["stream"] += time.monotonic() - t
        t = time.monotonic()
        if first:
            for addr, _ in self.ports:
                # over the data frame cap: refused at once by a stage; the driver reads it
                self._big(addr, 300 * MiB, 64, "big-300M")
                for claim, name in ((16 << 30, "big-16G"), (1 << 40, "big-1T"), (2**63 - 1, "big-max")):
                    self._big(addr, claim, 1, name)  # absurd: more than the machine's memory
            self._big(self.ports[-1][0], 64 * MiB, 64, "big-64M")  # under the cap: read whole by a stage
        self.took["big"] += time.monotonic() - t
        # a connection flood: many at once, each stopping half-way through its greeting
        held = []
        for addr, _ in self.ports:
            for _ in range(50 if first else 10):
                with contextlib.suppress(OSError):
                    c = socket.create_connection(self._hostport(addr), timeout=2)
                    c.sendall(SIGNATURE[:5])
                    held.append(c)
        self.raw["held"] += len(held)
        time.sleep(0.1)
        for c in held:
            c.close()

    def round(self, n: int) -> None:
        t0 = time.monotonic()
        self._flood(n)
        t1 = time.monotonic()
        self._raw_round(first=n == 0)
        self._events()
        self.took["flood"] += t1 - t0
        self.took["raw"] += time.monotonic() - t1

    def report(self) -> dict[str, Any]:
        time.sleep(0.3)  # the last handshakes' outcomes
        self._events()
        return {"sent": dict(self.sent), "raw": dict(self.raw), "took": {k: round(v, 2) for k, v in self.took.items()},
                "sockets": len(self.socks), "events": {k: dict(v) for k, v in self.events.items()},
                "menu": sorted({name for name, _ in self.menu}), "menu_sent": sorted(self.menu_sent), "scripts": [name for name, _ in self.scripts]}

    def close(self) -> None:
        for s, mon, _, _ in self.socks:
            s.disable_monitor()
            mon.close(linger=0)
            s.close(linger=0)
        self.ctx.term()


def attack(spec: dict[str, Any]) -> None:
    attacker = Attacker(spec)
    try:
        n = 0
        attacker.round(n)
        print("round", n, flush=True)
        # keep attacking until told to stop; one round at a time, each announced
        import selectors

        sel = selectors.DefaultSelector()
        sel.register(sys.stdin, selectors.EVENT_READ)
        while True:
            if sel.select(timeout=0):
                line = sys.stdin.readline()
                if not line or line.strip() == "stop":
                    break
            n += 1
            attacker.round(n)
            print("round", n, flush=True)
        print("report", json.dumps(attacker.report()), flush=True)
    finally:
        attacker.close()


# -- driving them from a test ----------------------------------------------------------------------
class _Child:
    """A child process of this script that speaks in lines: commands on stdin, replies on stdout."""

    def __init__(self, what: str, spec: dict[str, Any], popen: Any = subprocess.Popen) -> None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}
        self.proc = popen([sys.executable, HERE, what, json.dumps(spec)], cwd=ROOT, env=env, text=True,
                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        self._lines: queue.Queue[str | None] = queue.Queue()
        self._err: list[str] = []
        threading.Thread(target=self._pump, args=(self.proc.stdout, self._lines.put), daemon=True).start()
        threading.Thread(target=self._pump, args=(self.proc.stderr, self._err.append), daemon=True).start()

    @staticmethod
    def _pump(stream: Any, put: Any) -> None:
        for line in stream:
            put(line)
        put(None)

    def say(self, line: str) -> None:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def expect(self, word: str, timeout: float = 60) -> str:
        """The rest of the next stdout line, which must start with ``word``."""
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"no '{word}' from {self.proc.args[2]} within {timeout} s; stderr: "
                                 f"{''.join(self._err)[-3000:]}") from None
        if line is None or not line.startswith(word):
            self.proc.wait(5)
            raise AssertionError(f"{self.proc.args[2]}: expected '{word}', got {line!r} (exit "
                                 f"{self.proc.returncode}); stderr: {''.join(self._err)[-3000:]}")
        return line[len(word):].strip()

    def end(self, timeout: float = 30) -> None:
        try:
            self.proc.wait(timeout)
        finally:
            self.kill()
        assert self.proc.returncode == 0, (self.proc.returncode, "".join(self._err)[-3000:])

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def __enter__(self) -> "_Child":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.kill()


class Attack(_Child):
    """The attacker process: ``wait_round()`` after each round of attacks, ``stop()`` -> report."""

    def __init__(self, spec: dict[str, Any], popen: Any = subprocess.Popen) -> None:
        import tempfile

        fd, self.menu_file = tempfile.mkstemp(prefix="pipeq-attack-", suffix=".msgpack")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(msgpack.packb(menu(spec["marker"])))
            os.chmod(self.menu_file, 0o644)  # readable by the attacker, whoever it runs as
            super().__init__("attack", {**spec, "menu": self.menu_file, "other": other_secret()}, popen)
        except BaseException:
            os.unlink(self.menu_file)
            raise

    def kill(self) -> None:
        super().kill()
        with contextlib.suppress(OSError):
            os.unlink(self.menu_file)

    def wait_round(self, timeout: float = 60) -> int:
        return int(self.expect("round", timeout))

    def stop(self, timeout: float = 60) -> dict[str, Any]:
        self.say("stop")
        end = time.monotonic() + timeout
        while True:  # rounds it finished meanwhile, then the report
            line = self.expect("", max(0.1, end - time.monotonic()))
            if line.startswith("report"):
                self.end()
                return json.loads(line[len("report"):])


class Victim(_Child):
    """A training run in a process of its own (``victim`` above)."""

    def __init__(self, spec: dict[str, Any], popen: Any = subprocess.Popen) -> None:
        super().__init__("victim", spec, popen)
        self.out = spec["out"]

    def ready(self, timeout: float = 120) -> dict[str, Any]:
        return json.loads(self.expect("ready", timeout))

    def step(self, timeout: float = 60) -> float:
        self.say("step")
        return float(self.expect("stepped", timeout))

    def finish(self, timeout: float = 60) -> dict[str, Any]:
        """Predict, get the state and save them (the run goes on until :meth:`close`)."""
        self.say("finish")
        self.expect("finished", timeout)
        import torch

        return torch.load(self.out)

    def close(self, timeout: float = 60) -> None:
        self.say("close")
        self.end(timeout)


if __name__ == "__main__":
    what, spec = sys.argv[1], json.loads(sys.argv[2])
    {"attack": attack, "victim": victim}[what](spec)
