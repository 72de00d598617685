"""Who may talk to a run: the job's keys at every tcp handshake, and a Poly1305 MAC per data message.

Nobody without the job's secret gets in (:class:`WireAuth`). An ``ipc`` directory is private to
the user (mode 0700, checked before use: :func:`pipeq.wire.sockets.check_private_dir`). Every
``tcp`` socket is authenticated at the ZeroMQ handshake by a ZAP handler (:class:`Gatekeeper`)
that admits only keys derived from the secret::

    mode            control channel          data channels (activations, gradients, replicas)
    "encrypt"       CURVE                    CURVE (encrypted and authenticated)
    "authenticate"  CURVE                    PLAIN handshake + a Poly1305 MAC per message (FrameMac)

A peer without the keys is refused at the handshake: it can neither read nor inject, and the run
does not notice it.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import struct
from dataclasses import dataclass
from typing import Any, Sequence

import zmq
from cryptography.hazmat.primitives.poly1305 import Poly1305
from zmq.utils import z85

from pipeq.wire.keys import JobSecret

__all__ = ["SECURITY_MODES", "ZAP_DOMAIN", "WireAuth", "FrameMac", "Gatekeeper", "is_tcp", "need_auth",
           "seals_data", "secure_server", "secure_client"]

SECURITY_MODES = ("encrypt", "authenticate")
ZAP_DOMAIN = "pipeq"
_TAG_BYTES = 16  # Poly1305


@dataclass(frozen=True)
class WireAuth:
    """Who may talk to a run over TCP: holders of ``secret``; ``mode`` is "encrypt" (CURVE on
    every socket) or "authenticate" (CURVE on the control channel; data frames in the clear with
    a per-message Poly1305 MAC, :class:`FrameMac`, for bandwidth-bound runs: see the README's
    measurements)."""

    secret: JobSecret
    mode: str  # the run's tcp_security (pipeq.WireConfig)

    def __post_init__(self) -> None:
        if self.mode not in SECURITY_MODES:
            raise ValueError(f"tcp_security={self.mode!r}: use one of {SECURITY_MODES}")

    def curve(self, role: str) -> tuple[bytes, bytes]:
        """The (public, secret) CURVE key pair of ``role`` ("server" or "client"), z85."""
        secret_key = z85.encode(self.secret.derive(f"curve-{role}"))
        return zmq.curve_public(secret_key), secret_key

    def plain_password(self) -> bytes:
        return self.secret.derive("data-plain").hex().encode()


def is_tcp(addr: str) -> bool:
    return addr.startswith("tcp://")


def need_auth(auth: WireAuth | None, addr: str) -> None:
    """Refuse to connect to a tcp ``addr`` without the job's secret."""
    if auth is None and is_tcp(addr):
        raise ValueError(f"{addr}: a tcp socket needs the job's secret (WireAuth); pipeq never "
                         "opens an unauthenticated TCP port")


def seals_data(auth: WireAuth | None, tcp: bool) -> bool:
    """Whether a data channel's messages carry a :class:`FrameMac` tag: on tcp in "authenticate" mode."""
    return tcp and auth is not None and auth.mode == "authenticate"


def secure_server(sock: zmq.Socket, auth: WireAuth | None, *, data: bool = False) -> None:
    """Make ``sock`` (about to bind on tcp) demand the job's keys at the handshake."""
    if auth is None:
        return
    if data and auth.mode == "authenticate":
        sock.plain_server = True
    else:
        public, secret = auth.curve("server")
        sock.curve_publickey, sock.curve_secretkey = public, secret
        sock.curve_server = True
    sock.zap_domain = ZAP_DOMAIN.encode()
    sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)  # no ZAP handler: refuse, never admit


