"""The docs site builds with ``mkdocs build --strict``: no broken link, no missing page or
reference, every generated reference (API, command line, job files) filled in."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from doc_blocks import ROOT


@pytest.mark.timeout(120)
def test_the_site_builds_strictly(tmp_path):
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    r = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=110)
    assert r.returncode == 0, r.stdout + r.stderr
    assert (tmp_path / "site" / "reference" / "api" / "index.html").is_file()
