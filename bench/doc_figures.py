"""Re-run what the docs quote accuracy figures from, and check each figure against what it prints.

    PYTHONPATH=. python bench/doc_figures.py            # every figure (a few minutes on 2 cores)
    PYTHONPATH=. python bench/doc_figures.py --only launch

Sources: the research job files' table in docs/guides/launch.md (each row's ``pipeq launch
examples/*.toml``, its final held-out accuracy), and the tables of docs/guides/research.md whose
rows name a command (``python examples/*.py ...``) and percentages the command prints. Exit code 1
when a figure does not match, listing it.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAUNCH_ROW = re.compile(r"^\| `pipeq launch (examples/\w+\.toml)` \|.*\| (\d+\.\d)% \|$", re.MULTILINE)
LAUNCH_TEXT = re.compile(r"`(examples/\w+\.toml)` \(1F1B\) reaches (\d+\.\d)%")
ACCURACY = re.compile(r"eval accuracy (\d\.\d+)")


def launch_figures() -> list[tuple[str, float]]:
    """(job file, quoted held-out accuracy in %) from docs/guides/launch.md."""
    with open(os.path.join(ROOT, "docs", "guides", "launch.md"), encoding="utf-8") as f:
        text = f.read()
    return [(job, float(pct)) for job, pct in LAUNCH_TEXT.findall(text) + LAUNCH_ROW.findall(text)]


def launch_accuracy(job: str) -> float:
    """``pipeq launch job``'s final held-out accuracy in %, as its summary prints it."""
    with tempfile.TemporaryDirectory() as out:
        r = subprocess.run([sys.executable, "-m", "pipeq", "launch", job, "--out", out, "--quiet"], cwd=ROOT,
                           capture_output=True, text=True, timeout=600)
    found = ACCURACY.findall(r.stdout)
    if r.returncode != 0 or not found:
        raise RuntimeError(f"pipeq launch {job} failed ({r.returncode}):\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")
    return round(100 * float(found[-1]), 1)


def check_launch() -> list[str]:
    """Every launch figure re-run: the mismatches."""
    bad = []
    for job, quoted in launch_figures():
        got = launch_accuracy(job)
        print(f"pipeq launch {job}: prints {got:.1f}%, the docs say {quoted:.1f}%", flush=True)
        if got != quoted:
            bad.append(f"{job}: {got:.1f}% printed, {quoted:.1f}% quoted")
    return bad


def research_figures() -> list[tuple[str, list[float]]]:
    """(command, quoted percentages) from docs/guides/research.md's "figures:" comments: a line
    ``<!-- figures: python examples/x.py --flag -> 97.8 99.2 98.9 98.3 -->`` before a table says
    which command prints its percentages, in the order it prints them."""
    with open(os.path.join(ROOT, "docs", "guides", "research.md"), encoding="utf-8") as f:
        text = f.read()
    return [(cmd.strip(), [float(v) for v in vals.split()])
            for cmd, vals in re.findall(r"<!-- figures: (.+?) -> ([\d. ]+?) -->", text)]


def check_research() -> list[str]:
    """Every research figure re-run: the mismatches."""
    bad = []
    for command, quoted in research_figures():
        r = subprocess.run(command.split(), cwd=ROOT, capture_output=True, text=True, timeout=1200,
                           env={**os.environ, "PYTHONPATH": ROOT})
        got = [float(v) for v in re.findall(r"(\d+\.\d)%", r.stdout)]
        print(f"{command}: prints {got}, the docs say {quoted}", flush=True)
        if r.returncode != 0 or got[:len(quoted)] != quoted and got[-len(quoted):] != quoted:
            bad.append(f"{command}: {got} printed, {quoted} quoted")
    return bad


def main(argv: list[str] | None = None) -> int:
    """Run the checks asked for; 1 when a figure does not match."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", choices=["launch", "research"], help="one group of figures only")
    args = p.parse_args(argv)
    bad = []
    if args.only in (None, "launch"):
        bad += check_launch()
    if args.only in (None, "research"):
        bad += check_research()
    for line in bad:
        print("MISMATCH", line)
    print("all figures match" if not bad else f"{len(bad)} figure(s) do not match")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
