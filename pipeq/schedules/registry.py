"""Schedules by name: the registry plug-ins add to, and the one place a run's schedule is resolved.

:data:`SCHEDULES` maps every name pipeq knows to its schedule (the research schedules register
themselves from :mod:`pipeq.research`; your own plug-in calls :func:`register`). :func:`resolve`
turns whatever a user gave (a name, a schedule object, a function) into a
:class:`~pipeq.schedules.SchedulePolicy`, once, where the run is configured. Pure: no I/O.
"""

from __future__ import annotations

from typing import Any, Callable

from pipeq.schedules.basic import fill_drain, one_f_one_b
from pipeq.schedules.dualpipe import DualPipeV
from pipeq.schedules.interleaved import Interleaved1F1B, LoopedBFS
from pipeq.schedules.protocol import FunctionSchedule, SchedulePolicy
from pipeq.schedules.v_memory import VHalf, VMin
from pipeq.schedules.zero_bubble import ZBV, zb_h1, zb_h2

__all__ = ["SCHEDULES", "NeedsOptions", "register", "resolve", "get_schedule", "from_label", "schedule_name",
           "options_of", "loss_stages", "output_stage", "is_research", "taking_aux_heads", "EXPORTS"]


class NeedsOptions:
    """A schedule name that is no schedule until it is given its options: ``"nwise"`` needs its
    distance. Listed in :data:`SCHEDULES` so that every name pipeq knows is there; using the bare
    name is refused, saying how to give the option."""

    def __init__(self, name: str, needs: str, example: str, make: Callable[..., SchedulePolicy], *,
                 takes_aux_heads: bool = False, job_example: str | None = None) -> None:
        self.name, self.needs, self.example, self.make = name, needs, example, make
        #: how a job file gives the option (``{ name = "nwise", distance = 2 }``)
        self.job_example = job_example or f'{{ name = "{name}", {needs} = ... }}'
        self.option_names = (needs,)
        self.takes_aux_heads = takes_aux_heads

    def refusal(self) -> ValueError:
        return ValueError(f"schedule {self.name!r} needs its {self.needs}: schedule={self.example}")

    def with_options(self, **options: Any) -> SchedulePolicy:
        if self.needs not in options:
            raise self.refusal()
        return self.make(**options)

    def __call__(self, n_stages: int, n_microbatches: int) -> Any:
        raise self.refusal()

    def __repr__(self) -> str:
        return self.example


SCHEDULES: dict[str, "SchedulePolicy | NeedsOptions"] = {
    "fill-drain": FunctionSchedule(fill_drain, "fill-drain"),
    "gpipe": FunctionSchedule(fill_drain, "gpipe"),
    "1f1b": FunctionSchedule(one_f_one_b, "1f1b"),
    "zb-h1": FunctionSchedule(zb_h1, "zb-h1"),  # split backward, 1F1B's memory (arXiv 2401.10241)
    "zb1p": FunctionSchedule(zb_h1, "zb1p"),  # torch's name for it
    "zb-h2": FunctionSchedule(zb_h2, "zb-h2"),  # split backward, twice the memory, W's fill the tail
    # v stages per process (placement "loop" or "v"; plan(N, m) gives one list per process)
    "interleaved-1f1b": Interleaved1F1B(),  # Megatron's virtual pipeline; { stages_per_process = v }
    "interleaved": Interleaved1F1B(),
    "looped-bfs": LoopedBFS(),  # breadth-first; { stages_per_process = v }
    "zbv": ZBV(),  # zero bubble in a V (arXiv 2401.10241)
    "dualpipev": DualPipeV(),  # DeepSeek's DualPipe in a V (arXiv 2412.19437)
    "v-half": VHalf(),  # a V at half of 1F1B's activation memory (arXiv 2405.15362)
    "v-min": VMin(),  # a V at a third of 1F1B's activation memory (arXiv 2405.15362)
}
"""Every schedule name pipeq knows, and the schedule it names (``pipeq schedule NAME`` prints its plan)."""
#: Names plug-ins add to :mod:`pipeq.schedules` (their schedule classes), by name.
EXPORTS: dict[str, Any] = {}
#: classes whose from_label reads trace labels back (with their options)
_READERS: list[type[SchedulePolicy]] = [Interleaved1F1B, LoopedBFS]


