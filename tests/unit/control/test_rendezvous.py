"""Multi-host settings: flags over torchrun's and SLURM's environment, placement, bind address;
and job files (keys, types, overrides)."""

from __future__ import annotations

import json
import os
import time

import pytest

from launch_util import DIGITS_JOB, SECRET
from pipeq.control import rendezvous as rdzv
from pipeq.launch.job import load_job
from pipeq.wire.keys import HOW_TO_MAKE, JobSecret, SecretError

OTHER = "another secret, of at least 32 characters"


def test_single_host_without_settings() -> None:
    assert rdzv.Rendezvous.from_settings(env={}) is None
    assert rdzv.Rendezvous.from_settings(env={"WORLD_SIZE": "1", "RANK": "0"}) is None


def test_torchrun_environment() -> None:
    env = {"WORLD_SIZE": "2", "RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29555",
           "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "TORCHELASTIC_USE_AGENT_STORE": "True",
           "TORCHELASTIC_RUN_ID": "job7", "PIPEQ_SECRET": SECRET}
    rz = rdzv.Rendezvous.from_settings(env=env)
    assert rz is not None
    assert (rz.nnodes, rz.node_rank, rz.master_addr, rz.master_port) == (2, 1, "127.0.0.1", 29555)
    assert rz.agent_store and rz.local_rank == 1 and rz.local_world_size == 2
    assert rz.run_id == "job7" and rz.bind == "127.0.0.1"
    assert rz.secret == JobSecret.from_text(SECRET)


def test_slurm_environment_and_flags_win() -> None:
    env = {"SLURM_NTASKS": "3", "SLURM_PROCID": "2", "MASTER_ADDR": "127.0.0.1", "SLURM_JOB_ID": "99",
           "PIPEQ_SECRET": SECRET}
    rz = rdzv.Rendezvous.from_settings(env=env)
    assert rz is not None and (rz.nnodes, rz.node_rank, rz.master_port) == (3, 2, rdzv.DEFAULT_PORT)
    assert rz.run_id == "99" and not rz.agent_store
    rz = rdzv.Rendezvous.from_settings(nnodes=2, node_rank=0, master_port=30000, env=env)
    assert rz is not None and (rz.nnodes, rz.node_rank, rz.master_port) == (2, 0, 30000)


@pytest.mark.parametrize(
    "kwargs, env, match",
    [
        ({"nnodes": 2}, {"MASTER_ADDR": "127.0.0.1"}, "needs this node's rank"),
        ({"nnodes": 2, "node_rank": 2}, {"MASTER_ADDR": "127.0.0.1"}, "outside 0..1"),
        ({"nnodes": 2, "node_rank": 0}, {}, "--master-addr"),
        ({"nnodes": 2, "node_rank": 0, "master_addr": "127.0.0.1", "master_port": 70000}, {}, "not a TCP port"),
        ({}, {"WORLD_SIZE": "two"}, "WORLD_SIZE='two' is not an integer"),
        ({"bind": "127.0.0.1"}, {}, "--bind only applies"),
        ({"nnodes": 2, "node_rank": 0, "master_addr": "127.0.0.1", "bind": "no-such-if0"},
         {"PIPEQ_SECRET": SECRET}, "neither an address, an interface nor a host name"),
        ({"nnodes": 2, "node_rank": 0, "master_addr": "127.0.0.1"}, {},
         "a multi-host run needs the job's secret on every node: make one with `python -m pipeq secret"),
        ({"nnodes": 2, "node_rank": 1, "master_addr": "127.0.0.1"}, {"PIPEQ_SECRET": "short"},
         r"\$PIPEQ_SECRET holds 5 characters, a job secret needs at least 32"),
    ],
)
def test_bad_settings_say_what_to_do(kwargs, env, match) -> None:
    with pytest.raises(ValueError, match=match):
        rdzv.Rendezvous.from_settings(env=env, **kwargs)


