"""The package's layering holds: imports point down only, no cycles, the codec behind the transport.

    control plane   runner, launch, driver, agent, ... start and command the stage processes
    event loop      worker (and the simulated engine) run a schedule's actions
    compute         schedules (pure), executors, checkpoints, traces' format
    transport       ZeroMQ sockets and queues: the only user of the codec
    codec           bytes on the wire, the message vocabulary and the job's keys everyone shares

A module may import modules of its own layer or below (lazy imports inside functions count too).
"""

from __future__ import annotations

import ast
import os

import pipeq

PACKAGE = os.path.dirname(pipeq.__file__)

LAYERS: dict[str, list[str]] = {
    "control plane": ["__init__", "__main__", "cli", "launch", "agent", "job", "runner", "options",
                      "batching", "driver", "supervisor", "tracing", "processes", "forkserver", "rendezvous", "report",
                      "plot", "evaluation"],
    "event loop": ["_preload", "worker", "simulated", "interpreter"],
    "compute": ["schedules", "actions", "dryrun", "bounds", "executors", "stage", "microbatch", "numerics", "interlock",
                "asyncpipe", "al", "al_models", "resnet", "checkpoint", "dataparallel", "tensorpar", "trace", "testing", "lr_schedulers",
                "balance"],
    "transport": ["transport", "shm", "lanes", "shardlink"],
    "codec": ["codec", "messages", "errors", "netif", "keys"],
}
RANK = {m: i for i, mods in enumerate(LAYERS.values()) for m in mods}
#: Modules that do no I/O: they import nothing but these and the standard library's pure parts.
PURE = {"schedules", "actions", "dryrun", "bounds", "errors"}


def modules() -> list[str]:
    return sorted(f[:-3] for f in os.listdir(PACKAGE) if f.endswith(".py"))


def imports(module: str) -> set[str]:
    """The pipeq modules ``module`` imports, anywhere in its source."""
    tree = ast.parse(open(os.path.join(PACKAGE, module + ".py")).read())
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            out.update([node.module.split(".")[0]] if node.module else [a.name for a in node.names])
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "pipeq":
            out.add(node.module.split(".")[1] if "." in node.module else "__init__")
        elif isinstance(node, ast.Import):
            out.update(a.name.split(".")[1] for a in node.names if a.name.startswith("pipeq."))
    return out & set(modules())


def test_every_module_has_a_layer():
    assert sorted(set(modules()) - set(RANK)) == [], "add new modules to LAYERS"


def test_imports_point_down_only():
    upward = [f"{m} ({layer_of(m)}) imports {d} ({layer_of(d)})"
              for m in modules() for d in sorted(imports(m)) if RANK[d] < RANK[m]]
    assert upward == []


def layer_of(module: str) -> str:
    return next(name for name, mods in LAYERS.items() if module in mods)


def test_no_import_cycles():
    graph = {m: imports(m) for m in modules()}
    done: set[str] = set()

    def visit(m: str, path: list[str]) -> None:
        if m in path:
            raise AssertionError("import cycle: " + " -> ".join(path[path.index(m):] + [m]))
        if m in done:
            return
        for d in sorted(graph[m]):
            visit(d, path + [m])
        done.add(m)

    for m in graph:
        visit(m, [])


def test_only_the_transport_uses_the_codec():
    users = sorted(m for m in modules() if "codec" in imports(m))
    # shardlink: a tensor-parallel stage's shard 0 shares messages with its other shards as
    # the codec's frames (over gloo, not ZeroMQ): the transport layer's other wire
    assert users == ["shardlink", "transport"]
    assert not any("zmq" in open(os.path.join(PACKAGE, m + ".py")).read()
                   for m in modules() if m not in ("transport",))


def test_schedules_are_pure():
    for m in PURE:
        assert imports(m) <= PURE, f"{m} imports {sorted(imports(m) - PURE)}"
