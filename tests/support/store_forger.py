"""A foreign client of a run's rendezvous store, for tests (not a test module).

Anyone who reaches the store's port can write it. ``python store_forger.py HOST PORT`` connects
(waiting for the store to come up) and, every ``--interval`` seconds until SIGTERM or until the
store goes away, writes under every key a pipeq node reads or publishes, in turn: an unsigned
value, one signed with another secret, node 0's genuine entry of another key (moved), or deletes
the key. Its values point elsewhere (a control address nobody listens on, another placement,
another schedule, "authenticate" instead of "encrypt"). At the end it prints ``rounds N`` (how many
times it overwrote everything) and, if it could not start, ``error ...`` with exit code 1.
"""

from __future__ import annotations

import argparse
import datetime
import json
import signal
import socket
import sys
import threading
import time

KEYS = ("control", "placement", "job", "options", "agent/1", "stage/0", "stage/1", "stage/2")
FORGED_CONTROL = "tcp://127.0.0.1:9"  # discard: nobody there


def forged_values() -> dict[str, object]:
    return {"control": FORGED_CONTROL, "placement": [[1, 2], [0]], "job": {"schedule": "gpipe"},
            "options": {"trace": False, "replicas": 1, "tcp_security": "authenticate"},
            "agent/1": {"node": 1}, **{f"stage/{k}": {"forward": FORGED_CONTROL} for k in range(3)}}


def forge(host: str, port: int, run_id: str, interval: float, done: threading.Event) -> int:
    """Forge until ``done`` or until the store is gone; the number of full rounds."""
    from torch.distributed import PrefixStore, TCPStore

    from pipeq.control import rendezvous as rdzv
    from pipeq.wire.keys import JobSecret

    deadline = time.monotonic() + 60
    while True:  # quietly: TCPStore's own retries log a C++ stack per attempt
        try:
            socket.create_connection((host, port), timeout=1.0).close()
            break
        except OSError:
            if time.monotonic() > deadline or done.wait(0.05):
                raise RuntimeError(f"no store at {host}:{port}") from None
    prefix = f"pipeq/{run_id}/"
    store = PrefixStore(prefix, TCPStore(host, port, is_master=False, wait_for_workers=False,
                                         timeout=datetime.timedelta(seconds=10)))
    other = JobSecret.from_text("the forger's own secret, 32 characters or more")
    values = forged_values()
    rounds = 0
    try:
        while not done.is_set():
            for i, key in enumerate(KEYS):
                how = (rounds + i) % 4
                if how == 0:
                    store.set(key, json.dumps(values[key]).encode())
                elif how == 1:
                    store.set(key, other.sign(prefix + key, values[key]))
                elif how == 2:  # node 0's signed entry of another key, moved here
                    moved = rdzv.peek(store, KEYS[(i + 1) % 4])
                    if moved is not None:
                        store.set(key, moved)
                else:
                    store.delete_key(key)
            rounds += 1
            done.wait(interval)
    except Exception:  # the store is gone: node 0 ended the run
        if rounds == 0:
            raise
    return rounds


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("host")
    p.add_argument("port", type=int)
    p.add_argument("--run-id", default="pipeq")
    p.add_argument("--interval", type=float, default=0.3)
    args = p.parse_args(argv)
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    try:
        rounds = forge(args.host, args.port, args.run_id, args.interval, done)
    except Exception as exc:
        print(f"error {type(exc).__name__}: {exc}", flush=True)
        return 1
    print(f"rounds {rounds}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
