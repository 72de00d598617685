"""Schedules as data: per-stage lists of actions, validated and dry-run before any process starts.

A schedule is a pure function ``(n_stages, n_microbatches) -> list of per-stage action lists`` that
names the *compute* actions of one training step: ``F j`` (forward of microbatch j), ``B j``
(backward of microbatch j) and ``STEP`` (optimizer step). :func:`lower` derives the communication
from them (an ``F`` on stage k > 0 first receives its activation from k-1, an ``F`` on stage k < N-1
then sends it to k+1; ``B`` likewise on the backward channel), and :func:`dry_run` executes the
lowered lists symbolically, refusing any schedule that would deadlock. Nothing here does I/O.

Fill-drain (GPipe), 4 stages x 4 microbatches, unit-time forward and backward::

    stage 0 | F0 F1 F2 F3 .  .  .  .  .  .  B0 B1 B2 B3 ST
    stage 1 | .  F0 F1 F2 F3 .  .  .  .  B0 B1 B2 B3 ST
    stage 2 | .  .  F0 F1 F2 F3 .  .  B0 B1 B2 B3 ST
    stage 3 | .  .  .  F0 F1 F2 F3 B0 B1 B2 B3 ST

1F1B (PipeDream-Flush): stage k warms up with min(m, N-k) forwards, then alternates B and F::

    stage 0 | F0 F1 F2 F3 .  .  .  B0 .  B1 .  B2 .  B3 ST
    stage 1 | .  F0 F1 F2 .  .  B0 F3 B1 .  B2 .  B3 ST
    stage 2 | .  .  F0 F1 .  B0 F2 B1 F3 B2 .  B3 ST
    stage 3 | .  .  .  F0 B0 F1 B1 F2 B2 F3 B3 ST

(``pipeq.schedules.format_table(name, N, m)`` prints these from the dry run.) Under
``runner.stream`` each stage runs its batches' lists back to back: :func:`stream_plan` is that
plan, and :func:`stream_bound` the time per batch it allows, beside that of a ``step`` loop.
"""

from __future__ import annotations

from pipeq.schedules.actions import B, COMPUTE_OPS, F, STEP, Action, Op, Schedule, ScheduleFn, lower, lower_stage
from pipeq.schedules.dryrun import check_consistency, dry_run
from pipeq.errors import ScheduleError

__all__ = [
    "Op", "Action", "F", "B", "STEP", "Schedule", "ScheduleFn", "COMPUTE_OPS", "lower", "lower_stage",
    "warmup_order", "fill_drain", "one_f_one_b", "forward_only", "Interlock", "AsyncCursor", "AsyncOneFOneB",
    "AssociatedLearning", "NeedsOptions", "SCHEDULES", "INTERLOCK", "resolve", "get_schedule", "loss_stages", "output_stage",
    "schedule_name", "options_of", "check_consistency", "dry_run", "build", "format_table",
]


def _check_counts(n_stages: int, n_microbatches: int) -> None:
    if type(n_stages) is not int or n_stages < 1:
        raise ScheduleError(f"need at least one stage, got n_stages={n_stages!r}")
    if type(n_microbatches) is not int or n_microbatches < 1:
        raise ScheduleError(f"need at least one microbatch, got n_microbatches={n_microbatches!r}")


def fill_drain(n_stages: int, n_microbatches: int) -> Schedule:
    """GPipe: every forward, then every backward, then the optimizer step."""
    _check_counts(n_stages, n_microbatches)
    m = n_microbatches
    return [[F(j) for j in range(m)] + [B(j) for j in range(m)] + [STEP] for _ in range(n_stages)]


def warmup_order(n_microbatches: int, warmup: int) -> list[Action]:
    """``warmup`` forwards, then one backward and one forward in turn, then the last backwards."""
    m = n_microbatches
    warm = min(m, warmup)
    order = [F(j) for j in range(warm)]
    for i in range(m - warm):
        order += [B(i), F(warm + i)]
    return order + [B(j) for j in range(m - warm, m)]


