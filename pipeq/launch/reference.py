"""The docs site's generated reference pages, as Markdown: the command line (from the parser
:func:`pipeq.launch.cli.build_parser` builds) and the job-file keys (from
:data:`pipeq.launch.job.keys.KEYS`). The site's build hook (docs/_hooks/generate.py) puts them in
place of the pages' markers; tests/unit/test_reference_pages.py checks that they hold every flag
and every key. Imports no torch."""

from __future__ import annotations

import argparse
import re
from typing import Any, Iterable

__all__ = ["cli_markdown", "job_keys_markdown", "schedule_options_markdown", "launch_flags", "subcommands"]

_SPECIAL = re.compile(r"([\\*_\[\]|])")


def _text(text: str) -> str:
    """``text`` as Markdown shows it literally: emphasis and link characters escaped, ``<`` and
    ``>`` as entities; what stands between backticks stays a code span, untouched."""
    text = text.replace("``", "`")  # reStructuredText's code spans, as a docstring writes them
    parts = text.split("`")
    for i in range(0, len(parts), 2):  # outside code spans
        parts[i] = _SPECIAL.sub(r"\\\1", parts[i]).replace("<", "&lt;").replace(">", "&gt;")
    if len(parts) % 2 == 0:  # an odd backtick: no code span at all
        return _SPECIAL.sub(r"\\\1", text).replace("<", "&lt;").replace(">", "&gt;")
    return "`".join(parts).replace("\n", " ")


def _code(text: str) -> str:
    """``text`` as one code span in a table cell (a ``|`` in it would end the cell)."""
    return "`" + text.replace("|", "&#124;") + "`" if "|" not in text else "<code>" + _html(text) + "</code>"