def test_bind_takes_an_address_or_an_interface() -> None:
    assert rdzv.resolve_bind("lo", "10.1.2.3", 1) == "127.0.0.1"
    assert rdzv.resolve_bind("127.0.0.1", "10.1.2.3", 1) == "127.0.0.1"
    assert rdzv.resolve_bind(None, "127.0.0.1", 29500) == "127.0.0.1"  # the route to the master


def test_placement() -> None:
    assert rdzv.placement(3, 2) == [[0], [1, 2]]
    assert rdzv.placement(4, 2) == [[0, 1], [2, 3]]
    assert rdzv.placement(3, 2, [[0, 1], [2]]) == [[0, 1], [2]]
    with pytest.raises(ValueError, match="some nodes would run nothing"):
        rdzv.placement(2, 3)
    with pytest.raises(ValueError, match="exactly once"):
        rdzv.placement(3, 2, [[0], [0, 2]])
    with pytest.raises(ValueError, match="lists 1 node"):
        rdzv.placement(3, 2, [[0, 1, 2]])


def test_job_file_overrides_and_recipe(tmp_path) -> None:
    job = load_job(DIGITS_JOB, {"steps": 5, "schedule": "fill-drain", "out": None})
    assert (job.steps, job.schedule, job.out, job.microbatches) == (5, "fill-drain", "runs/digits", 4)
    r = job.recipe
    assert r.count_stages() == 3
    spec = r.build(2, 3)
    assert spec.loss_fn is not None and r.build(0, 3).loss_fn is None
    o = spec.optimizer(spec.module.parameters())
    assert o.param_groups[0]["lr"] == 0.05 and o.param_groups[0]["momentum"] == 0.9
    assert spec.lr_scheduler(o).step_size == 60
    # every host builds the same weights
    a, b = r.build_stage(1, 3), r.build_stage(1, 3)
    assert all((p == q).all() for p, q in zip(a.parameters(), b.parameters()))


@pytest.mark.parametrize(
    "text, match",
    [
        ("", "missing required key"),
        ('stages = 3', "stages must be a str"),
        ('stages = "a:b"\nloss = "c:d"\noptimizer = "e:f"\ndata = "g:h"', "set steps or epochs"),
        ('stages = "a:b"\nloss = "c:d"\noptimizer = "e:f"\ndata = "g:h"\nsteps = 0', "steps must be at least 1"),
        ('stages = "a:b"\nloss = "c:d"\noptimizer = "e:f"\ndata = "g:h"\nsteps = 2\nlr = 3', "unknown key"),
        ('stages = [', "job file"),
    ],
)
def test_bad_job_files(tmp_path, text, match) -> None:
    path = tmp_path / "job.toml"
    path.write_text(text)
    with pytest.raises(ValueError, match=match):
        load_job(str(path))


def test_unimportable_names_are_reported_with_their_key(tmp_path) -> None:
    path = tmp_path / "job.toml"
    path.write_text('stages = "no_such_module_xyz:stages"\nloss = "torch.nn:CrossEntropyLoss"\n'
                    'optimizer = "torch.optim:SGD"\ndata = "g:h"\nsteps = 1\n')
    with pytest.raises(ValueError, match="stages = 'no_such_module_xyz:stages': cannot import"):
        load_job(str(path)).recipe.count_stages()
    path.write_text(path.read_text().replace("no_such_module_xyz:stages", "os.path"))
    with pytest.raises(ValueError, match="expected 'package.module:name'"):
        load_job(str(path)).recipe.count_stages()
    assert os.path.exists(DIGITS_JOB)


@pytest.mark.parametrize(("schedule", "reason"), [
    ("al", "schedule 'al' trains pipeq.research.ALLayer stages"),
    ("pairwise", "schedule 'pairwise' trains with auxiliary heads: name them in the job"),
])
def test_job_recipes_refuse_schedules_their_stages_cannot_train(schedule, reason) -> None:
    """The digits recipe has plain stages and no heads (tests/launch/test_launch_stream.py trains recipes
    with both)."""
    import pipeq

    recipe = load_job(DIGITS_JOB).recipe
    with pytest.raises(ValueError, match=reason):
        pipeq.PipelineRunner(recipe, None, None, schedule)


