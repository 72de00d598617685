"""The job file's schedule: its name or table parsed, and the keys a schedule needs or refuses."""

from __future__ import annotations

import difflib
from typing import Any, Mapping

from pipeq import schedules
from pipeq.launch.job.keys import REQUIRED as _REQUIRED
from pipeq.launch.job.names import did_you_mean

__all__ = ["SCHEDULE_OPTIONS", "parse_schedule"]


#: The options a job file's schedule table may set, per schedule name (the others take none).
SCHEDULE_OPTIONS: dict[str, tuple[str, ...]] = {
    **{name: () for name in schedules.SCHEDULES},
    "nwise": ("distance",),
    "async": ("warmup", "weight_stashing"),
    "al": ("first_loss", "inference_layer"),
}


def parse_schedule(value: "str | Mapping[str, Any]") -> "str | schedules.ScheduleFn":
    """A job file's ``schedule``: a name (``"pairwise"``), or a table of the name and the
    schedule's options (``{ name = "nwise", distance = 2 }``), as the runner takes it."""
    options = {"name": value} if isinstance(value, str) else dict(value)
    name = options.pop("name", None)
    if not isinstance(name, str) or name not in SCHEDULE_OPTIONS:
        what = "a table without a name" if name is None else f"unknown name {name!r}"
        close = difflib.get_close_matches(name, list(SCHEDULE_OPTIONS), n=1) if isinstance(name, str) else []
        raise ValueError(f"schedule: {what}; " + (f"did you mean {close[0]!r}? " if close else "")
                         + f"choose one of {', '.join(sorted(SCHEDULE_OPTIONS))}, "
                         'e.g. schedule = "1f1b" or schedule = { name = "nwise", distance = 2 }')
    allowed = SCHEDULE_OPTIONS[name]
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise ValueError(f"schedule {name!r}: unknown option(s) {unknown}; "
                         + (did_you_mean(unknown, allowed, "allowed") if allowed else "it takes none"))
    if name == "nwise" and "distance" not in options:
        raise ValueError('schedule "nwise" needs its distance: schedule = { name = "nwise", distance = 2 }')
    if not options:
        return name
    if name in schedules.INTERLOCK:
        return schedules.Interlock(name, **options)
    if name == "async":
        return schedules.AsyncOneFOneB(**options)
    return schedules.AssociatedLearning(**options)


def _check_schedule_keys(path: str, raw: Mapping[str, Any]) -> None:
    """The keys the job's schedule needs or refuses: a loss (but with Associated Learning),
    auxiliary heads only with an interlocking schedule."""
    schedule = schedules.resolve(raw["schedule"])
    al = isinstance(schedule, schedules.AssociatedLearning)
    missing = [k for k in _REQUIRED if k not in raw and not (k == "stages" and "model" in raw)]
    missing += ["loss"] if "loss" not in raw and not al else []
    if missing:
        raise ValueError(f"job file {path}: missing required key(s) {missing}")
    for key in ("aux_heads", "aux_loss"):
        if key in raw and not isinstance(schedule, schedules.Interlock):
            raise ValueError(f"job file {path}: {key} trains with the interlocking schedules "
                             f"({', '.join(schedules.INTERLOCK)}), not with {schedules.schedule_name(schedule)!r}")
