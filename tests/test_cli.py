"""The pipeq console script."""

import subprocess
import sys

from pipeq.cli import main


def test_schedule_table(capsys):
    assert main(["schedule", "1f1b", "--stages", "3", "--microbatches", "4", "--backward-cost", "1"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "1f1b: 3 stages x 4 microbatches"
    assert out[1].split("|")[1].split()[:4] == ["F0", "F1", "F2", "."]
    assert len(out) == 4


def test_bad_counts_exit_2(capsys):
    assert main(["schedule", "gpipe", "--stages", "0", "--microbatches", "4"]) == 2
    assert "at least one stage" in capsys.readouterr().err


def test_console_script_installed():
    out = subprocess.run([sys.executable, "-m", "pipeq.cli", "--version"], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.startswith("pipeq ")