# -- the job secret -------------------------------------------------------------------------------
def _rz(node_rank: int = 1, secret: str = SECRET, run_id: str = "pipeq", port: int = 1) -> rdzv.Rendezvous:
    return rdzv.Rendezvous(nnodes=2, node_rank=node_rank, master_addr="127.0.0.1", master_port=port,
                           bind="127.0.0.1", run_id=run_id, secret=JobSecret.from_text(secret))


def test_multi_host_without_a_secret_says_how_to_make_one() -> None:
    with pytest.raises(ValueError) as info:
        rdzv.Rendezvous.from_settings(nnodes=2, node_rank=0, master_addr="127.0.0.1", env={"SLURM_JOB_ID": "5"})
    assert HOW_TO_MAKE in str(info.value)


def test_secret_file_only_its_owner_may_read(tmp_path) -> None:
    path = tmp_path / "job.secret"
    path.write_text(SECRET + "\n")
    path.chmod(0o600)
    flags = {"nnodes": 2, "node_rank": 1, "master_addr": "127.0.0.1"}
    # the file wins over the environment
    rz = rdzv.Rendezvous.from_settings(**flags, env={"PIPEQ_SECRET": OTHER}, secret_file=str(path))
    assert rz is not None and rz.secret == JobSecret.from_text(SECRET)
    assert "hidden" in repr(rz.secret) and SECRET not in repr(rz)
    for mode in (0o644, 0o640, 0o604):
        path.chmod(mode)
        with pytest.raises(SecretError, match=f"readable by others \\(mode {mode:o}\\); chmod 600 {path}"):
            rdzv.Rendezvous.from_settings(**flags, env={}, secret_file=str(path))
    with pytest.raises(SecretError, match="cannot read the secret file"):
        rdzv.Rendezvous.from_settings(**flags, env={}, secret_file=str(tmp_path / "missing"))
    path.write_text("too short")
    path.chmod(0o600)
    with pytest.raises(SecretError, match="holds 9 characters"):
        rdzv.Rendezvous.from_settings(**flags, env={}, secret_file=str(path))


def test_signed_entries_verify_only_under_their_key_run_and_secret() -> None:
    rz = _rz()
    raw = rz.sign("control", "tcp://10.0.0.1:5555")
    assert rz.verify("control", raw) == (True, "tcp://10.0.0.1:5555")
    assert _rz(node_rank=0).verify("control", raw) == (True, "tcp://10.0.0.1:5555")  # any node, same secret
    assert rz.verify("placement", raw) == (False, None)  # moved to another key
    assert _rz(run_id="other").verify("control", raw) == (False, None)  # ... or another run's store
    assert _rz(secret=OTHER).verify("control", raw) == (False, None)  # another secret
    entry = json.loads(raw)
    tampered = json.dumps({**entry, "value": json.dumps("tcp://6.6.6.6:5555")}).encode()
    assert rz.verify("control", tampered) == (False, None)  # the value changed, the MAC kept
    assert rz.verify("control", json.dumps({**entry, "mac": "0" * 64}).encode()) == (False, None)
    forged = _rz(secret=OTHER).sign("control", "tcp://6.6.6.6:5555")
    assert rz.verify("control", forged) == (False, None)
    for junk in (json.dumps("tcp://6.6.6.6:5555").encode(), b"", b"\xff\xfe", b"[1, 2]", b'{"value": 1, "mac": 2}',
                 json.dumps({"value": entry["value"]}).encode()):
        assert rz.verify("control", junk) == (False, None), junk
    # every node agrees on the bytes: JSON with sorted keys, no pickles
    value = {"b": [1, 2], "a": {"y": None, "x": "z"}}
    assert rz.verify("job", rz.sign("job", value)) == (True, value)
    assert rz.sign("job", value) == _rz(node_rank=0).sign("job", value)


@pytest.fixture
def store():
    """A rendezvous store hosted in this process: (port, a client of it under run id "pipeq")."""
    import datetime

    from torch.distributed import PrefixStore, TCPStore

    host = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                    timeout=datetime.timedelta(seconds=10))
    yield host.port, PrefixStore("pipeq/pipeq/", host)