def one_f_one_b(n_stages: int, n_microbatches: int) -> Schedule:
    """PipeDream-Flush: min(m, N-k) warm-up forwards on stage k, then one backward, one forward."""
    _check_counts(n_stages, n_microbatches)
    return [warmup_order(n_microbatches, n_stages - k) + [STEP] for k in range(n_stages)]


def forward_only(n_stages: int, n_microbatches: int) -> Schedule:
    """Inference (``predict``): forwards only, no backward, no step."""
    _check_counts(n_stages, n_microbatches)
    return [[F(j) for j in range(n_microbatches)] for _ in range(n_stages)]


# -- interlocking backpropagation -------------------------------------------------------------------
#
# Stages 0..N-2 own an auxiliary head; L_k is head k's loss, L_{N-1} the real loss. With distance d,
# main_k is trained by L_{t(k)}, t(k) = min(k + d, N - 1), and stage k sends down the gradients (with
# respect to its input) of the losses the stages below it are trained by. d = 0 is "local" (no
# backward messages at all), d = 1 "pairwise", d = N - 1 "global" (plain backprop).
#
# Pairwise, 4 stages x 4 microbatches: stage k sends its own head's gradient down right after its
# forward (sendB after F), so stage k-1's backward waits for stage k's forward only, not for the
# stack above; every stage steps as soon as its own backwards are done:
#
#     stage 0 | F0 F1 .  B0 F2 B1 F3 B2 B3 ST
#     stage 1 | .  F0 F1 B0 F2 B1 F3 B2 B3 ST
#     stage 2 | .  .  F0 F1 B0 F2 B1 F3 B2 B3 ST
#     stage 3 | .  .  .  F0 B0 F1 B1 F2 B2 F3 B3 ST


def trained_by(k: int, n_stages: int, distance: int) -> int:
    """The loss that trains stage k's main module: L_min(k+d, N-1)."""
    return min(k + distance, n_stages - 1)


def sends_down(k: int, n_stages: int, distance: int) -> list[int]:
    """The losses whose gradient (w.r.t. its input) stage k sends to stage k-1, in order."""
    return sorted({trained_by(i, n_stages, distance) for i in range(max(0, k - distance), k)})


def receives(k: int, n_stages: int, distance: int) -> list[int]:
    """The losses whose gradient (w.r.t. its output) stage k receives from stage k+1, in order."""
    return sends_down(k + 1, n_stages, distance) if k + 1 < n_stages else []


def sends_early(k: int, n_stages: int, distance: int) -> bool:
    """Stage k's downward message is its own head's gradient only: sent right after its forward."""
    return 0 < k < n_stages - 1 and sends_down(k, n_stages, distance) == [k]


