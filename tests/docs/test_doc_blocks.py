"""Every runnable Python block of the README and of docs/ runs, page by page, as a reader would
run it (a notebook's file-less ``__main__``; runners fork from the fork server to save time)."""

from __future__ import annotations

import os

import pytest

from doc_blocks import pages, python_blocks, run_page

RUNNABLE = [p for p in pages() if any(b.not_run is None for b in python_blocks(p))]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("page", RUNNABLE)
def test_the_pages_blocks_run(page, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # what a block writes (checkpoints, traces) goes here
    monkeypatch.setenv("PIPEQ_START_METHOD", "forkserver")
    assert run_page(page) >= 1
