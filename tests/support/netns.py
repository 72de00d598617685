"""Two "hosts" on one machine, for tests: a pair of Linux network namespaces joined by a veth.

Typical use::

    from netns import TwoHosts, netns_available

    reason = netns_available()
    if reason:
        pytest.skip(reason)

    with TwoHosts() as h:
        server = h.popen(h.b, [sys.executable, "-m", "some.server", "--bind", h.addr_b])
        client = h.popen(h.a, [sys.executable, "-m", "some.client", "--connect", h.addr_b])
        ...
    assert h.leftover == {h.a: [], h.b: []}, h.leftover   # nothing was left running

What ``TwoHosts`` sets up on enter:

* two namespaces named ``pq<8 hex>a`` / ``pq<8 hex>b`` (random, so concurrent runs don't clash);
* a veth pair ``pq<8 hex>va`` (in a) <-> ``pq<8 hex>vb`` (in b), created directly inside the
  namespaces so it never appears in the root namespace (all names fit IFNAMSIZ, <= 15 chars);
* a random private ``10.x.y.0/24``: a gets ``10.x.y.1`` (``addr_a``), b gets ``10.x.y.2``
  (``addr_b``); the veth ends and ``lo`` are up in both namespaces.

On exit (always: normal exit, exceptions, KeyboardInterrupt) it records the processes still
inside each namespace in ``leftover`` (before touching them), SIGKILLs them, waits briefly for
them to be gone, reaps the processes it started itself, and deletes both namespaces (the veth
is destroyed with them). If setup fails half-way, whatever was created is removed and a
``RuntimeError`` carrying ip's stderr is raised.

Zombies: a process that has exited but not been reaped is *not* reported by ``ip netns pids``
(checked on iproute2 6.1 / Linux: the kernel drops a task's namespaces in do_exit() before it
becomes a zombie, so ``/proc/<pid>/ns/net`` no longer resolves and ip skips it). ``procs`` (and
so ``leftover``) additionally filters out state ``Z`` from ``/proc/<pid>/stat`` to cover the
short window while a process is exiting and to not depend on that ip implementation detail.

Needs root (CAP_SYS_ADMIN + CAP_NET_ADMIN) and iproute2's ``ip``; use ``netns_available()`` to
skip otherwise. Linux only.
"""

from __future__ import annotations

import functools
import os
import random
import secrets
import shutil
import signal
import subprocess
import time

__all__ = ["TwoHosts", "ip_path", "netns_available"]

_IP_FALLBACKS = ("/usr/sbin/ip", "/sbin/ip")


def ip_path() -> str | None:
    """Absolute path of iproute2's ``ip`` (PATH first, then /usr/sbin/ip, /sbin/ip), or None."""
    found = shutil.which("ip")
    if found:
        return os.path.abspath(found)
    for cand in _IP_FALLBACKS:
        if os.path.isfile(cand) and os.access(cand, os.X_OK):
            return cand
    return None


def _run_ip(ip: str, *args: str, timeout: float = 10.0) -> subprocess.CompletedProcess:
    return subprocess.run([ip, *args], capture_output=True, text=True, timeout=timeout)


@functools.lru_cache(maxsize=None)
def netns_available() -> str | None:
    """None if this process can create network namespaces, else a human-readable reason.

    Besides the static checks (Linux, root, ``ip`` found) it really creates and deletes a
    throw-away namespace once (result cached), because root in an unprivileged container may
    still lack the capabilities.
    """
    if not os.path.isdir("/proc/self/ns"):
        return "network namespaces need Linux (/proc/self/ns missing)"
    if os.geteuid() != 0:
        return "network namespaces need root"
    ip = ip_path()
    if ip is None:
        return "iproute2 'ip' not found (PATH, /usr/sbin/ip, /sbin/ip)"
    probe = f"pq{secrets.token_hex(4)}p"
    try:
        res = _run_ip(ip, "netns", "add", probe)
    except (OSError, subprocess.SubprocessError) as e:
        return f"cannot run {ip}: {e}"
    if res.returncode != 0:
        return f"'ip netns add' failed: {res.stderr.strip() or res.returncode}"
    try:
        _run_ip(ip, "netns", "del", probe)
    except (OSError, subprocess.SubprocessError):
        pass
    return None