def register(name: str, schedule: "SchedulePolicy | NeedsOptions", *, exports: dict[str, Any] | None = None) -> None:
    """Make ``schedule`` known as ``name`` (in the runner, job files and ``pipeq schedule``);
    ``exports`` are names to offer as ``pipeq.schedules.<name>`` (its class, helpers)."""
    if not isinstance(schedule, (SchedulePolicy, NeedsOptions)):
        raise ValueError(f"register({name!r}, ...) takes a SchedulePolicy, got {type(schedule).__name__}")
    SCHEDULES[name] = schedule
    EXPORTS.update(exports or {})
    cls = type(schedule)
    if isinstance(schedule, SchedulePolicy) and cls not in _READERS:
        _READERS.append(cls)


def resolve(schedule: Any) -> SchedulePolicy:
    """A registered name, a schedule object or a schedule function, as a schedule object."""
    if isinstance(schedule, SchedulePolicy):
        return schedule
    if isinstance(schedule, str):
        entry = SCHEDULES.get(schedule)
        if isinstance(entry, NeedsOptions):
            raise entry.refusal()
        if entry is None:
            raise ValueError(
                f"unknown schedule {schedule!r}; choose one of {', '.join(sorted(SCHEDULES))}, or pass "
                "a function (n_stages, n_microbatches) -> per-stage action lists")
        return entry
    if callable(schedule):
        return FunctionSchedule(schedule)
    raise ValueError(f"schedule must be a name ({', '.join(sorted(SCHEDULES))}), a schedule object or a "
                     f"function (n_stages, n_microbatches) -> per-stage action lists, got {schedule!r}")


def get_schedule(name: Any) -> Callable:
    """The schedule function a name registers (a schedule object for a plug-in's names), or
    ``name`` itself if it is a function or schedule object."""
    if callable(name) and not isinstance(name, NeedsOptions):
        return name
    entry = resolve(name)
    return entry.fn if isinstance(entry, FunctionSchedule) else entry


def from_label(label: str) -> SchedulePolicy | None:
    """The schedule a trace's or checkpoint's label names (None: your own function, or unknown)."""
    for cls in _READERS:
        found = cls.from_label(label)
        if found is not None:
            return found
    entry = SCHEDULES.get(label)
    return entry if isinstance(entry, SchedulePolicy) else None


def schedule_name(schedule: Any) -> str:
    """A schedule's name in messages: the name given, or the schedule's (a function's own)."""
    if isinstance(schedule, str):
        return schedule
    return getattr(schedule, "name", None) or getattr(schedule, "__name__", repr(schedule))


def options_of(schedule: Any) -> dict:
    """The schedule's options as plain data (a name means its defaults; {} for functions)."""
    return dict(resolve(schedule).options)


def loss_stages(schedule: Any, n_stages: int) -> list[int]:
    """The stages that get the batch's target (see :meth:`SchedulePolicy.loss_stages`)."""
    return resolve(schedule).loss_stages(n_stages)


def output_stage(schedule: Any, n_stages: int) -> int:
    """The stage that returns ``predict``'s output."""
    return resolve(schedule).output_stage(n_stages)


def taking_aux_heads() -> list[str]:
    """The names of the schedules that train with auxiliary heads."""
    return [name for name, s in SCHEDULES.items() if getattr(s, "takes_aux_heads", False)]


def is_research(schedule: Any) -> bool:
    """Whether the schedule's stages compute their own way (not plain backprop's)."""
    return not resolve(schedule).plain_backprop
