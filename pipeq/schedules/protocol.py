"""The schedule policy protocol: everything the runtime asks of a schedule, built-in or your own.

A schedule is one object. Its :meth:`~SchedulePolicy.plan` gives every stage's actions for one
training step (compute actions ``F j``, ``B j``, ``STEP``; or lowered lists with their sends and
receives, for a schedule that routes its own messages), and its attributes and hooks tell the
runner, the stage processes and ``pipeq launch`` the rest: which stages take the target, which
stage returns ``predict``'s output, the executor a stage needs, what the schedule refuses, how it
streams across batches, and its label in traces and checkpoints. The core never asks *which*
schedule it has; it asks the schedule.

Your own schedule is a subclass (module level, so that stage processes can import it)::

    class Backwards(pipeq.schedules.SchedulePolicy):
        name = "backwards-first"

        def plan(self, n_stages, n_microbatches):
            ...  # per-stage lists of F(j), B(j), STEP

        def executor(self, index, n_stages, spec, device):
            return MyExecutor(index, n_stages, spec, device)   # a pipeq.StageExecutor

A plain function ``(n_stages, n_microbatches) -> plan`` is a schedule too: :class:`FunctionSchedule`
wraps it. Pure: no I/O, no torch (executors are imported by the hooks that return them).
"""

from __future__ import annotations

from typing import Any, Callable, ClassVar, Sequence

from pipeq.schedules.actions import Schedule

__all__ = ["SchedulePolicy", "FunctionSchedule"]


class SchedulePolicy:
    """A pipeline schedule: its plan, its options, and what the runtime must know to run it.

    Subclasses set the class attributes that differ from plain backprop's and override
    :meth:`plan`; every other hook has plain backprop's answer (the last stage computes the loss
    and returns the output, every stage runs :class:`pipeq.StageExecutor`).
    """

    #: The schedule's name in messages, ``pipeq schedule`` and (see :attr:`label`) traces.
    name: str = ""
    #: One STEP after every backward (checked by the dry run), so replicas would have to
    #: all-reduce every microbatch: data parallelism is refused.
    per_microbatch_steps: ClassVar[bool] = False
    #: The stages run plain backprop's forward and backward (:class:`pipeq.StageExecutor`):
    #: precision, clipping, check_finite, recompute, tensor parallelism and inputs that are not
    #: one tensor apply. False for schedules whose stages compute their own way.
    plain_backprop: ClassVar[bool] = True
    #: Under ``runner.stream`` the stages run one long plan, with no drain between batches
    #: (:meth:`cursor` hands it out batch by batch); ``runner.step`` still drains.
    streams_across_batches: ClassVar[bool] = False
    #: Stages 0..N-2 train with auxiliary heads (``aux_heads``, ``aux_loss``).
    takes_aux_heads: ClassVar[bool] = False
    #: Each stage's forward can be handed keyword arguments from the driver (``stage_inputs``,
    #: see :mod:`pipeq.control.stage_inputs`); False: the runner refuses them.
    takes_stage_inputs: ClassVar[bool] = True
    #: A job file must name a loss (False: the schedule brings its own criterion).
    needs_loss: ClassVar[bool] = True
    #: The options a job file's schedule table may set (``{ name = ..., option = ... }``).
    option_names: ClassVar[tuple[str, ...]] = ()
    #: Model stages each process holds (virtual stages, :mod:`pipeq.schedules.placement`): with
    #: v > 1, :meth:`plan` is given the number of *processes* N and returns one list per process,
    #: each action's ``chunk`` naming which of the process's v stages runs it (S = v·N stages).
    stages_per_process: int = 1
    #: Which stages a process holds when it holds several: ``"loop"`` (p, p+N, ...) or ``"v"``
    #: (p and 2N-1-p).
    placement: str = "loop"

    # -- the plan ---------------------------------------------------------------------------
    def plan(self, n_stages: int, n_microbatches: int) -> Schedule:
        """Every stage's actions for one training step (with :attr:`stages_per_process` v > 1:
        ``n_stages`` is the number of processes, and each list a process's, see above)."""
        raise NotImplementedError(f"{type(self).__name__} must define plan(n_stages, n_microbatches)")

    def inference_plan(self, n_stages: int, n_microbatches: int) -> Schedule | None:
        """``predict``'s lowered plan, for a schedule whose inference is not forwards only
        (checked by its dry run alone); None: every stage runs the forwards."""
        return None

    def __call__(self, n_stages: int, n_microbatches: int) -> Schedule:
        return self.plan(n_stages, n_microbatches)

    # -- identity ---------------------------------------------------------------------------
    @property
    def options(self) -> dict[str, Any]:
        """The options given besides the name, as plain data (two runs compare them)."""
        return {}

    def with_options(self, **options: Any) -> "SchedulePolicy":
        """This schedule with a job file's options (``option_names``) applied."""
        if options:
            raise ValueError(f"schedule {self.name!r} takes no options, got {sorted(options)}")
        return self

    @property
    def label(self) -> str:
        """The name traces and checkpoints record; :meth:`from_label` reads it back."""
        return self.name or f"{type(self).__module__}:{type(self).__qualname__}"

    @classmethod
    def from_label(cls, label: str) -> "SchedulePolicy | None":
        """The schedule of this class a label (with its options) names, or None."""
        return None

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in self.options.items())})"

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and other.options == self.options  # type: ignore[attr-defined]

    def __hash__(self) -> int:
        return hash((type(self).__name__, tuple(self.options.items())))

    # -- roles of the stages --------------------------------------------------------------------
    def loss_stages(self, n_stages: int) -> list[int]:
        """The stages that get the batch's target."""
        return [n_stages - 1]

    def output_stage(self, n_stages: int) -> int:
        """The stage that returns ``predict``'s output."""
        return n_stages - 1

    def computes_loss(self, stage: int, n_stages: int) -> bool:
        """Whether stage ``stage`` is given the loss function."""
        return stage == n_stages - 1

    def executor(self, index: int, n_stages: int, spec: Any, device: Any) -> Any:
        """Stage ``index``'s executor (a :class:`pipeq.StageExecutor`), or None for plain
        backprop's, which the runtime builds with the run's numerics."""
        return None

    def cursor(self, stage: int, n_stages: int) -> Any:
        """With :attr:`streams_across_batches`: where stage ``stage`` is in its stream, an object
        with ``add(count) -> first``, ``take(drain) -> actions`` and ``next_b`` (see
        :class:`pipeq.schedules.AsyncCursor`); None for a schedule that plans batch by batch."""
        return None

    # -- losses -----------------------------------------------------------------------------------
    def default_loss(self) -> Callable | None:
        """The loss when none is given (None: one is required)."""
        return None

    def eval_loss(self, loss_fn: Callable) -> Callable:
        """The loss ``runner.evaluate`` reports by default."""
        return loss_fn

    # -- what the schedule refuses ------------------------------------------------------------------
    def check_heads(self, n_stages: int, heads: Sequence[Any] | None, aux_loss: Any, hint: str) -> None:
        """With :attr:`takes_aux_heads`: the heads given (``hint`` says where they come from)."""

    def check_stages(self, stages: Sequence[Any]) -> None:
        """The stage modules given to the runner (ValueError naming the stage at fault)."""

    def check_recipe(self, builder: Any, n_stages: int) -> None:
        """A recipe's stages, before any process starts (e.g. by building stage 0 here)."""

    def check_target(self, target: Any) -> None:
        """A training batch's target."""

    def check_job(self, path: str, raw: dict[str, Any]) -> None:
        """A job file's keys (``raw``), beyond the loss and heads (see the attributes above)."""


