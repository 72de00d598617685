"""The docs site's generated reference pages hold everything they are generated from: every flag
of every ``pipeq`` subcommand, every job-file key (a key or flag added later appears without
anyone editing a page), every argument of ``PipelineRunner`` in its grouped docstring, and every
setting documented once, in its RunConfig part, and listed under the runner with its type, default
and meaning. Starts no process."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import inspect
import os
import re
import textwrap

import pipeq
from pipeq.control import config, runner
from pipeq.launch import reference
from pipeq.launch.cli import build_parser
from pipeq.launch.job.keys import KEYS, SECTIONS

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _hook():
    """docs/_hooks/generate.py, the MkDocs hook that fills the pages' markers."""
    spec = importlib.util.spec_from_file_location("docs_generate", os.path.join(ROOT, "docs", "_hooks", "generate.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_cli_page_has_every_subcommand_and_flag():
    page = reference.cli_markdown()
    subs = reference.subcommands(build_parser())
    assert set(subs) >= {"launch", "schedule", "report", "secret", "export"}
    for name, (_, parser) in subs.items():
        assert f"## pipeq {name}" in page
        for action in parser._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            for flag in action.option_strings or [action.dest]:
                assert f"`{flag}" in page or f"<code>{flag}" in page, f"pipeq {name}: {flag} missing"
            if action.help:
                first = action.help.split()[0].strip("`")
                assert first in page, f"pipeq {name} {action.dest}: its help is missing"


def test_the_job_file_page_has_every_key():
    page = reference.job_keys_markdown()
    for name, key in KEYS.items():
        assert f"| `{name}` |" in page, name
        assert f"### {SECTIONS[key.section]}" in page
    flags = reference.launch_flags()
    assert flags["steps"] == "--steps" and flags["checkpoint_every"] == "--checkpoint-every"
    assert set(flags) <= set(KEYS)


def test_the_schedule_options_table_has_every_option():
    table = reference.schedule_options_markdown()
    for name, entry in pipeq.SCHEDULES.items():
        for option in getattr(entry, "option_names", ()):
            assert f"`{name}`" in table and f"`{option}`" in table


def test_the_hook_fills_the_markers_the_pages_hold():
    hook = _hook()
    for page, markers in hook.EXPECTED.items():
        text = open(os.path.join(ROOT, "docs", page)).read()
        out = hook.render(text, page)
        assert all(m in text for m in markers) and not any(m in out for m in hook.GENERATORS)
    assert "| `microbatches` |" in hook.render("<!-- generated: job-keys -->")


def _documented() -> dict[str, str | None]:
    """PipelineRunner's own documented arguments, name -> the type written beside it (None: none),
    from the Google-style ``Args: <group>`` and ``Keyword Args: <group>`` sections the API reference
    renders as one table per group."""
    out: dict[str, str | None] = {}
    in_section = False
    for line in textwrap.dedent(runner.PipelineRunner.__doc__.split("\n", 1)[1]).splitlines():
        if re.match(r"(Args|Keyword Args): \S", line):
            in_section = True
        elif line and not line.startswith(" "):
            in_section = False
        elif in_section and (m := re.match(r"    (\w+)(?: \((.+?)\))?: ", line)):
            out[m[1]] = m[2]
    return out


def _pointed_to() -> dict[str, str]:
    """The settings the runner's docstring says where to look for: setting -> the RunConfig part
    named in front of it (its ``Settings:`` list, ``- :class:`~pipeq.WireConfig`: transport, ...``)."""
    doc = textwrap.dedent(runner.PipelineRunner.__doc__.split("\n", 1)[1])
    listed = doc[doc.index("\nSettings: "):].split("\n\n")[1]  # the list after the paragraph
    out: dict[str, str] = {}
    for item in re.split(r"^- ", listed, flags=re.MULTILINE)[1:]:
        part, names = re.match(r":class:`~pipeq\.(\w+)`: (.*)", " ".join(item.split()), re.DOTALL).groups()
        out.update({name.strip(): part for name in names.split(",")})
    return out


def test_every_runner_argument_is_documented_and_every_setting_where_the_runner_says():
    """The runner's own arguments are documented in its groups; every other parameter (a setting)
    is documented once, in the RunConfig part that declares it, which the runner's docstring names."""
    documented = _documented()
    params = list(inspect.signature(runner.PipelineRunner).parameters)  # every setting too (help(), IDEs)
    settings = {f.name for f in config.setting_fields()}
    assert sorted(set(params) - settings - set(documented)) == []
    assert sorted(set(documented) - set(params)) == [] and not set(documented) & settings
    pointed = _pointed_to()
    assert sorted(pointed) == sorted(settings)
    for part, names in reference.runner_settings():
        docs = reference.attribute_docs(part)
        for name in names:
            assert pointed[name] == part.__name__, name
            assert docs.get(name, "").strip(), f"{part.__name__}'s docstring does not document {name}"
    assert sorted(n for _, names in reference.runner_settings() for n in names) == sorted(settings)


def test_the_api_page_shows_every_setting_under_the_runner_with_its_default_and_meaning():
    page = reference.api_markdown()
    runner_section = page[page.index("::: pipeq.PipelineRunner"):page.index("\n## ", page.index("::: pipeq.PipelineRunner"))]
    for part, names in reference.runner_settings():
        docs = reference.attribute_docs(part)
        fields = {f.name: f for f in dataclasses.fields(part)}
        for name in names:
            row = next((line for line in runner_section.splitlines() if line.startswith(f"| `{name}` |")), None)
            assert row is not None, f"{name} is not listed under the runner"
            cells = [c.strip() for c in row.split(" | ")]
            assert cells[1] in (f"`{fields[name].type}`", f"<code>{fields[name].type.replace('|', '&#124;')}</code>")
            assert cells[2] == f"`{config.setting_default(name)!r}`", name
            first = re.sub(r"[`\\]", "", docs[name]).split()[:4]
            assert re.sub(r"[`\\]", "", cells[3]).split()[:4] == first, name


def test_the_api_page_lists_every_public_runner_method():
    """reference/api.md lists the runner's members by name (to order them): none may be left out."""
    page = _hook().render(open(os.path.join(ROOT, "docs", "reference", "api.md")).read(), "reference/api.md")
    block = page[page.index("::: pipeq.PipelineRunner"):]
    listed = re.search(r"members: \[([^\]]*)\]", block)[1]
    names = {n.strip() for n in listed.split(",")}
    public = {n for n in dir(runner.PipelineRunner) if not n.startswith("_")}
    assert sorted(public - names) == []
