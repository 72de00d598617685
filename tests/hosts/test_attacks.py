"""The attack battery (issue 13): nobody without the job's secret can touch a run.

While a three-stage run trains over tcp, a hostile process (tests/support/attacker.py) connects to every
port the run listens on (the driver's control ROUTER, every stage's forward and backward PULL)
with ZeroMQ sockets of every type, without keys, with another secret's keys, with the right server
key but a key pair of its own, with a guessed PLAIN password and (in "authenticate" mode) with the
PLAIN password an eavesdropper reads off the wire; identities mimic pipeq's (s0, s1, h1, a1, s01).
It sends well-formed messages of every kind (pipeq's own codec: forged GRADIENT, ACTIVATION,
LOSS, OUTPUT, ERROR, HEARTBEAT...), each forged data message twice, floods of them, and malformed
ones (random bytes, truncated msgpack, a pickle that would create a file, absurd shapes, frame
counts and lengths, wrong kinds); and over raw TCP: junk, fake ZMTP greetings claiming NULL,
PLAIN, CURVE and GSSAPI, absurd frame lengths, 64 MiB handshake frames (one claiming 300 MiB)
and a flood of half-open connections.

The run completes, and its losses, predict output and final parameters equal an unattacked
run's bit for bit; nobody but the run's own processes ever completes a handshake (except the
eavesdropper's PLAIN one, whose messages the MACs drop), and the pickle never runs.

On loopback for both tcp_security modes and 1F1B and fill-drain, and across two network
namespaces (the run in one, the attacker in the other) for the default mode.
"""

from __future__ import annotations

import os
import pickle
import time

import pytest
import torch

from attacker import (Attack, Victim, batches, make_runner, pickle_payload, recorded_secret,
                      targets)
from netns import TwoHosts, netns_available
from pipeq.wire.control_link import Peer
from pipeq.testing import backend_of

STEP_LIMIT_S = 10.0  # an unattacked step takes milliseconds; a stall would take the heartbeat timeout


def train(mode: str, schedule: str, attack_spec: dict | None = None) -> dict:
    """One run of the victim's training (attacked by a fresh attacker if ``attack_spec``):
    losses, predict's output, the final state_dict, the attacker's report, and who the driver
    heard from."""
    data = batches()
    with recorded_secret() as made:
        runner = make_runner(mode, schedule)
        runner.start()
    senders: set = set()
    server = backend_of(runner).server
    real_recv = server.recv

    def recv(timeout_ms: int):
        got = real_recv(timeout_ms)
        if got is not None:
            senders.add(got[0])
        return got

    server.recv = recv
    report = None
    try:
        if attack_spec is None:
            losses = [runner.step(x, y) for x, y in data]
            out, state = runner.predict(data[0][0]), runner.state_dict()
        else:
            with Attack({**targets(runner, made[0], mode), **attack_spec}) as attack:
                losses = []
                for x, y in data:
                    attack.wait_round()  # a full round of attacks before each step, more during it
                    t0 = time.monotonic()
                    losses.append(runner.step(x, y))
                    assert time.monotonic() - t0 < STEP_LIMIT_S, "a step stalled under attack"
                attack.wait_round()
                out, state = runner.predict(data[0][0]), runner.state_dict()
                report = attack.stop()
    finally:
        runner.close()
    return {"losses": losses, "out": out, "state": state, "report": report, "senders": senders}


@pytest.fixture(scope="module")
def reference():
    """The unattacked run of each (mode, schedule), made once."""
    runs: dict = {}

    def get(mode: str, schedule: str) -> dict:
        if (mode, schedule) not in runs:
            runs[mode, schedule] = train(mode, schedule)
        return runs[mode, schedule]

    return get


def _gap(a: torch.Tensor, b: torch.Tensor) -> str:
    return f"differs by up to {(a.double() - b.double()).abs().max().item():.3g}"


def assert_same_run(got: dict, ref: dict) -> None:
    """Bit for bit: losses, predict's output, every parameter."""
    assert got["losses"] == ref["losses"]  # floats compared exactly
    assert torch.equal(got["out"], ref["out"]), f"predict's output {_gap(got['out'], ref['out'])}"
    assert list(got["state"]) == list(ref["state"])
    for name, t in ref["state"].items():
        assert torch.equal(got["state"][name], t), f"{name} {_gap(got['state'][name], t)}"


