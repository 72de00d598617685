"""The pipeq console script runs as a command."""

import subprocess
import sys



def test_console_script_installed():
    out = subprocess.run([sys.executable, "-m", "pipeq.launch.cli", "--version"], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.startswith("pipeq ")
