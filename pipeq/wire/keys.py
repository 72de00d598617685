"""The job secret, and every key pipeq derives from it.

Whoever holds a run's secret may take part in it; nobody else can read or inject anything on
its TCP sockets, or redirect it through the rendezvous store. From the one secret come::

    secret --HMAC-SHA256("pipeq/curve-server")--> the CURVE key pair every bound socket uses
           --HMAC-SHA256("pipeq/curve-client")--> the CURVE key pair every connecting socket uses
           --HMAC-SHA256("pipeq/data-mac")------> the key of data frames' MACs ("authenticate" mode)
           --HMAC-SHA256("pipeq/data-plain")----> the PLAIN password of data sockets (same mode)
           --HMAC-SHA256("pipeq/store")---------> the key that signs rendezvous store entries

A single-host runner makes its own secret (:meth:`JobSecret.generate`); a multi-host job takes it
from ``PIPEQ_SECRET`` or a secret file (:meth:`JobSecret.load`), the same on every node. A
secret is any text of at least 32 characters: ``python -m pipeq secret > job.secret`` makes one.

This module does no I/O beyond reading a secret file; it is shared by the transport (socket keys,
data MACs) and the control plane (signed store entries).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import stat
from typing import Mapping

__all__ = ["JobSecret", "SecretError", "SECRET_ENV", "MIN_LENGTH", "HOW_TO_MAKE"]

SECRET_ENV = "PIPEQ_SECRET"
MIN_LENGTH = 32
HOW_TO_MAKE = ("make one with `python -m pipeq secret > job.secret` (chmod 600), then pass "
               "--secret-file job.secret or export PIPEQ_SECRET=$(cat job.secret) on every node")


class SecretError(ValueError):
    """No usable job secret: missing, too short, or readable by others."""


class JobSecret:
    """A run's shared secret (never printed: its repr hides it)."""

    __slots__ = ("_raw",)

    def __init__(self, raw: bytes) -> None:
        if len(raw) < MIN_LENGTH:
            raise SecretError(f"a job secret needs at least {MIN_LENGTH} characters, this one has "
                              f"{len(raw)}; {HOW_TO_MAKE}")
        self._raw = bytes(raw)

    @classmethod
    def generate(cls) -> "JobSecret":
        return cls(secrets.token_hex(32).encode())

    @classmethod
    def from_text(cls, text: str, source: str = "the secret") -> "JobSecret":
        value = text.strip()
        if len(value) < MIN_LENGTH:
            raise SecretError(f"{source} holds {len(value)} characters, a job secret needs at least "
                              f"{MIN_LENGTH}; {HOW_TO_MAKE}")
        return cls(value.encode())

    @classmethod
    def load(cls, secret_file: str | None = None, env: Mapping[str, str] | None = None) -> "JobSecret | None":
        """The secret from ``secret_file`` (which only its owner may read), else from
        ``$PIPEQ_SECRET``; None if neither is given."""
        env = os.environ if env is None else env
        if secret_file:
            try:
                st = os.stat(secret_file)
                with open(secret_file, encoding="utf-8") as f:
                    text = f.read()
            except OSError as exc:
                raise SecretError(f"cannot read the secret file {secret_file}: {exc.strerror}") from None
            if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
                raise SecretError(f"the secret file {secret_file} is readable by others (mode "
                                  f"{stat.S_IMODE(st.st_mode):o}); chmod 600 {secret_file}")
            return cls.from_text(text, f"the secret file {secret_file}")
        text = env.get(SECRET_ENV)
        if text:
            return cls.from_text(text, f"${SECRET_ENV}")
        return None

    def __repr__(self) -> str:
        return "JobSecret(<hidden>)"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, JobSecret) and hmac.compare_digest(self._raw, other._raw)

    def __hash__(self) -> int:
        return hash(self.derive("hash"))

    def __reduce__(self):  # handed to stage processes at start (never over a socket)
        return (JobSecret, (self._raw,))

    def derive(self, label: str) -> bytes:
        """A 32-byte key for one purpose, independent of every other label's."""
        return hmac.new(self._raw, b"pipeq/" + label.encode(), hashlib.sha256).digest()

    # -- rendezvous store entries --------------------------------------------------------------
    def sign(self, name: str, value: object) -> bytes:
        """``value`` (JSON-able) as a store entry for key ``name``, with its MAC."""
        body = json.dumps(value, sort_keys=True)
        return json.dumps({"value": body, "mac": self._store_mac(name, body)}).encode()

    def verify(self, name: str, raw: bytes) -> tuple[bool, object]:
        """``(True, value)`` if ``raw`` is an entry for ``name`` signed with this secret, else
        ``(False, None)``: unsigned, signed with another secret, or moved from another key."""
        try:
            entry = json.loads(raw.decode())
            body, mac = entry["value"], entry["mac"]
            if not (isinstance(body, str) and isinstance(mac, str)):
                return False, None
            if not hmac.compare_digest(mac, self._store_mac(name, body)):
                return False, None
            return True, json.loads(body)
        except (UnicodeDecodeError, ValueError, KeyError, TypeError):
            return False, None

    def _store_mac(self, name: str, body: str) -> str:
        return hmac.new(self.derive("store"), name.encode() + b"\0" + body.encode(), hashlib.sha256).hexdigest()