class Interlock:
    """An interlocking-backprop schedule: ``global``, ``local``, ``pairwise`` or ``nwise`` (d).

    Called like any schedule function, ``(n_stages, n_microbatches)``, it returns *lowered* action
    lists (sends and receives included), because where a gradient goes depends on the scheme.
    Stage k warms up with as many forwards as the stages above it its backward waits on, plus
    one (1F1B's N-k when d = N-1), then alternates one backward and one forward; STEP ends each
    stage's list.

        pipeq.schedules.Interlock("pairwise")
        pipeq.schedules.Interlock("nwise", distance=2)   # "global", "local", "pairwise" as strings too
    """

    KINDS = ("global", "local", "pairwise", "nwise")

    def __init__(self, kind: str, distance: int | None = None) -> None:
        if kind not in self.KINDS:
            raise ValueError(f"interlocking scheme {kind!r} is not one of {self.KINDS}")
        if kind == "nwise":
            if type(distance) is not int or distance < 1:
                raise ValueError(
                    f"Interlock('nwise') needs distance=d, an integer >= 1, got {distance!r}: "
                    "e.g. pipeq.schedules.Interlock('nwise', distance=2)"
                )
        elif distance is not None:
            raise ValueError(f"distance applies to Interlock('nwise') only, not {kind!r}")
        self.kind = kind
        self._distance = distance

    @property
    def name(self) -> str:
        return f"nwise(d={self._distance})" if self.kind == "nwise" else self.kind

    def distance(self, n_stages: int) -> int:
        if self.kind == "global":
            return n_stages - 1
        if self.kind == "local":
            return 0
        if self.kind == "pairwise":
            return 1
        return min(int(self._distance or 1), n_stages - 1)

    @property
    def options(self) -> dict[str, int | None]:
        """The options given besides the scheme (plain data: two runs compare them)."""
        return {"distance": self._distance} if self.kind == "nwise" else {}

    def __repr__(self) -> str:
        return f"Interlock({self.name!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Interlock) and (self.kind, self._distance) == (other.kind, other._distance)

    def __hash__(self) -> int:
        return hash((self.kind, self._distance))

    def __call__(self, n_stages: int, n_microbatches: int) -> Schedule:
        _check_counts(n_stages, n_microbatches)
        n, m, d = n_stages, n_microbatches, self.distance(n_stages)
        # how many stages above stage k its backward waits on (its gradients come in one message
        # per microbatch, sent after the backward of the stage above unless that one sends early)
        depth = [0] * n
        for k in range(n - 2, -1, -1):
            if receives(k, n, d):
                depth[k] = 1 if sends_early(k + 1, n, d) else 1 + depth[k + 1]
        out = []
        for k in range(n):
            early = sends_early(k, n, d)
            order = warmup_order(m, depth[k] + 1) + [STEP]
            out.append(lower_stage(order, recv_act=k > 0, send_act=k < n - 1,
                                   recv_grad=bool(receives(k, n, d)), send_grad=bool(sends_down(k, n, d)),
                                   grad_after_forward=early))
        return out


class _OptionsIdentity:
    """A schedule object that is its class and its options: repr, equality and hash follow them."""

    options: dict

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in self.options.items())})"

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and other.options == self.options  # type: ignore[attr-defined]

    def __hash__(self) -> int:
        return hash((type(self).__name__, tuple(self.options.items())))


class AsyncCursor:
    """Where one stage is in an asynchronous 1F1B stream of microbatches (numbered 0, 1, ...
    across batches): ``warmup`` forwards, then one backward (and STEP) and one forward in turn.

    :meth:`take` hands out the next actions, up to the first forward of a microbatch that has not
    been :meth:`add`-ed yet (its batch has not arrived); with ``drain`` it also runs the
    backwards left at the end. A stream is thus one long asynchronous plan over all its
    microbatches, cut into pieces as batches arrive; a step that drains is one batch's plan.
    """

    def __init__(self, warmup: int) -> None:
        self.warmup = warmup
        self.commanded = 0  # microbatches whose batch has arrived
        self.next_f = 0
        self.next_b = 0

    def add(self, count: int) -> int:
        """``count`` more microbatches arrived; returns the number of the first."""
        self.commanded += count
        return self.commanded - count

    def take(self, drain: bool = False) -> list[Action]:
        acts: list[Action] = []
        while True:
            ahead = self.next_f - self.next_b  # forwards whose backward is still to come
            if self.next_f < self.commanded and ahead < self.warmup:
                acts.append(F(self.next_f))
                self.next_f += 1
            elif ahead > 0 and (ahead >= self.warmup or drain and self.next_f == self.commanded):
                acts += [B(self.next_b), STEP]
                self.next_b += 1
            else:
                return acts