def _html(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace("|", "&#124;")


def subcommands(parser: argparse.ArgumentParser) -> dict[str, tuple[str, argparse.ArgumentParser]]:
    """The parser's subcommands, in the order it lists them: name -> (one-line help, parser)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help or "" for a in action._choices_actions}
            return {name: (helps.get(name, ""), sub) for name, sub in action.choices.items()}
    return {}


def _usage(parser: argparse.ArgumentParser) -> str:
    """The parser's usage line, as ``-h`` prints it, without the ``usage:`` in front."""
    formatter = argparse.HelpFormatter(parser.prog, width=100)
    formatter.add_usage(parser.usage, parser._actions, parser._mutually_exclusive_groups, prefix="")
    return formatter.format_help().strip()


def _names(action: argparse.Action) -> str:
    """A flag's spellings and its value: ``--steps N``, ``--plot OUT.png``, ``job``."""
    if not action.option_strings:
        return _code(action.metavar or action.dest)
    if action.nargs == 0:
        value = ""
    elif action.choices is not None and action.metavar is None:
        value = " {" + ",".join(str(c) for c in action.choices) + "}"
    else:
        value = " " + (action.metavar or action.dest.upper())
    return ", ".join(_code(f"{o}{value}") for o in action.option_strings)


def _help(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    """A flag's help with its ``%(default)s``-style fields filled in, and what it cannot go with."""
    text = argparse.HelpFormatter(parser.prog)._expand_help(action) if action.help else ""
    if action.required and action.option_strings:
        text += " (required)"
    for group in parser._mutually_exclusive_groups:
        if action in group._group_actions:
            others = [o.option_strings[0] for o in group._group_actions if o is not action]
            text += " (not with " + " or ".join(f"`{o}`" for o in others) + ")"
    if action.choices is not None and not action.option_strings:
        text += ". One of: " + ", ".join(f"`{c}`" for c in action.choices)
    return _text(text)


def _default(action: argparse.Action) -> str:
    if action.nargs == 0 or action.default in (None, argparse.SUPPRESS):
        return ""
    return _code(str(action.default))


def _flag_table(parser: argparse.ArgumentParser, actions: Iterable[argparse.Action]) -> list[str]:
    rows = ["| Argument | Default | What it does |", "| --- | --- | --- |"]
    for action in actions:
        if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
            continue
        rows.append(f"| {_names(action)} | {_default(action)} | {_help(parser, action)} |")
    return rows if len(rows) > 2 else []


def _command(name: str, summary: str, parser: argparse.ArgumentParser) -> list[str]:
    """One subcommand's section: what it does, its usage, a table of its arguments per group."""
    out = [f"## pipeq {name}", "", _text(summary[:1].upper() + summary[1:]) + ".", ""]
    if parser.description:
        out += [_text(parser.description), ""]
    out += ["```text", _usage(parser), "```", ""]
    for group in parser._action_groups:
        table = _flag_table(parser, group._group_actions)
        if not table:
            continue
        title = {"positional arguments": "Positional arguments", "options": "Options"}.get(group.title or "",
                                                                                          group.title or "")
        out += [f"**{_text(title[:1].upper() + title[1:])}**", ""] + table + [""]
    if parser.epilog:
        out += [_text(parser.epilog), ""]
    return out


def cli_markdown(parser: argparse.ArgumentParser | None = None) -> str:
    """The command-line reference: the ``pipeq`` command's usage and options, then a section per
    subcommand (``## pipeq launch`` ...) with its usage and a table of every argument per group."""
    if parser is None:
        from pipeq.launch.cli import build_parser

        parser = build_parser()
    out = ["```text", _usage(parser), "```", ""]
    out += _flag_table(parser, parser._actions) + [""]
    out += ["| Subcommand | What it does |", "| --- | --- |"]
    subs = subcommands(parser)
    out += [f"| [`{name}`](#pipeq-{name}) | {_text(summary)} |" for name, (summary, _) in subs.items()] + [""]
    for name, (summary, sub) in subs.items():
        out += _command(name, summary, sub)
    return "\n".join(out).rstrip() + "\n"


def _toml(value: Any) -> str:
    """A default as a job file writes it."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{k} = {_toml(v)}" for k, v in value.items()) + " }" if value else "{}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    return repr(value)


def launch_flags() -> dict[str, str]:
    """The job-file keys ``pipeq launch`` sets from its command line: key -> its flag (``--steps``)."""
    from pipeq.launch.args import job_overrides
    from pipeq.launch.cli import build_parser

    launch = subcommands(build_parser())["launch"][1]
    flags = {a.dest: a.option_strings[0] for a in launch._actions if a.option_strings}
    keys = job_overrides(argparse.Namespace(**{dest: None for dest in flags}))
    return {key: flags[key] for key in keys}


def job_keys_markdown() -> str:
    """The job-file reference: a table per section of :data:`~pipeq.launch.job.keys.SECTIONS`
    (key, type, default, the ``pipeq launch`` flag that replaces it, what it does), every key of
    :data:`~pipeq.launch.job.keys.KEYS` in one of them; then the schedules' options."""
    from pipeq.launch.job.keys import KEYS, SECTIONS

    flags = launch_flags()
    unknown = {key.section for key in KEYS.values()} - set(SECTIONS)
    if unknown:
        raise ValueError(f"job keys in sections {sorted(unknown)}, which SECTIONS does not list")
    out: list[str] = []
    for section, title in SECTIONS.items():
        names = [name for name, key in KEYS.items() if key.section == section]
        if not names:
            continue
        out += [f"### {title}", "", "| Key | Type | Default | Flag | What it does |", "| --- | --- | --- | --- | --- |"]
        for name in names:
            key = KEYS[name]
            kind = key.type_text() + (f" &ge; {key.minimum}" if key.minimum is not None else "")
            default = "required" if key.required else ("" if key.default is None else _code(_toml(key.default)))
            flag = _code(flags[name]) if name in flags else ""
            what = _text(key.help)
            out.append(f"| `{name}` | {kind} | {default} | {flag} | {what} |")
        out.append("")
    return "\n".join(out).rstrip() + "\n"


def schedule_options_markdown() -> str:
    """The options a ``schedule = { name = ..., ... }`` table takes, per registered schedule that
    takes any (its ``option_names``; a schedule that needs one says which)."""
    from pipeq import schedules

    by_entry: dict[tuple[Any, ...], list[str]] = {}
    for name, entry in schedules.SCHEDULES.items():
        options = tuple(getattr(entry, "option_names", ()))
        if options:
            by_entry.setdefault((id(entry), options, getattr(entry, "needs", None)), []).append(name)
    out = ["| Schedule | Options | Needs |", "| --- | --- | --- |"]
    for (_, options, needs), names in by_entry.items():
        out.append(f"| {', '.join(f'`{n}`' for n in names)} | {', '.join(f'`{o}`' for o in options)} | "
                   f"{f'`{needs}`' if needs else ''} |")
    return "\n".join(out) + "\n"
