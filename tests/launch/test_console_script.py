"""The pipeq console script runs as a command."""

import subprocess
import sys



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