def secure_client(sock: zmq.Socket, auth: WireAuth | None, addr: str, *, data: bool = False) -> None:
    """Give ``sock`` (about to connect to ``addr``) the job's keys, if ``addr`` is tcp."""
    need_auth(auth, addr)
    if auth is None or not is_tcp(addr):
        return
    if data and auth.mode == "authenticate":
        sock.plain_username = b"pipeq"
        sock.plain_password = auth.plain_password()
    else:
        sock.curve_serverkey = auth.curve("server")[0]
        sock.curve_publickey, sock.curve_secretkey = auth.curve("client")


class Gatekeeper:
    """The ZAP handler of one ZeroMQ context: admits the job's CURVE client key and the job's
    PLAIN password, refuses everything else (refused peers are never seen by pipeq's code)."""

    def __init__(self, ctx: zmq.Context, auth: WireAuth) -> None:
        from zmq.auth.thread import ThreadAuthenticator

        client_key = auth.curve("client")[0]

        class _Keys:
            def callback(self, domain: str, key: bytes) -> bool:
                return hmac.compare_digest(key, client_key)

        # pyzmq logs each denial at DEBUG only: an attacker cannot flood the logs
        self._auth = ThreadAuthenticator(ctx, log=logging.getLogger("pipeq.zap"))
        self._auth.start()
        self._auth.configure_curve_callback(ZAP_DOMAIN, credentials_provider=_Keys())
        self._auth.configure_plain(ZAP_DOMAIN, {"pipeq": auth.plain_password().decode()})

    @classmethod
    def on_tcp(cls, ctx: zmq.Context, auth: WireAuth | None, tcp: bool, what: str) -> "Gatekeeper | None":
        """The gatekeeper of a context whose sockets bind on tcp (None on ipc); refuses a tcp
        ``what`` without the job's secret."""
        if not tcp:
            return None
        if auth is None:
            raise ValueError(f"{what} on tcp needs the job's secret (WireAuth)")
        return cls(ctx, auth)

    def stop(self) -> None:
        self._auth.stop()


class FrameMac:
    """Per-message MACs of one data channel in "authenticate" mode.

    A sealed message is ``[seq (8 bytes) + tag (16), header, buffers...]``. The tag is a
    Poly1305 MAC (12 GB/s here, 7x HMAC-SHA256) under a one-time key derived from the job's
    data key, the channel's label (which stage sent it, which direction) and the sequence number;
    it covers the sequence number and every frame with its length. The receiver drops a message
    whose tag does not verify or whose sequence number is not above the last one it accepted (a
    replay), without a word: a forger must not be able to end the run.
    """

    __slots__ = ("_key", "_label", "seq", "dropped")

    def __init__(self, auth: WireAuth, label: str) -> None:
        self._key = auth.secret.derive("data-mac")
        self._label = label.encode()
        self.seq = 0
        self.dropped = 0

    def _tag(self, seq: bytes, frames: Sequence[Any]) -> bytes:
        one_time = hmac.new(self._key, self._label + b"\0" + seq, hashlib.sha256).digest()
        mac = Poly1305(one_time)
        mac.update(seq)
        for f in frames:
            view = memoryview(f)
            if view.ndim != 1 or view.format != "B":  # (a frame over a tensor of another dtype or shape)
                view = view.cast("B")
            mac.update(struct.pack(">Q", view.nbytes))
            mac.update(view)
        return mac.finalize()

    def seal(self, frames: list[Any]) -> list[Any]:
        self.seq += 1
        seq = struct.pack(">Q", self.seq)
        return [seq + self._tag(seq, frames), *frames]

    def open(self, frames: Sequence[Any]) -> Sequence[Any] | None:
        """The message's frames if it is genuine and new, else None."""
        if len(frames) < 2:
            self.dropped += 1
            return None
        head = memoryview(frames[0]).tobytes()
        if len(head) != 8 + _TAG_BYTES:
            self.dropped += 1
            return None
        (seq,) = struct.unpack(">Q", head[:8])
        if seq <= self.seq or not hmac.compare_digest(head[8:], self._tag(head[:8], frames[1:])):
            self.dropped += 1
            return None
        self.seq = seq
        return frames[1:]