def assert_refused(report: dict, mode: str, n_ports: int) -> None:
    """The attacker did all it was built to, and got nowhere."""
    variants = ["null", "other-secret-curve", "other-secret-plain", "plain-guess", "server-key"]
    if mode == "authenticate":
        variants.append("sniffed-password")
    for v in variants:
        assert report["sent"].get(v, 0) > 0, f"{v}: nothing sent"
        seen = report["events"].get(v, {})
        assert seen.get("CONNECTED", 0) > 0, f"{v}: never connected: {seen}"
        if v != "sniffed-password":
            assert seen.get("HANDSHAKE_SUCCEEDED", 0) == 0, f"{v} got in: {seen}"
    # the right server key with a key pair of its own reaches the ZAP handler, which says no
    assert report["events"]["server-key"].get("HANDSHAKE_FAILED_AUTH", 0) > 0, report["events"]["server-key"]
    if mode == "authenticate":
        # an eavesdropper has the data channels' PLAIN password: its PUSH sockets get in (one per
        # data port), and only the MACs stand between its messages and the stages
        assert report["events"]["sniffed-password"].get("HANDSHAKE_SUCCEEDED", 0) >= n_ports - 1
    raw = report["raw"]
    assert report["sent"]["stream"] > 0
    assert raw["connections"] >= n_ports * len(report["scripts"])
    assert raw["held"] >= n_ports * 50
    assert raw["bytes"] > 64 << 20  # a 64 MiB frame went out whole (the driver reads handshakes of any size)
    for name in ("big-300M", "big-16G", "big-1T", "big-max"):
        assert sum(raw.get(f"{name}-{end}", 0) for end in ("reset", "sent-whole")) == n_ports, name
    assert sum(raw.get(f"big-64M-{end}", 0) for end in ("reset", "sent-whole")) == 1
    for name in ("pickle", "forged-GRADIENT", "forged-ACTIVATION", "forged-LOSS", "forged-OUTPUT",
                 "forged-ERROR", "forged-HEARTBEAT", "truncated-msgpack", "absurd-shape",
                 "absurd-frame-count", "wrong-kind", "kind-HEARTBEAT", "header-over-limit"):
        assert name in report["menu"], name
    assert report["menu_sent"] == report["menu"]  # every message went out, from one socket or more


def test_the_pickle_would_run_code(tmp_path) -> None:
    """The attacker's pickle is live: unpickled, it creates its marker (so that its absence after
    an attack means it never was)."""
    probe = tmp_path / "probe"
    pickle.loads(pickle_payload(str(probe)))
    assert probe.is_dir()


@pytest.mark.timeout(120)
# each security mode under one schedule (the wire and its checks do not depend on the schedule;
# both schedules are attacked): about 4 s a configuration
@pytest.mark.parametrize(("mode", "schedule"), [("encrypt", "1f1b"), ("authenticate", "fill-drain")])
def test_attacked_run_equals_the_unattacked_run(mode: str, schedule: str, reference, tmp_path) -> None:
    marker = tmp_path / "pwned"
    got = train(mode, schedule, {"marker": str(marker)})
    ref = reference(mode, schedule)
    assert_same_run(got, ref)
    assert not marker.exists(), "the attacker's pickle was unpickled"
    # the driver heard from its own stages and their heartbeats only
    assert got["senders"] <= {Peer(role, g) for role in "sh" for g in range(3)}, got["senders"]
    assert_refused(got["report"], mode, n_ports=7)


@pytest.mark.timeout(150)
def test_attack_from_another_network_namespace(reference, tmp_path) -> None:
    """The run in namespace b, bound to its veth address; the attacker in namespace a."""
    reason = netns_available()
    if reason:
        pytest.skip(reason)
    marker = tmp_path / "pwned"
    mode, schedule = "encrypt", "1f1b"
    with TwoHosts() as h:
        spec = {"host": h.addr_b, "mode": mode, "schedule": schedule, "out": str(tmp_path / "run.pt")}
        with Victim(spec, popen=lambda argv, **kw: h.popen(h.b, argv, **kw)) as victim:
            ref = reference(mode, schedule)  # made meanwhile, unless an earlier test made it
            where = victim.ready()
            assert all(a.startswith(f"tcp://{h.addr_b}:") for a in [where["control"], *where["data"]])
            with Attack({**where, "marker": str(marker)}, popen=lambda argv, **kw: h.popen(h.a, argv, **kw)) as attack:
                for _ in batches():
                    attack.wait_round()
                    t0 = time.monotonic()
                    victim.step()
                    assert time.monotonic() - t0 < STEP_LIMIT_S, "a step stalled under attack"
                attack.wait_round()
                got = victim.finish()
                report = attack.stop()
            victim.close()
        # the run's fork server and resource tracker leave once they see the victim gone
        end = time.monotonic() + 10
        while (h.procs(h.a) or h.procs(h.b)) and time.monotonic() < end:
            time.sleep(0.05)
    assert h.leftover == {h.a: [], h.b: []}, f"processes left in the namespaces: {h.leftover}"
    assert_same_run(got, ref)
    assert not marker.exists(), "the attacker's pickle was unpickled"
    assert_refused(report, mode, n_ports=7)
    assert os.path.exists(spec["out"])