def _proc_info(pid: int) -> tuple[str, str] | None:
    """(state, comm) of a process from /proc, or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
        with open(f"/proc/{pid}/comm") as f:
            comm = f.read().strip()
    except OSError:
        return None
    # comm may contain spaces or ')', so the state is the first field after the *last* ')'
    state = stat[stat.rindex(")") + 2 :].split(" ", 1)[0]
    return state, comm


class TwoHosts:
    """Context manager: two network namespaces ``a`` and ``b`` joined by a veth pair.

    Attributes (valid after ``__enter__``): ``a``, ``b`` (namespace names), ``addr_a``,
    ``addr_b`` (IPv4 addresses as strings), ``ip`` (path of the ip binary), ``leftover``
    (set by ``__exit__``: ``{ns: [(pid, comm), ...]}`` of live processes still inside each
    namespace at exit, before they were killed; both lists empty means nothing was left).
    """

    def __init__(self, *, kill_timeout: float = 5.0) -> None:
        ip = ip_path()
        if ip is None:
            raise RuntimeError("iproute2 'ip' not found (PATH, /usr/sbin/ip, /sbin/ip)")
        self.ip = ip
        self.kill_timeout = kill_timeout
        tag = "pq" + secrets.token_hex(4)  # 10 chars; every name below is <= 12 chars
        self.a, self.b = tag + "a", tag + "b"
        self.veth_a, self.veth_b = tag + "va", tag + "vb"
        x, y = random.randrange(256), random.randrange(256)
        self.subnet = f"10.{x}.{y}.0/24"
        self.addr_a, self.addr_b = f"10.{x}.{y}.1", f"10.{x}.{y}.2"
        self.leftover: dict[str, list[tuple[int, str]]] = {}
        self._created: list[str] = []  # namespaces actually created, for cleanup
        self._children: list[subprocess.Popen] = []

    # -- setup / teardown -------------------------------------------------------------------

    def _ip(self, *args: str) -> str:
        res = _run_ip(self.ip, *args)
        if res.returncode != 0:
            raise RuntimeError(
                f"'ip {' '.join(args)}' failed (exit {res.returncode}): {res.stderr.strip()}")
        return res.stdout

    def __enter__(self) -> TwoHosts:
        try:
            for ns in (self.a, self.b):
                self._ip("netns", "add", ns)
                self._created.append(ns)
            # create the pair inside a with its peer directly in b: never visible in the root ns
            self._ip("-n", self.a, "link", "add", self.veth_a, "type", "veth",
                     "peer", "name", self.veth_b, "netns", self.b)
            for ns, dev, addr in ((self.a, self.veth_a, self.addr_a),
                                  (self.b, self.veth_b, self.addr_b)):
                self._ip("-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
                self._ip("-n", ns, "link", "set", dev, "up")
                self._ip("-n", ns, "link", "set", "lo", "up")
            self._wait_carrier()
        except BaseException:
            self._cleanup()
            raise
        return self

    def _wait_carrier(self, timeout: float = 5.0) -> None:
        # Admin-up is immediate but operstate (carrier) follows a moment later; wait for it so
        # the first packet a test sends doesn't race the link coming up.
        deadline = time.monotonic() + timeout
        while True:
            down = [dev for ns, dev in ((self.a, self.veth_a), (self.b, self.veth_b))
                    if "state UP" not in self._ip("-n", ns, "-o", "link", "show", "dev", dev)]
            if not down:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"veth {down} not operationally UP after {timeout}s")
            time.sleep(0.02)

    def __exit__(self, *exc) -> None:
        self._cleanup()

    def _cleanup(self) -> None:
        try:
            self.leftover = {ns: self._procs_safe(ns) for ns in (self.a, self.b)
                             if ns in self._created}
            self._kill_all()
        finally:
            for p in self._children:  # reap our own children so they don't linger as zombies
                try:
                    p.wait(timeout=1.0)
                except Exception:
                    pass
            for ns in self._created:
                try:
                    _run_ip(self.ip, "netns", "del", ns)
                except (OSError, subprocess.SubprocessError):
                    pass
            self._created = []

    def _procs_safe(self, ns: str) -> list[tuple[int, str]]:
        try:
            return self.procs(ns)
        except (RuntimeError, OSError, subprocess.SubprocessError):
            return []

    def _kill_all(self) -> None:
        deadline = time.monotonic() + self.kill_timeout
        while True:
            live = [pid for ns in self._created for pid, _ in self._procs_safe(ns)]
            if not live:
                return
            for pid in live:  # repeated each round: catches processes forked meanwhile
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            for p in self._children:  # a killed child of ours is a zombie until reaped
                p.poll()
            if time.monotonic() > deadline:
                return
            time.sleep(0.05)

    # -- running things inside ----------------------------------------------------------------

    def cmd(self, ns: str, argv: list[str]) -> list[str]:
        """The argv that runs ``argv`` inside namespace ``ns`` (``ip netns exec`` execs it, so
        the resulting process's pid is that of ``argv`` itself)."""
        return [self.ip, "netns", "exec", ns, *argv]

    def popen(self, ns: str, argv: list[str], **kw) -> subprocess.Popen:
        """Start ``argv`` inside ``ns``; ``kw`` goes to ``subprocess.Popen`` (env, stdout, cwd,
        ...). The process is killed (if still running) and reaped on exit."""
        p = subprocess.Popen(self.cmd(ns, argv), **kw)
        self._children.append(p)
        return p

    def pids(self, ns: str) -> list[int]:
        """``ip netns pids ns``: pids of processes whose network namespace is ``ns``."""
        return [int(tok) for tok in self._ip("netns", "pids", ns).split()]

    def procs(self, ns: str) -> list[tuple[int, str]]:
        """(pid, comm) of the live processes in ``ns``; zombies and vanished pids skipped."""
        out = []
        for pid in self.pids(ns):
            info = _proc_info(pid)
            if info is not None and info[0] != "Z":
                out.append((pid, info[1]))
        return out
