"""The ``pipeq`` command.

    pipeq schedule 1f1b --stages 4 --microbatches 8   # print a schedule's stage x time table
    pipeq launch examples/digits.toml                 # train a job file (see pipeq.launch)
"""

from __future__ import annotations

import argparse
import sys

from . import __version__, schedules
from .errors import ScheduleError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pipeq", description="pipeline-parallel training for PyTorch")
    parser.add_argument("--version", action="version", version=f"pipeq {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("schedule", help="print a schedule's planned stage x time table (dry run)")
    p.add_argument("name", choices=sorted(schedules.SCHEDULES))
    p.add_argument("--stages", type=int, required=True)
    p.add_argument("--microbatches", type=int, required=True)
    p.add_argument("--backward-cost", type=int, default=2,
                   help="time units of a backward relative to a forward's 1 (default 2)")
    from . import launch

    p = sub.add_parser("launch", help="train a job file (TOML), on one host or several",
                       description=launch.__doc__.split("\n\n")[0] if launch.__doc__ else None)
    launch.add_arguments(p)
    args = parser.parse_args(argv)
    if args.command == "launch":
        return launch.run(args)
    if args.command == "schedule":
        try:
            print(schedules.format_table(args.name, args.stages, args.microbatches,
                                         backward_cost=args.backward_cost))
        except ScheduleError as exc:
            print(f"pipeq: {exc}", file=sys.stderr)
            return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
