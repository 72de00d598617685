"""Faults injected on purpose, so that every recovery path has a deterministic test.

``PIPEQ_FAULT="stage:2,step:40,kind:kill"`` in the driver's environment (read once, when the
stage processes start, and handed to each as plain data) makes stage 2 fail as it starts
its process's 40th training step (the forward-only steps of an evaluation between do not count).
It fires in the first start only: processes started again (a restart, a rebuilt replica) get
none. Kinds:

    kill    the process kills itself with SIGKILL (a crash, an OOM kill)
    exit    it exits at once with code 3, no report (a lost node)
    raise   its batch raises a RuntimeError, reported as any stage error is
    hang    it stops making progress inside its forward (a stuck kernel): heartbeats go on,
            ``step_timeout`` names it

``replica:R`` picks one replica of the stage (default: every replica). Process mode only (a
simulated run has no stage process to fail). The same value can be
given to :func:`parse` in a test. Pure parsing here (no torch: ``pipeq launch`` checks the
value before it starts any process); :func:`inject` acts in the stage process.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from typing import Callable

__all__ = ["Fault", "KINDS", "ENV", "parse", "from_environ", "inject"]

ENV = "PIPEQ_FAULT"
KINDS = ("kill", "exit", "raise", "hang")
_FIELDS = ("stage", "step", "kind", "replica")


@dataclass(frozen=True)
class Fault:
    """Stage ``stage`` (of replica ``replica``, None: any) fails with ``kind`` as training step
    ``step`` starts."""

    stage: int
    step: int
    kind: str
    replica: int | None = None

    def hits(self, stage: int, step: int, replica: int = 0) -> bool:
        """Whether this fault fires on ``stage`` (of ``replica``) at training step ``step``."""
        return stage == self.stage and step == self.step and self.replica in (None, replica)

    def text(self) -> str:
        """The fault as ``PIPEQ_FAULT`` spells it."""
        rep = f",replica:{self.replica}" if self.replica is not None else ""
        return f"stage:{self.stage},step:{self.step},kind:{self.kind}{rep}"


def parse(text: str) -> Fault:
    """``"stage:2,step:40,kind:kill"`` as a :class:`Fault` (ValueError naming what is wrong)."""
    where = f"{ENV}={text!r}"
    fields: dict[str, str] = {}
    for part in text.split(","):
        key, sep, value = part.strip().partition(":")
        if not sep or key not in _FIELDS:
            raise ValueError(f"{where}: {part.strip()!r} is not one of {', '.join(f + ':...' for f in _FIELDS)} "
                             "(e.g. stage:2,step:40,kind:kill)")
        if key in fields:
            raise ValueError(f"{where}: {key} is given twice")
        fields[key] = value.strip()
    missing = [k for k in ("stage", "step", "kind") if k not in fields]
    if missing:
        raise ValueError(f"{where}: needs {', '.join(missing)} (e.g. stage:2,step:40,kind:kill)")
    if fields["kind"] not in KINDS:
        raise ValueError(f"{where}: kind is one of {', '.join(KINDS)}, got {fields['kind']!r}")
    numbers = {}
    for key in ("stage", "step", "replica"):
        if key in fields:
            if not fields[key].isdigit():
                raise ValueError(f"{where}: {key} must be a whole number >= 0, got {fields[key]!r}")
            numbers[key] = int(fields[key])
    if numbers["step"] < 1:
        raise ValueError(f"{where}: steps count from 1, got step:0")
    return Fault(numbers["stage"], numbers["step"], fields["kind"], numbers.get("replica"))


def from_environ(n_stages: int | None = None, environ: "os._Environ[str] | dict[str, str] | None" = None,
                 replicas: int | None = None) -> Fault | None:
    """The fault ``PIPEQ_FAULT`` asks for (None when unset), checked against ``n_stages`` and
    ``replicas`` (None: not known yet, its spelling only): a fault that names a stage or replica
    the run does not have would never fire."""
    text = (environ if environ is not None else os.environ).get(ENV, "").strip()
    if not text:
        return None
    fault = parse(text)
    if n_stages is not None and fault.stage >= n_stages:
        raise ValueError(f"{ENV}={text!r}: stage {fault.stage} does not exist (the run has {n_stages} stages)")
    if fault.replica is not None and replicas is not None and fault.replica >= replicas:
        has = "no replicas (data_parallel = 1)" if replicas == 1 else f"{replicas} replicas, 0 to {replicas - 1}"
        raise ValueError(f"{ENV}={text!r}: replica {fault.replica} does not exist (the run has {has})")
    return fault


def inject(fault: Fault | None, stage: int, step: int, replica: int = 0,
           note: Callable[[int, int], None] | None = None, named: int | None = None) -> None:
    """In a stage process, as training step ``step`` starts: fail as ``fault`` says if it hits
    (``note(code, microbatch)`` marks a hang as a forward in progress, for ``step_timeout``).
    ``named``: the step's number as the stage's other errors name it (its TRAIN's; default ``step``)."""
    if fault is None or not fault.hits(stage, step, replica):
        return
    if fault.kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif fault.kind == "exit":
        os._exit(3)
    elif fault.kind == "raise":
        raise RuntimeError(f"injected fault ({ENV}={fault.text()}): stage {stage} fails at step {step if named is None else named}")
    else:  # hang: inside a "forward", forever (the driver's step_timeout or the user ends it)
        if note is not None:
            from pipeq.trace.format import F as TRACE_F  # (torch: not for the launch command's early check)

            note(TRACE_F, 0)
        while True:
            time.sleep(3600)