@pytest.mark.timeout(30)
def test_read_never_waits_and_tells_valid_from_foreign(store) -> None:
    port, s = store
    rz = _rz(port=port)
    t0 = time.monotonic()
    assert rz.read(s, "control") == (rdzv.MISSING, None)
    s.set("control", json.dumps("tcp://6.6.6.6:1").encode())
    assert rz.read(s, "control") == (rdzv.FOREIGN, None)
    s.set("control", rz.sign("control", "tcp://127.0.0.1:2"))
    assert rz.read(s, "control") == (rdzv.VALID, "tcp://127.0.0.1:2")
    assert rdzv.peek(s, "control") == rz.sign("control", "tcp://127.0.0.1:2")
    s.delete_key("control")
    assert rdzv.peek(s, "control") is None and not s.check(["control"])  # peeking wrote nothing
    assert time.monotonic() - t0 < 2


@pytest.mark.timeout(30)
def test_republisher_puts_overwritten_and_deleted_entries_back(store) -> None:
    port, s = store
    rz = _rz(node_rank=0, port=port)
    entries = {key: rz.sign(key, key.upper()) for key in ("control", "placement")}
    pub = rdzv.Republisher(rz, entries, interval=0.05).start()
    try:
        for attack in range(3):
            s.set("control", json.dumps("tcp://6.6.6.6:1").encode())
            s.delete_key("placement")
            _until(lambda: rdzv.peek(s, "control") == entries["control"]
                   and rdzv.peek(s, "placement") == entries["placement"], 5, "the entries to come back")
    finally:
        pub.stop()
    assert not pub._thread.is_alive()
    s.delete_key("control")
    time.sleep(0.2)
    assert rdzv.peek(s, "control") is None  # stopped: nothing writes any more


def _until(pred, timeout: float, what: str) -> None:
    end = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.02)


@pytest.mark.timeout(30)
def test_agent_waits_past_forged_entries_for_node_0s(store) -> None:
    """Unsigned, another secret's, or node 0's entry for another key: ignored (with one warning)
    until a signed one is there, however long it takes within the start timeout."""
    import threading

    from pipeq.launch.agent import _fetch

    port, s = store
    rz = _rz(port=port)
    node0 = _rz(node_rank=0, port=port)
    lines: list[str] = []
    s.set("control", json.dumps("tcp://6.6.6.6:1").encode())

    def forge_then_publish() -> None:
        for raw in (_rz(secret=OTHER, port=port).sign("control", "tcp://6.6.6.6:1"),
                    node0.sign("placement", "tcp://6.6.6.6:1")):
            time.sleep(0.15)
            s.set("control", raw)
        time.sleep(0.15)
        s.set("control", node0.sign("control", "tcp://127.0.0.1:7"))

    t = threading.Thread(target=forge_then_publish)
    t.start()
    try:
        got = _fetch(s, "control", "control address", rz, time.monotonic() + 10, 10, lines.append)
    finally:
        t.join()
    assert got == "tcp://127.0.0.1:7"
    assert len(lines) == 1 and "ignoring the rendezvous store's 'control' entry" in lines[0], lines


@pytest.mark.timeout(30)
def test_agent_with_another_secret_says_so_after_the_start_timeout(store) -> None:
    from pipeq.launch.agent import AgentError, _fetch

    port, s = store
    s.set("control", _rz(node_rank=0, port=port).sign("control", "tcp://127.0.0.1:7"))
    lines: list[str] = []
    t0 = time.monotonic()
    with pytest.raises(AgentError) as info:
        _fetch(s, "control", "control address", _rz(secret=OTHER, port=port), t0 + 0.5, 0.5, lines.append)
    assert time.monotonic() - t0 >= 0.5  # a forger cannot make a good node give up early
    message = str(info.value)
    assert "node 1: node 0's control address ('control' at the rendezvous 127.0.0.1:" in message
    assert "not signed with this node's job secret" in message and "different secrets" in message
    assert "--secret-file" in message and "PIPEQ_SECRET" in message
    assert len(lines) == 1 and "another secret" in lines[0]
    # nothing there at all: node 0 is not started (the old message)
    with pytest.raises(AgentError, match="node 0 did not publish its run options"):
        _fetch(s, "options", "run options", _rz(port=port), time.monotonic() + 0.2, 0.2, lines.append)


