"""Reading a job file: the TOML read, the command line's flags applied, the keys checked, a Job made."""

from __future__ import annotations

import os
import tomllib
from typing import Any, Mapping

from pipeq.launch.job.checks import check_keys, check_length, check_types, placement_nodes
from pipeq.launch.job.keys import KEYS, RECIPE_KEYS
from pipeq.launch.job.recipe import Recipe
from pipeq.launch.job.schedule import parse_schedule
from pipeq.launch.job.spec import Job

__all__ = ["load_job"]


def load_job(path: str, overrides: Mapping[str, Any] | None = None) -> Job:
    """Read ``path`` and apply ``overrides`` (command-line flags; None values are ignored)."""
    raw = _read(path)
    given = {k: v for k, v in (overrides or {}).items() if v is not None}
    check_length(path, raw, given)
    if "steps" in given or "epochs" in given:  # the command line's length replaces the file's
        raw.pop("steps", None)
        raw.pop("epochs", None)
    raw.update(given)
    check_types(path, raw)
    base = os.path.dirname(os.path.abspath(path))
    # the job's own directory and the current one: "examples.digits_job:stages" from the repo root
    sys_path = [os.getcwd(), base] + ([os.path.dirname(base)] if base != os.getcwd() else [])
    try:
        raw["schedule"] = parse_schedule(raw.get("schedule", KEYS["schedule"].default), sys_path)
    except ValueError as exc:
        raise ValueError(f"job file {path}: {exc}") from None
    check_keys(path, raw)
    nodes = placement_nodes(path, raw.pop("placement", None))
    recipe = Recipe(**{"loss": None, "stages": None, **{k: raw.pop(k) for k in list(raw) if k in RECIPE_KEYS}},
                    sys_path=sys_path, schedule=None if raw["schedule"] == "auto" else raw["schedule"])
    return Job(recipe=recipe, placement=nodes, path=os.path.abspath(path), **raw)


def _read(path: str) -> dict[str, Any]:
    """The job file's TOML table; a ``ValueError`` for a missing file or bad TOML."""
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ValueError(f"job file {path!r} does not exist") from None
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"job file {path}: {exc}") from None
