"""MkDocs hook: fill the generated parts of the reference pages.

A page's marker line is replaced by Markdown rendered from the code that defines it (so the pages
never fall behind the code):

    <!-- generated: cli -->               every ``pipeq`` subcommand and flag, from the argparse parser
                                          (:func:`pipeq.launch.reference.cli_markdown`)
    <!-- generated: job-keys -->          every job-file key, a table per section, from
                                          ``pipeq.launch.job.keys.KEYS`` (``job_keys_markdown``)
    <!-- generated: schedule-options -->  the options a ``schedule = { name = ... }`` table takes
    <!-- generated: api -->               the Python API: mkdocstrings' blocks (``::: pipeq.RunConfig``)
                                          for every public name (``api_markdown``: the public modules'
                                          ``__all__``, in the sections of ``API_SECTIONS``)
    <!-- generated: compatibility -->     what does not run together, and why: ``pipeq.compat``'s
                                          one table (:func:`pipeq.compat.markdown`)

mkdocstrings renders the API page's blocks, with the docstrings' reStructuredText roles turned into
Markdown by docs/_hooks/griffe_roles.py.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Callable

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:  # this checkout's pipeq, whatever is installed
    sys.path.insert(0, ROOT)

from pipeq import compat  # noqa: E402
from pipeq.launch import reference  # noqa: E402

#: marker -> the function that renders what replaces it
GENERATORS: dict[str, Callable[[], str]] = {
    "<!-- generated: cli -->": reference.cli_markdown,
    "<!-- generated: job-keys -->": reference.job_keys_markdown,
    "<!-- generated: schedule-options -->": reference.schedule_options_markdown,
    "<!-- generated: api -->": reference.api_markdown,
    "<!-- generated: compatibility -->": compat.markdown,
}
#: the pages that must hold a marker (a page that lost its marker would silently lose its reference)
EXPECTED = {"reference/api.md": ["<!-- generated: api -->"], "reference/cli.md": ["<!-- generated: cli -->"],
            "reference/job-file.md": ["<!-- generated: job-keys -->", "<!-- generated: schedule-options -->"],
            "reference/compatibility.md": ["<!-- generated: compatibility -->"]}


def render(markdown: str, page_path: str = "") -> str:
    """``markdown`` with every marker line replaced by what it stands for; a page of
    :data:`EXPECTED` without its markers is an error."""
    for marker in EXPECTED.get(page_path.replace(os.sep, "/"), []):
        if marker not in markdown:
            raise ValueError(f"{page_path}: the marker {marker!r} is missing")
    for marker, generate in GENERATORS.items():
        if marker in markdown:
            markdown = markdown.replace(marker, generate())
    return markdown


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    """MkDocs' event: the page's Markdown, markers filled in."""
    return render(markdown, page.file.src_uri)