class _GoneStore:
    """A store whose server went away: every request fails as torch's TCPStore client does."""

    def compare_set(self, *args: object) -> bytes:
        raise RuntimeError("Failed to recv, got 0 bytes. Connection was likely closed.")


def test_agent_that_loses_the_store_says_so_and_keeps_the_secret_diagnosis() -> None:
    from pipeq.launch.agent import AgentError, _fetch

    rz = _rz(port=7)
    with pytest.raises(AgentError, match=r"node 1: lost the rendezvous store \('control' at the rendezvous "
                                         r"127.0.0.1:7\) while waiting for node 0's control address \(Failed to "
                                         r"recv, got 0 bytes.*node 0 ended"):
        _fetch(_GoneStore(), "control", "control address", rz, time.monotonic() + 5, 5, print)


@pytest.mark.timeout(30)
def test_an_agent_that_saw_another_secret_and_then_lost_the_store_names_the_secret(store) -> None:
    """Node 0 (another secret) gives up first and takes its store with it: node 1 still says why."""
    from pipeq.launch.agent import AgentError, _fetch

    port, s = store
    s.set("control", _rz(node_rank=0, port=port).sign("control", "tcp://127.0.0.1:7"))

    class Vanishing:
        calls = 0

        def compare_set(self, *args: object) -> bytes:
            self.calls += 1
            if self.calls > 1:
                return _GoneStore().compare_set()
            return s.compare_set(*args)

    lines: list[str] = []
    with pytest.raises(AgentError, match=r"not signed with this node's job secret, and then the store went away.*"
                                         r"different secrets"):
        _fetch(Vanishing(), "control", "control address", _rz(secret=OTHER, port=port), time.monotonic() + 5, 5,
               lines.append)
    assert len(lines) == 1 and "another secret" in lines[0]


@pytest.mark.timeout(30)
def test_start_hint_names_a_node_with_another_secret(store) -> None:
    """Node 0's start time-out says which node's entries are there but signed with another
    secret, which registered, and which never came."""
    from pipeq.control.config import RunConfig
    from pipeq.control.driver import ProcessBackend
    from pipeq.control.processes import RunSetup
    from pipeq.stage.numerics import Numerics

    port, s = store
    rz = _rz(node_rank=0, port=port)
    backend = ProcessBackend([b""] * 3, RunSetup(RunConfig(microbatches=2), Numerics(), None), rendezvous=rz)
    backend.store = s
    assert backend.placement == [[0], [1, 2]]
    hint = backend._start_hint({1, 2})
    assert "stage(s) [1, 2] (node 1) never registered" in hint and "another secret" not in hint, hint
    s.set("agent/1", _rz(secret=OTHER, port=port).sign("agent/1", {"node": 1}))
    hint = backend._start_hint({1, 2})
    assert "node 1 uses another secret: its entries ['agent/1']" in hint, hint
    assert "--secret-file" in hint and "never registered" not in hint
    s.set("agent/1", rz.sign("agent/1", {"node": 1}))
    s.set("stage/1", rz.sign("stage/1", {"forward": "tcp://127.0.0.1:9"}))
    s.set("stage/2", json.dumps({"forward": "tcp://6.6.6.6:9"}).encode())  # unsigned: a forger's
    hint = backend._start_hint({1, 2})
    assert "stage(s) [1] (node 1) registered at the rendezvous but never reached" in hint, hint
    assert "node 1 uses another secret: its entries ['stage/2']" in hint, hint
    s.delete_key("stage/2")
    hint = backend._start_hint({1, 2})
    assert "node 1's agent reached the rendezvous but its stage(s) [2] never registered" in hint, hint