class AsyncOneFOneB(_OptionsIdentity):
    """Asynchronous 1F1B (the tutorial's pipeline, PipeDream): a step after every backward, and
    under ``runner.stream`` no drain between batches.

    Stage 0 runs ``warmup`` (W) forwards before its first backward, stage k < N-1 runs W - k, the
    last stage alternates from its first microbatch (W = N, the default, gives N - k on every
    stage); then each stage alternates one backward (followed by its optimizer step) and one
    forward. ``runner.step`` drains at the end of its batch; ``runner.stream`` keeps going into
    the next batch (:class:`AsyncCursor`). The backward of microbatch j may run after updates
    made since its forward; with ``weight_stashing=True`` (default, PipeDream) it uses the
    weights its forward used, without it the newest ones (see :mod:`pipeq.asyncpipe`)::

        stage 0 | F0 F1 F2 F3 .  .  .  B0 ST F4 B1 ST F5 ...
        stage 3 | .  .  .  F0 B0 ST F1 B1 ST F2 B2 ST ...
    """

    per_microbatch_steps = True  # check_consistency: one STEP after each backward

    def __init__(self, warmup: int | None = None, weight_stashing: bool = True) -> None:
        if warmup is not None and (type(warmup) is not int or warmup < 1):
            raise ValueError(f"AsyncOneFOneB(warmup=...) must be a positive integer or None, got {warmup!r}")
        if type(weight_stashing) is not bool:
            raise ValueError(f"AsyncOneFOneB(weight_stashing=...) must be True or False, got {weight_stashing!r}")
        self.warmup = warmup
        self.weight_stashing = weight_stashing

    @property
    def name(self) -> str:
        """"async", or "async(warmup=W)" (in traces, and ``pipeq report`` rebuilds the plan from it)."""
        return "async" if self.warmup is None else f"async(warmup={self.warmup})"

    def warmup_of(self, stage: int, n_stages: int) -> int:
        """How many forwards stage ``stage`` runs before its first backward."""
        w = n_stages if self.warmup is None else self.warmup
        if w < n_stages - 1:
            raise ScheduleError(f"AsyncOneFOneB(warmup={w}) with {n_stages} stages would deadlock: stage "
                                f"{n_stages - 2} needs at least one forward ahead; use warmup >= {n_stages - 1}")
        return 1 if stage == n_stages - 1 else w - stage

    def __call__(self, n_stages: int, n_microbatches: int) -> Schedule:
        _check_counts(n_stages, n_microbatches)
        out = []
        for k in range(n_stages):
            cursor = AsyncCursor(self.warmup_of(k, n_stages))
            cursor.add(n_microbatches)
            out.append(cursor.take(drain=True))
        return out

    @property
    def options(self) -> dict[str, int | bool | None]:
        return {"warmup": self.warmup, "weight_stashing": self.weight_stashing}



class AssociatedLearning(_OptionsIdentity):
    """Associated Learning's pipeline (see :mod:`pipeq.al`): messages only flow forward.

    Training, per stage and microbatch: receive (s, t), F (both paths and the two local losses),
    send (s, t) on, B (the local backward), STEP. Inference (:meth:`inference`): s flows forward
    to layer l (the last by default), whose b and h start the decode; each stage below applies
    its h to what comes back (on the backward channel), and stage 0's is the output::

        training   stage k | F0 B0 ST F1 B1 ST F2 B2 ST ...   (stage k+1 one F behind)
        inference  stage k | F0 F1 ... D0 D1 ...              (D = decode, toward stage 0)
    """

    name = "al"
    per_microbatch_steps = True
    FIRST_LOSSES = ("ce", "mse")

    def __init__(self, *, first_loss: str = "ce", inference_layer: int | None = None) -> None:
        """``first_loss``: layer 1's label-path loss, cross-entropy on the one-hot labels ("ce")
        or mean squared error ("mse"); ``inference_layer``: the stage (0-based) whose b and h start the
        decode in ``predict`` (default: the last; a lower one is the shortcut)."""
        if first_loss not in self.FIRST_LOSSES:
            raise ValueError(f"AssociatedLearning(first_loss=...) must be 'ce' or 'mse', got {first_loss!r}")
        if inference_layer is not None and (type(inference_layer) is not int or inference_layer < 0):
            raise ValueError(
                f"AssociatedLearning(inference_layer=...) must be a stage index >= 0, got {inference_layer!r}")
        self.first_loss = first_loss
        self.inference_layer = inference_layer

    def __call__(self, n_stages: int, n_microbatches: int) -> Schedule:
        _check_counts(n_stages, n_microbatches)
        order = [a for j in range(n_microbatches) for a in (F(j), B(j), STEP)]
        return [lower_stage(order, recv_act=k > 0, send_act=k < n_stages - 1, recv_grad=False, send_grad=False)
                for k in range(n_stages)]

    def last(self, n_stages: int) -> int:
        layer = n_stages - 1 if self.inference_layer is None else self.inference_layer
        if layer >= n_stages:
            raise ScheduleError(
                f"AssociatedLearning(inference_layer={layer}) but there are only {n_stages} stages")
        return layer

    def inference(self, n_stages: int, n_microbatches: int) -> Schedule:
        """Forwards up to the inference layer, then the decode down to stage 0 (as backwards)."""
        _check_counts(n_stages, n_microbatches)
        top = self.last(n_stages)
        m = n_microbatches
        order = [F(j) for j in range(m)] + [B(j) for j in range(m)]
        return [lower_stage(order, recv_act=k > 0, send_act=k < top, recv_grad=k < top, send_grad=k > 0)
                if k <= top else [] for k in range(n_stages)]

    @property
    def options(self) -> dict[str, str | int | None]:
        return {"first_loss": self.first_loss, "inference_layer": self.inference_layer}



