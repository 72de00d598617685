"""The ``pipeq`` command: its subcommands schedule, report, secret, export and launch.

    pipeq schedule 1f1b --stages 4 --microbatches 8   # print a schedule's stage x time table
    pipeq schedule 1f1b --stages 4 --microbatches 8 --plot plan.png   # ... and draw it
    pipeq schedule zb-h1 --stages 4 --microbatches 8 --costs 1,1,1   # split backward: F, I, W costs
    pipeq schedule zb-h1 --stages 4 --microbatches 8 --csv zb.csv   # ... and write torch's schedule CSV
    pipeq schedule v-half --stages 4 --microbatches 8 --memory   # ... and each stage's peak in flight
    pipeq schedule auto --stages 4 --microbatches 8 --costs 5,5,5   # which schedule these costs (ms) favour
    pipeq schedule auto --from-trace run.json          # ... with a traced run's measured costs
    pipeq launch examples/digits.toml                 # train a job file (see pipeq.launch)
    pipeq report run.json --skip-first 1 --plot run.png   # where a traced run's time went
    pipeq secret --out job.secret                     # a fresh job secret for a multi-host run
    pipeq export pipeq-run --format safetensors --out model.safetensors   # the model for other tools
"""

from __future__ import annotations

import argparse
import os
import secrets
import sys

from pipeq import __version__
from pipeq import schedules
from pipeq.wire.keys import SECRET_ENV, JobSecret

__all__ = ["main", "build_parser"]


def main(argv: list[str] | None = None) -> int:
    """``pipeq ARGS`` (``argv``; default: this process's): the exit code."""
    words = sys.argv[1:] if argv is None else argv
    if words[:1] == ["launch"] and not {"-h", "--help"} & set(words):
        from pipeq.control import forkserver
        from pipeq.runtime import faults

        try:  # a malformed PIPEQ_FAULT: refused before any process starts (the stages and replicas it
            faults.from_environ()  # names are checked once the job is known, before the stages start)
        except ValueError as exc:
            print(f"pipeq launch: {exc}", file=sys.stderr)
            return 2
        # its imports (torch; torch.compile's too for a compiled job) run while this process imports launch's
        started = forkserver.start(compiles=_compiles(words[1:]))
        try:
            return _launch(argv)
        finally:
            if started:  # every stage has stopped: it goes at once, not seconds after the command ends
                forkserver.stop()
    return _command(argv)


def _compiles(words: list[str]) -> bool:
    """Whether the job file a launch names (its first ``.toml`` word) compiles its stages (its
    ``compile`` key), read before torch is imported; False when it cannot tell (the launch then
    reads the file itself and says what is wrong with it)."""
    import tomllib

    path = next((w for w in words if w.endswith(".toml") and not w.startswith("-")), None)
    try:
        with open(path, "rb") as f:  # type: ignore[arg-type]
            return bool(tomllib.load(f).get("compile"))
    except (TypeError, OSError, ValueError):
        return False


def _launch(argv: list[str] | None) -> int:
    from pipeq.launch import command as launch_command  # torch: only now, not for --help

    return launch_command.run(build_parser().parse_args(argv))


