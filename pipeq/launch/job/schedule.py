"""The job file's schedule: its name or table parsed, and the keys a schedule needs or refuses.

``schedule = "1f1b"`` names a registered schedule (:data:`pipeq.schedules.SCHEDULES`), a table
gives its options (``{ name = "nwise", distance = 2 }``: what the schedule's ``option_names``
allow), and ``"pkg.module:Name"`` names your own (a :class:`~pipeq.schedules.SchedulePolicy`
class, called with the table's options; an object; or a schedule function).
``"csv:plan.csv"`` runs a torch.distributed.pipelining schedule CSV (relative to the job file);
``{ name = "csv:zbv.csv", placement = "v" }`` one of two stages per process in a V.
``"auto"`` lets the runner choose from two profiled steps (:mod:`pipeq.control.auto_schedule`);
the job is checked as ZB-H1's meanwhile (every candidate needs what ZB-H1 needs).
"""

from __future__ import annotations

import difflib
import inspect
import os
from typing import Any, Mapping, Sequence

from pipeq import schedules
from pipeq.launch.job.keys import REQUIRED as _REQUIRED
from pipeq.launch.job.names import did_you_mean, importable, resolve

__all__ = ["parse_schedule", "check_schedule_keys", "policy_of"]


def policy_of(schedule: Any) -> schedules.SchedulePolicy:
    """The parsed schedule as the job is checked with: ``"auto"`` as ZB-H1, what it starts as."""
    return schedules.resolve("zb-h1" if isinstance(schedule, str) and schedule == "auto" else schedule)


def parse_schedule(value: "str | Mapping[str, Any]", sys_path: Sequence[str] = ()) -> Any:
    """A job file's ``schedule`` as the runner takes it: a registered name, or a schedule object
    with its options. ``sys_path``: where the job's own modules import from."""
    options = {"name": value} if isinstance(value, str) else dict(value)
    name = options.pop("name", None)
    if isinstance(name, str) and name.startswith("csv:") and set(options) <= {"placement"}:
        from pipeq.launch.csv_schedule import from_csv

        file = name[4:]  # the job file's directory is sys_path[1] (see load.py)
        return from_csv(file if os.path.isabs(file) or len(sys_path) < 2 else os.path.join(sys_path[1], file),
                        **options)
    if isinstance(name, str) and ":" in name:
        return _users(name, options, sys_path)
    if name == "auto" and not options:
        return name
    known = schedules.SCHEDULES
    if not isinstance(name, str) or name not in known:
        what = "a table without a name" if name is None else f"unknown name {name!r}"
        close = difflib.get_close_matches(name, list(known), n=1) if isinstance(name, str) else []
        raise ValueError(f"schedule: {what}; " + (f"did you mean {close[0]!r}? " if close else "")
                         + f"choose one of {', '.join(sorted(known))}, "
                         'e.g. schedule = "1f1b" or schedule = { name = "nwise", distance = 2 }, '
                         "or your own as 'pkg.module:Name'")
    entry = known[name]
    allowed = tuple(getattr(entry, "option_names", ()))
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise ValueError(f"schedule {name!r}: unknown option(s) {unknown}; "
                         + (did_you_mean(unknown, allowed, "allowed") if allowed else "it takes none"))
    if isinstance(entry, schedules.NeedsOptions) and entry.needs not in options:
        raise ValueError(f'schedule "{name}" needs its {entry.needs}: schedule = {entry.job_example}')
    return entry.with_options(**options) if options else name


def _users(spec: str, options: dict[str, Any], sys_path: Sequence[str]) -> schedules.SchedulePolicy:
    """Your own schedule, ``"pkg.module:Name"``: a class called with the options, or an object."""
    importable(sys_path)
    obj = resolve(spec, "schedule")
    if inspect.isclass(obj):
        if not issubclass(obj, schedules.SchedulePolicy):
            raise ValueError(f"schedule = {spec!r} is a class but not a pipeq.schedules.SchedulePolicy")
        try:
            obj = obj(**options)
        except TypeError as exc:
            raise ValueError(f"schedule = {spec!r}: {exc}") from None
    elif options:
        if not isinstance(obj, schedules.SchedulePolicy):
            raise ValueError(f"schedule = {spec!r} takes no options (a function); drop {sorted(options)}")
        obj = obj.with_options(**options)
    return schedules.resolve(obj)


def check_schedule_keys(path: str, raw: Mapping[str, Any]) -> None:
    """The keys the job's schedule needs or refuses: a loss (unless the schedule brings its own
    criterion), auxiliary heads only with a schedule that trains with them."""
    schedule = policy_of(raw["schedule"])
    missing = [k for k in _REQUIRED if k not in raw and not (k == "stages" and "model" in raw)]
    missing += ["loss"] if "loss" not in raw and schedule.needs_loss else []
    if missing:
        raise ValueError(f"job file {path}: missing required key(s) {missing}")
    for key in ("aux_heads", "aux_loss"):
        if key in raw and not schedule.takes_aux_heads:
            raise ValueError(f"job file {path}: {key} trains with the interlocking schedules "
                             f"({', '.join(schedules.taking_aux_heads())}), not with {schedule.name!r}")