class NeedsOptions:
    """A schedule name that is no schedule until it is given its options: ``"nwise"`` needs its
    distance. Listed in :data:`SCHEDULES` so that every name pipeq knows is there; using the bare
    name is refused, saying how to give the option."""

    def __init__(self, name: str, needs: str, example: str) -> None:
        self.name, self.needs, self.example = name, needs, example

    def refusal(self) -> ValueError:
        return ValueError(f"schedule {self.name!r} needs its {self.needs}: schedule={self.example}")

    def __call__(self, n_stages: int, n_microbatches: int) -> Schedule:
        raise self.refusal()

    def __repr__(self) -> str:
        return self.example


#: Every schedule name pipeq knows, and the schedule it names (``"nwise"`` needs its distance:
#: ``Interlock("nwise", distance=d)``).
SCHEDULES: dict[str, ScheduleFn] = {
    "al": AssociatedLearning(),
    "async": AsyncOneFOneB(),
    "fill-drain": fill_drain,
    "gpipe": fill_drain,
    "1f1b": one_f_one_b,
    "global": Interlock("global"),
    "local": Interlock("local"),
    "pairwise": Interlock("pairwise"),
    "nwise": NeedsOptions("nwise", "distance", "pipeq.schedules.Interlock('nwise', distance=d)"),
}
INTERLOCK = Interlock.KINDS


def resolve(schedule: "str | ScheduleFn") -> "str | ScheduleFn":
    """A schedule function as given; a registered name as the object it names when that is one
    of pipeq's schedule classes (the runner and the stages ask it what it needs)."""
    if isinstance(schedule, str) and isinstance(SCHEDULES.get(schedule), NeedsOptions):
        raise SCHEDULES[schedule].refusal()  # type: ignore[attr-defined]
    if isinstance(schedule, str) and isinstance(SCHEDULES.get(schedule), (Interlock, AsyncOneFOneB,
                                                                       AssociatedLearning)):
        return SCHEDULES[schedule]
    return schedule


def get_schedule(name: str | ScheduleFn) -> ScheduleFn:
    """The schedule function registered as ``name``, or ``name`` itself if it is a function."""
    if callable(name):
        return name
    resolve(name)  # a name that needs its options is refused, saying how to give them
    try:
        return SCHEDULES[name]
    except (KeyError, TypeError):
        raise ValueError(
            f"unknown schedule {name!r}; choose one of {', '.join(sorted(SCHEDULES))}, or pass "
            "a function (n_stages, n_microbatches) -> per-stage action lists"
        ) from None


