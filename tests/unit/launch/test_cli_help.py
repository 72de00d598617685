"""Every flag of every ``pipeq`` subcommand has its help text (tests/launch/test_console_script.py:
``--help`` imports no torch)."""

import argparse

import pytest

from pipeq.launch import cli


def _parsers(parser: argparse.ArgumentParser, name: str = "pipeq"):
    """``parser`` and every subcommand's parser under it, with their command names."""
    yield name, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub_name, sub in action.choices.items():
                yield from _parsers(sub, f"{name} {sub_name}")


def _built_parser() -> argparse.ArgumentParser:
    """The parser cli.main builds (caught as it parses)."""
    seen = []
    original = argparse.ArgumentParser.parse_args

    def catch(self, *args, **kwargs):
        seen.append(self)
        raise SystemExit(0)

    argparse.ArgumentParser.parse_args = catch
    try:
        with pytest.raises(SystemExit):
            cli.main(["--version"])
    finally:
        argparse.ArgumentParser.parse_args = original
    return seen[0]


def test_every_flag_has_help():
    missing = []
    names = []
    for name, parser in _parsers(_built_parser()):
        names.append(name)
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                missing += [f"{name} {c.dest}" for c in action._choices_actions if not c.help]
            elif not action.help or action.help == argparse.SUPPRESS:
                missing.append(f"{name} {'/'.join(action.option_strings) or action.dest}")
    assert {"pipeq launch", "pipeq schedule", "pipeq report", "pipeq secret", "pipeq export"} <= set(names)
    assert missing == []