def _command(argv: list[str] | None) -> int:
    """Every other subcommand (or ``launch --help``)."""
    args = build_parser().parse_args(argv)
    if args.command == "launch":
        return _launch(argv)
    try:
        if args.command == "schedule":
            return _schedule(args)
        if args.command == "report":
            return _report(args)
        if args.command == "secret":
            return _secret(args)
        if args.command == "export":
            from pipeq.checkpoint.export import export

            print(f"wrote {export(args.source, args.format, args.out)} ({args.format})")
            return 0
    except (ValueError, OSError, RuntimeError) as exc:  # ScheduleError is a ValueError; RuntimeError: no matplotlib
        print(f"pipeq: {exc}", file=sys.stderr)
        return 2
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The ``pipeq`` command's parser, every subcommand's too (what :func:`main` parses, and the
    docs' command-line reference renders: :mod:`pipeq.launch.reference`). Imports no torch."""
    parser = argparse.ArgumentParser(prog="pipeq", description="pipeline-parallel training for PyTorch")
    parser.add_argument("--version", action="version", version=f"pipeq {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    _schedule_arguments(sub.add_parser("schedule", help="print a schedule's planned stage x time table (dry run)"))
    p = sub.add_parser("report", help="where a traced run's time went: per stage, per step, the bubble",
                       description="Read a trace (PipelineRunner(trace=...) or pipeq launch --trace) and "
                                   "print each stage's compute, send, wait and idle time and the bubble.")
    p.add_argument("trace", help="the trace file (JSON)")
    p.add_argument("--plot", metavar="OUT.png", help="also draw a stage x time picture (needs matplotlib)")
    p.add_argument("--steps", metavar="all|N|N-M",
                   help="the steps to cover (report and picture); default: every step in the report, "
                        "the last training step in the picture")
    p.add_argument("--skip-first", type=int, default=0, metavar="K",
                   help="leave the first K steps out of the report (the first includes lazy set-up)")
    p.add_argument("--include-predict", action="store_true", help="also cover forward-only (predict) steps")
    p.add_argument("--critical-path", action="store_true",
                   help="also split each step's critical path, slot by slot (pipeq.trace.critical; one host)")
    p = sub.add_parser("secret", help="print a fresh job secret (64 hex characters) for a multi-host run",
                       description="Print a fresh random job secret. Every node of a multi-host run needs "
                                   f"the same one: as `pipeq launch --secret-file FILE` or in ${SECRET_ENV}.")
    p.add_argument("--out", metavar="FILE", help="write it to FILE instead, readable by its owner only "
                   "(mode 0600; an existing FILE is never overwritten)")
    p = sub.add_parser("export", help="write a run's model state for other tools: dcp, safetensors or pt",
                       description="Write the whole model's state (its own names; tied weights under each of "
                                   "their names) from a checkpoint, a run directory or a model.pt.")
    p.add_argument("source", help="a checkpoint directory, a pipeq launch run directory (its final state, else "
                                  "its newest checkpoint) or a model.pt")
    p.add_argument("--format", required=True, choices=["dcp", "safetensors", "pt"],
                   help="dcp: a torch.distributed.checkpoint directory; safetensors; pt: torch.save")
    p.add_argument("--out", required=True, help="where to write it (a new directory for dcp, a file otherwise)")
    from pipeq import launch
    from pipeq.launch import args as launch_args

    p = sub.add_parser("launch", help="train a job file (TOML), on one host or several",
                       description=launch.__doc__.split("\n\n")[0] if launch.__doc__ else None)
    launch_args.add_arguments(p)
    return parser


def _schedule_arguments(p: argparse.ArgumentParser) -> None:
    """``pipeq schedule``'s arguments."""
    p.add_argument("name", choices=sorted(schedules.SCHEDULES) + ["auto"],
                   help="a schedule, or auto: rank the schedules by their dry run with --costs (ms) or a trace's")
    p.add_argument("--distance", type=int, metavar="D",
                   help="nwise's distance d >= 1 (its option: pipeq.research.Interlock('nwise', distance=d) in Python, "
                        "schedule = { name = \"nwise\", distance = d } in a job file)")
    p.add_argument("--stages", type=int, help="pipeline processes (a schedule of v stages per process plans "
                                              "v x N stages); required but with auto --from-trace")
    p.add_argument("--microbatches", type=int, help="microbatches per step (required but with auto --from-trace)")
    p.add_argument("--hop", type=float, metavar="MS", help="auto: latency of one message between processes (ms)")
    p.add_argument("--memory", action="store_true",
                   help="also print each stage's predicted peak of microbatches in flight (a process's "
                        "stages together with several per process, beside 1F1B's)")
    p.add_argument("--memory-limit", type=float, default=1.0, metavar="X",
                   help="auto: activation memory allowed, relative to 1F1B's peak (default 1)")
    p.add_argument("--from-trace", metavar="TRACE.json", help="auto: take F, I, W and hop from a traced run")
    p.add_argument("--backward-cost", type=int, default=2,
                   help="time units of a backward relative to a forward's 1 (default 2)")
    p.add_argument("--costs", type=_costs, metavar="F,I,W",
                   help="time units of a forward, an input gradient and a weight gradient (a backward B = I + W); "
                        "the table then ends with the step's length and bubble")
    p.add_argument("--plot", metavar="OUT.png", help="also draw the planned timeline (needs matplotlib)")
    p.add_argument("--csv", metavar="OUT.csv",
                   help="also write the plan as torch.distributed.pipelining's compute-only schedule CSV "
                        "(run one with pipeq.from_csv(path))")


def _costs(text: str) -> tuple[float, ...]:
    """``--costs F,I,W``: three positive numbers (integers for a table: whole time units)."""
    try:
        costs = tuple(float(c) for c in text.split(","))
    except ValueError:
        costs = ()
    if len(costs) != 3 or min(costs) <= 0:
        raise argparse.ArgumentTypeError(f"--costs is F,I,W: three positive numbers, e.g. 1,1,1; got {text!r}")
    return tuple(int(c) if c == int(c) else c for c in costs)


def _auto(args: argparse.Namespace) -> int:
    """``pipeq schedule auto``: the ranking :func:`pipeq.schedules.choose.choose` makes."""
    from pipeq.schedules.choose import choose, format_choice, stage_cost

    more = {} if args.hop is None else {"hop": args.hop}
    if args.from_trace:
        from pipeq.trace.advice import choice_of
        from pipeq.trace.format import load_trace

        choice = choice_of(load_trace(args.from_trace), memory_limit=args.memory_limit, **more)
    else:
        if args.stages is None or args.microbatches is None:
            raise ValueError("schedule auto needs --stages and --microbatches (or --from-trace TRACE.json)")
        f, i, w = args.costs or (1, 1, 1)
        choice = choose(stage_cost(f, i, w), args.stages, args.microbatches, memory_limit=args.memory_limit, **more)
    print(format_choice(choice))
    return 0


def _schedule(args: argparse.Namespace) -> int:
    if args.name == "auto":
        if args.memory:
            raise ValueError("--memory prints a schedule's predicted peaks (pipeq schedule NAME ... --memory); "
                             "auto's activation limit is --memory-limit X (relative to 1F1B's peak)")
        return _auto(args)
    if args.stages is None or args.microbatches is None:
        raise ValueError(f"schedule {args.name} needs --stages and --microbatches")
    entry = schedules.SCHEDULES[args.name]
    takers = [n for n, s in schedules.SCHEDULES.items() if "distance" in getattr(s, "option_names", ())]
    if args.distance is not None and args.name not in takers:
        raise ValueError(f"--distance applies to schedule {' and '.join(takers)} only, not {args.name!r}")
    if getattr(entry, "needs", None) == "distance" and (args.distance is None or args.distance < 1):
        got = "" if args.distance is None else f", got --distance {args.distance}"
        raise ValueError(f"schedule {args.name} needs its distance: --distance D, an integer >= 1{got} "
                         "(stage k is trained by the loss D stages up)")
    name = (entry.with_options(distance=args.distance) if args.distance is not None
            else schedules.resolve(args.name))
    print(schedules.format_table(name, args.stages, args.microbatches, backward_cost=args.backward_cost,
                                 costs=args.costs))
    if args.memory:
        from pipeq.schedules.memory import format_memory

        print(format_memory(name, args.stages, args.microbatches))
    if args.plot:
        from pipeq.trace import plot
        from pipeq.trace.format import planned_trace

        plan = planned_trace(name, args.stages, args.microbatches, backward_cost=args.backward_cost,
                             costs=args.costs)
        print(f"plot: {plot.plot_trace(plan, args.plot, steps='all')}")
    if args.csv:
        from pipeq.launch.csv_schedule import to_csv

        to_csv(args.csv, name, args.stages, args.microbatches)
        print(f"csv: {args.csv}")
    return 0


def _secret(args: argparse.Namespace) -> int:
    """A fresh secret (as :meth:`JobSecret.generate` makes one), on stdout or in a new 0600 file."""
    text = secrets.token_hex(32)
    JobSecret.from_text(text)  # what every node will check it against
    if args.out is None:
        print(text)
        return 0
    try:  # created with its final mode: never readable by others, not even for a moment
        fd = os.open(args.out, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        raise OSError(f"{args.out} already exists; remove it first (a run's nodes must share one secret)") from None
    with os.fdopen(fd, "w") as f:
        f.write(text + "\n")
    os.chmod(args.out, 0o600)  # whatever the umask
    print(f"wrote a job secret to {args.out}; give every node the same file (--secret-file) "
          f"or its content (${SECRET_ENV})", file=sys.stderr)
    return 0


def _report(args: argparse.Namespace) -> int:
    from pipeq.trace import plot
    from pipeq.trace import report
    from pipeq.trace.format import load_trace

    trace = load_trace(args.trace)
    steps = report.parse_steps(args.steps) if args.steps else None
    print(report.format_report(report.analyze(trace, args.include_predict, skip_first=args.skip_first,
                                              steps="all" if steps is None else steps)))
    if args.critical_path:
        from pipeq.trace import critical

        print(critical.format_critical(critical.critical_path(trace, skip_first=args.skip_first)))
    if args.plot:
        print(f"plot: {plot.plot_trace(trace, args.plot, steps=steps)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