class FunctionSchedule(SchedulePolicy):
    """A schedule function ``(n_stages, n_microbatches) -> plan`` as a schedule: plain backprop.

    ``name`` is the name it was registered or asked for by (``"1f1b"``), else the function's;
    traces label your own functions ``module:qualname``, so that ``pipeq report`` knows them
    for what they are.
    """

    def __init__(self, fn: Callable[[int, int], Schedule], name: str | None = None) -> None:
        if not callable(fn):
            raise ValueError(f"a schedule function must be callable as fn(n_stages, n_microbatches), got {fn!r}")
        self.fn = fn
        self.registered = name is not None
        self.name = name if name is not None else getattr(fn, "__name__", repr(fn))

    def plan(self, n_stages: int, n_microbatches: int) -> Schedule:
        return self.fn(n_stages, n_microbatches)

    @property
    def per_microbatch_steps(self) -> bool:  # type: ignore[override]
        return bool(getattr(self.fn, "per_microbatch_steps", False))

    @property
    def label(self) -> str:
        if self.registered:
            return self.name
        fn = self.fn
        return f"{fn.__module__}:{getattr(fn, '__qualname__', type(fn).__name__)}"

    def __repr__(self) -> str:
        return self.name if self.registered else f"FunctionSchedule({self.name})"

    def __eq__(self, other: object) -> bool:
        if isinstance(other, str):  # a registered schedule is its name: schedule == "1f1b"
            return self.registered and other == self.name
        return isinstance(other, FunctionSchedule) and (other.fn, other.name) == (self.fn, self.name)

    def __hash__(self) -> int:
        return hash(self.name) if self.registered else hash((self.fn, self.name))
