"""The docs site's generated reference pages, as Markdown: the command line (from the parser
:func:`pipeq.launch.cli.build_parser` builds), the job-file keys (from
:data:`pipeq.launch.job.keys.KEYS`) and the Python API (from the public modules' ``__all__``,
:data:`FRONTS`). The site's build hook (docs/_hooks/generate.py) puts them in place of the pages'
markers; tests/unit/test_reference_pages.py checks that they hold every flag and every key, and
tests/unit/test_public_api.py that the API page documents the public names and nothing else.
Imports no torch, but for the API page (which imports the public modules)."""

from __future__ import annotations

import argparse
import re
from typing import Any, Iterable

__all__ = ["cli_markdown", "job_keys_markdown", "schedule_options_markdown", "launch_flags", "subcommands",
           "FRONTS", "API_SECTIONS", "api_markdown", "public_names", "attribute_docs", "runner_settings",
           "settings_markdown"]

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


#: The public modules: what users import from (each one's ``__all__`` is its public names). Every
#: other module of pipeq is its own and may change.
FRONTS = ("pipeq", "pipeq.schedules", "pipeq.research", "pipeq.split", "pipeq.balance", "pipeq.checkpoint",
          "pipeq.trace", "pipeq.models", "pipeq.models.resnet", "pipeq.testing")

#: The API page's sections: (title, what it says first, the public names it documents). A name
#: that is a public module (:data:`FRONTS`) documents the module and every name of its ``__all__``
#: not documented before; :func:`api_markdown` refuses a public name no section documents, and a
#: section's name that is not public.
API_SECTIONS: list[tuple[str, str, list[str]]] = [
    ("The runner", "", ["pipeq.PipelineRunner", "pipeq.Microbatches", "pipeq.StageMemory"]),
    ("Settings", "`PipelineRunner`'s keyword settings as one object (`config=`), each part documented in full.",
     ["pipeq.RunConfig", "pipeq.NumericsConfig", "pipeq.WireConfig", "pipeq.FaultConfig", "pipeq.PlacementConfig"]),
    ("What a stage declares",
     "A stage module may carry a `StageInfo` as its `pipeq_stage` attribute (`pipeq.split` and the runner's "
     "`ties=` set it): its tensors' names in the whole model, the keyword inputs it takes from the driver "
     "(`runner.step(x, y, stage_inputs=...)`), and its tied weights. It travels with the module, so the stage "
     "process, the driver and checkpoints read the same facts. `LRSchedule` says who steps the learning-rate "
     "schedulers, and how.",
     ["pipeq.StageInfo", "pipeq.Tie", "pipeq.set_info", "pipeq.info_of", "pipeq.LRSchedule"]),
    ("Splitting a model", "", ["pipeq.split", "pipeq.balance"]),
    ("Job files in Python", "See also the [job-file reference](job-file.md).",
     ["pipeq.Recipe", "pipeq.load_job", "pipeq.Job"]),
    ("Schedules", "", ["pipeq.schedules"]),
    ("Schedules of your own",
     "A schedule's `executor` hook may return a `StageExecutor` of its own (see "
     "[Writing your own schedule](../guides/custom-schedules.md)); a plan travels as "
     "torch.distributed.pipelining's schedule CSV.",
     ["pipeq.StageExecutor", "pipeq.from_csv", "pipeq.to_csv"]),
    ("Research schedules", "", ["pipeq.research"]),
    ("Traces", "", ["pipeq.trace"]),
    ("Checkpoints", "", ["pipeq.checkpoint"]),
    ("Multi-host runs", "", ["pipeq.Rendezvous"]),
    ("Errors", "", ["pipeq.PipelineError", "pipeq.MainScriptError", "pipeq.ScheduleError", "pipeq.CodecError"]),
    ("Ready-made models", "", ["pipeq.models.resnet"]),
    ("Testing helpers", "", ["pipeq.testing"]),
]

#: mkdocstrings' options for a documented name, beside the site's defaults (mkdocs.yml).
_OPTIONS: dict[str, dict[str, Any]] = {
    "pipeq.PipelineRunner": {
        "inherited_members": True, "group_by_category": False,
        "members": ["start", "close", "step", "predict", "evaluate", "stream", "state_dict", "model_state_dict",
                    "load_state_dict", "save", "load", "scheduler_step", "learning_rates", "last_step_lr", "stats",
                    "memory", "stage_processes",
                    "keep_snapshots", "snapshot", "restore_snapshot", "degraded_steps", "degraded_stages", "last_step_replicas", "steps_sent",
                    "replica_failures"]},
    "pipeq.RunConfig": {"members": False},
    "pipeq.Rendezvous": {"members": ["from_settings"]},
    "pipeq.StageExecutor": {"members": False},
    "pipeq.research.ALExecutor": {"members": False},
}


def public_names(front: str) -> list[str]:
    """The public names of the public module ``front`` (its ``__all__``), as dotted names."""
    import importlib

    if front not in FRONTS:
        raise ValueError(f"{front} is not a public module (pipeq.launch.reference.FRONTS)")
    return [f"{front}.{name}" for name in importlib.import_module(front).__all__]


def _object(dotted: str) -> Any:
    """What a public dotted name names (``pipeq.trace.analyze``: the function)."""
    import importlib

    front, name = dotted.rsplit(".", 1)
    return getattr(importlib.import_module(front), name)