def loss_stages(schedule: "str | ScheduleFn", n_stages: int) -> list[int]:
    """The stages that compute a loss, and so get the batch's target: the last; every stage when
    interlocking (auxiliary heads); stage 0 with Associated Learning (the labels enter there)."""
    if isinstance(schedule, Interlock):
        return list(range(n_stages))
    return [0] if isinstance(schedule, AssociatedLearning) else [n_stages - 1]


def output_stage(schedule: "str | ScheduleFn", n_stages: int) -> int:
    """The stage that returns ``predict``'s output: the last; stage 0 when AL decodes back down."""
    return 0 if isinstance(schedule, AssociatedLearning) else n_stages - 1


def is_research(schedule: "str | ScheduleFn") -> bool:
    """Interlocking, asynchronous 1F1B or Associated Learning: schedules whose stages compute
    their own way (pipeq's executors for them), not plain backprop's forward and backward."""
    return isinstance(resolve(schedule), (Interlock, AsyncOneFOneB, AssociatedLearning))


def schedule_name(schedule: str | ScheduleFn) -> str:
    if isinstance(schedule, str):
        return schedule
    return getattr(schedule, "name", None) or getattr(schedule, "__name__", repr(schedule))


def options_of(schedule: "str | ScheduleFn") -> dict:
    """The options of one of pipeq's schedule objects (a name means its defaults), as plain
    data; {} for schedule functions."""
    schedule = resolve(schedule)
    if isinstance(schedule, (Interlock, AsyncOneFOneB, AssociatedLearning)):
        return dict(schedule.options)
    return {}


def build(
    schedule: str | ScheduleFn, n_stages: int, n_microbatches: int, *, training: bool = True
) -> Schedule:
    """The validated, lowered action lists of one step (dry run included).

    ``schedule`` is a registered name or a schedule function; a function's output is checked
    like any other (consistency, then a deadlock-free dry run) and refused with a
    :class:`ScheduleError` naming the stage and action at fault.
    """
    fn = get_schedule(schedule)
    decode = not training and hasattr(fn, "inference")  # Associated Learning decodes backward
    if not training:
        fn = fn.inference if decode else forward_only  # type: ignore[attr-defined]
    sched = fn(n_stages, n_microbatches)
    if not isinstance(sched, list) or not all(
        isinstance(acts, list) and all(isinstance(a, Action) for a in acts) for acts in sched
    ):
        raise ScheduleError(
            f"schedule {schedule_name(schedule)!r} must return one list of Action per stage"
        )
    given_lowered = any(a.op not in COMPUTE_OPS for acts in sched for a in acts)
    compute = [[a for a in acts if a.op in COMPUTE_OPS] for acts in sched] if given_lowered else sched
    if not decode:  # an inference plan with a decode path is checked by its dry run alone
        check_consistency(compute, n_stages, n_microbatches, training,
                          per_microbatch_steps=training and getattr(fn, "per_microbatch_steps", False))
    # a schedule that routes its own messages (interlocking) gives them; dry_run checks them
    lowered = sched if given_lowered or decode else lower(sched)
    dry_run(lowered)
    return lowered


def format_table(name: str | ScheduleFn, n_stages: int, n_microbatches: int, *, backward_cost: int = 1) -> str:
    """The stage x time table of a schedule's dry run (one column per time unit)."""
    lowered = build(name, n_stages, n_microbatches)
    timeline = dry_run(lowered, cost={Op.BACKWARD: backward_cost})
    end = max(t + (backward_cost if a.op is Op.BACKWARD else 1) for row in timeline for t, a in row)
    width = max(3, len(str(n_microbatches - 1)) + 2)
    lines = [f"{schedule_name(name)}: {n_stages} stages x {n_microbatches} microbatches"]
    for k, row in enumerate(timeline):
        cells = ["."] * end
        for t, a in row:
            span = backward_cost if a.op is Op.BACKWARD else 1
            label = "ST" if a.op is Op.STEP else str(a)
            for u in range(t, t + span):
                cells[u] = label
        lines.append(f"stage {k} | " + " ".join(c.ljust(width - 1) for c in cells).rstrip())
    return "\n".join(lines)
