"""The pipeq console script runs as a command."""

import json
import subprocess
import sys

import pytest


def test_console_script_installed():
    out = subprocess.run([sys.executable, "-m", "pipeq.launch.cli", "--version"], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.startswith("pipeq ")


#: In a fresh interpreter: ``pipeq --help`` and ``pipeq launch --help`` parsed, then whether torch came in.
_HELP_PROBE = """
import sys
from pipeq.launch.cli import main
for words in (["--help"], ["launch", "--help"]):
    try:
        main(words)
    except SystemExit:
        pass
print("torch imported:", "torch" in sys.modules)
"""


def test_help_imports_no_torch():
    """--help answers at once: neither the command's nor launch's imports torch (a second of its own)."""
    done = subprocess.run([sys.executable, "-c", _HELP_PROBE], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("usage: pipeq") == 2 and "usage: pipeq launch" in done.stdout
    assert done.stdout.strip().splitlines()[-1] == "torch imported: False"


def test_python_m_pipeq_help_imports_no_torch():
    """``python -m pipeq --help`` (pipeq/__main__.py) too, as -X importtime lists the imports."""
    done = subprocess.run([sys.executable, "-X", "importtime", "-m", "pipeq", "--help"], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    imported = {line.rsplit("|", 1)[-1].strip() for line in done.stderr.splitlines() if "|" in line}
    assert "pipeq.launch.cli" in imported and "torch" not in imported


#: In a fresh interpreter: what is process-wide (hooks, filters, handlers, environment...) before
#: and after ``import pipeq`` (argv[1] "light"), or after every public name is imported too, the
#: libraries it needs imported first, their own doing (argv[1] "all"); the difference as JSON.
_GLOBALS_PROBE = """
import atexit, importlib, json, logging, os, signal, socket, sys, threading, warnings

def state():
    return {"excepthook": repr(sys.excepthook), "displayhook": repr(sys.displayhook),
            "meta_path": [repr(f) for f in sys.meta_path], "path_hooks": [repr(h) for h in sys.path_hooks],
            "path": list(sys.path), "warnings": [repr(f) for f in warnings.filters],
            "signals": {s.name: repr(signal.getsignal(s)) for s in signal.Signals},
            "environ": dict(os.environ), "threads": threading.active_count(), "atexit": atexit._ncallbacks(),
            "logging": [repr(h) for h in logging.getLogger().handlers] + [logging.getLogger().level],
            "recursion": sys.getrecursionlimit(), "cwd": os.getcwd(), "socket_timeout": socket.getdefaulttimeout()}

if sys.argv[1] == "all":
    import multiprocessing.util, msgpack, numpy, torch, zmq  # noqa: F401
before = state()
import pipeq
torch_at_import = "torch" in sys.modules
if sys.argv[1] == "all":
    from pipeq.launch.reference import FRONTS
    for front in FRONTS:
        module = importlib.import_module(front)
        for name in module.__all__:
            getattr(module, name)
after = state()
print(json.dumps({"torch": torch_at_import, "changed": {k: [before[k], after[k]] for k in before if before[k] != after[k]}}))
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("what", ["light", "all"])
def test_importing_pipeq_changes_nothing_global(what):
    """``import pipeq`` imports no torch and changes nothing outside pipeq: no excepthook (a runner's
    start installs it), no import hook, no warnings filter, signal handler, environment variable,
    thread, exit handler or logging set-up; nor does importing every public name."""
    done = subprocess.run([sys.executable, "-c", _GLOBALS_PROBE, what], capture_output=True, text=True, timeout=100)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["changed"] == {}
    assert result["torch"] == (what == "all")