def attribute_docs(cls: type) -> dict[str, str]:
    """The ``Attributes:`` section of ``cls``'s docstring (Google style): each name's text, its
    continuation lines joined."""
    import inspect

    out: dict[str, str] = {}
    inside, name = False, None
    for line in inspect.cleandoc(cls.__doc__ or "").splitlines():
        if line == "Attributes:":
            inside = True
        elif inside and line and not line.startswith(" "):  # the section ended
            break
        elif inside and (m := re.match(r"    (\w+): (.*)", line)):
            name = m[1]
            out[name] = m[2]
        elif inside and name is not None and line.startswith("        "):
            out[name] += " " + line.strip()
    return out


def runner_settings() -> list[tuple[type, list[str]]]:
    """The runner's settings (its keyword arguments that build a :class:`~pipeq.RunConfig`), by the
    RunConfig part that declares and documents each: ``[(NumericsConfig, ["precision", ...]), ...]``."""
    import dataclasses

    from pipeq.control.config import FaultConfig, NumericsConfig, PlacementConfig, RunConfig, WireConfig
    from pipeq.control.config import setting_fields

    settings = {id(f) for f in setting_fields()}
    return [(part, [f.name for f in dataclasses.fields(part) if id(f) in settings])
            for part in (NumericsConfig, WireConfig, FaultConfig, PlacementConfig, RunConfig)]


_ROLE = re.compile(r":\w+:`(~?)([^`]+)`")


def _plain(text: str) -> str:
    """A docstring's text with its reStructuredText roles as code spans (``:class:`~a.B``` -> ```B``)."""
    return _ROLE.sub(lambda m: "``" + (m[2].rsplit(".", 1)[-1] if m[1] else m[2]) + "``", text)


def settings_markdown() -> str:
    """The runner's settings as the API page lists them under the runner: a table per RunConfig part
    (setting, type, default, what it does), each setting's text its part's docstring's (the one
    place it is documented) and its default the part's field's."""
    import dataclasses

    from pipeq.control.config import setting_default

    out = ["### `PipelineRunner`'s settings", "",
           "Every keyword argument of `PipelineRunner` but those above is a setting of the run: together they build "
           "its [`RunConfig`][pipeq.RunConfig] (`config=` takes one whole). Each is documented where its part "
           "declares it, as here.", ""]
    for part, names in runner_settings():
        fields = {f.name: f for f in dataclasses.fields(part)}
        docs = attribute_docs(part)
        first = (part.__doc__ or "").strip().splitlines()[0].rstrip(".")
        out += [f"**[`{part.__name__}`][pipeq.{part.__name__}]**: {_text(_plain(first[:1].lower() + first[1:]))}.", "",
                "| Setting | Type | Default | What it does |", "| --- | --- | --- | --- |"]
        for name in names:
            out.append(f"| `{name}` | {_code(str(fields[name].type))} | {_code(repr(setting_default(name)))} | "
                       f"{_text(_plain(docs[name]))} |")
        out.append("")
    return "\n".join(out)


#: What the API page adds under a documented name, beside its docstring.
_AFTER = {"pipeq.PipelineRunner": settings_markdown}


def _key(value: Any) -> Any:
    """What tells two public names of one object apart from two equal values: the object itself
    for modules, classes, functions and containers; the name for a plain value (``VERSION = 1``)."""
    return id(value) if not isinstance(value, (int, float, str, bytes, tuple, frozenset, type(None))) else None


def _directive(dotted: str, options: dict[str, Any]) -> list[str]:
    """mkdocstrings' block that documents ``dotted`` with ``options`` (a list of members, or
    false for none)."""
    lines = [f"::: {dotted}"] + (["    options:"] if options else [])
    for key, value in options.items():
        text = ("[" + ", ".join(value) + "]" if value else "false") if isinstance(value, list) else str(value).lower()
        lines.append(f"      {key}: {text}")
    return lines + [""]


def api_markdown() -> str:
    """The Python API page: :data:`API_SECTIONS` in order, each public name documented once (a
    module with the names of its ``__all__`` that no section names and no earlier module holds),
    the list of public modules first. A public name no section documents, or a section's name that
    is not public, is a ValueError."""
    import types

    public = {name for front in FRONTS for name in public_names(front)} | set(FRONTS)
    listed = [name for _, _, names in API_SECTIONS for name in names]
    unknown = [name for name in listed if name not in public or name == "pipeq"]
    if unknown:
        raise ValueError(f"API_SECTIONS documents {unknown}, which no public module's __all__ holds")
    named = {_key(_object(name)) or name for name in listed}  # the objects a section names itself
    done: set[Any] = set()  # the objects documented so far
    out = ["The public modules: " + ", ".join(f"`{front}`" for front in FRONTS) + ". Each heading is a name to "
           "import (`pipeq.RunConfig`: `from pipeq import RunConfig`), a module's names come under its heading "
           "(`pipeq.trace`'s `analyze`: `from pipeq.trace import analyze`); pipeq's other modules are its own "
           "and may change.", ""]
    for title, intro, names in API_SECTIONS:
        out += [f"## {title}", ""] + ([intro, ""] if intro else [])
        for name in names:
            value = _object(name)
            done.add(_key(value) or name)
            if not (isinstance(value, types.ModuleType) and name in FRONTS):
                out += _directive(name, {"show_root_full_path": True, **_OPTIONS.get(name, {})})
                out += [_AFTER[name](), ""] if name in _AFTER else []
                continue
            members = []
            for member in public_names(name):
                key = _key(_object(member)) or member
                if key not in done and key not in named:
                    members.append(member.rsplit(".", 1)[1])
                    done.add(key)
            out += _directive(name, {"show_root_full_path": True, "show_submodules": False, "members": members})
    missing = [name for front in FRONTS for name in public_names(front) if (_key(_object(name)) or name) not in done]
    if missing:
        raise ValueError(f"public names no section of API_SECTIONS documents: {missing}")
    return "\n".join(out).rstrip() + "\n"
