"""``pipeq launch``'s entry: the job loaded, then node 0 trains it (the driver) and every other node runs its agent."""

from __future__ import annotations

import argparse
import sys

from pipeq.control import rendezvous as rdzv
from pipeq.launch.args import job_overrides
from pipeq.launch.job import Job, load_job
from pipeq.launch.signals import StopSignals
from pipeq.launch.trainer import Trainer

__all__ = ["run"]


def run(args: argparse.Namespace) -> int:
    """``pipeq launch`` with its parsed ``args``: the exit code."""
    signals = StopSignals()
    with signals.installed():
        try:
            return _run(args, signals)
        except KeyboardInterrupt:
            print(f"pipeq launch: interrupted by {signals.name()}", file=sys.stderr, flush=True)
            return signals.exit_code()


def _run(args: argparse.Namespace, signals: StopSignals) -> int:
    """Load the job and the rendezvous; node 0 (or a single host) trains, another node runs its agent."""
    try:
        job = load_job(args.job, job_overrides(args))
        rz = rdzv.Rendezvous.from_settings(args.nnodes, args.node_rank, args.master_addr, args.master_port,
                                args.bind, args.run_id, secret_file=args.secret_file)
    except ValueError as exc:
        print(f"pipeq launch: {exc}", file=sys.stderr)
        return 2
    if rz is not None and rz.node_rank != 0:
        return _run_agent(job, rz)
    return Trainer(job, rz, resume=args.resume, overwrite=getattr(args, "overwrite", False), quiet=args.quiet,
                   signals=signals).run()


def _run_agent(job: Job, rz: rdzv.Rendezvous) -> int:
    """Node ``rz.node_rank``'s agent: its stages, as the job and node 0 say, until the run ends."""
    from pipeq.control.processes import RunSetup
    from pipeq.launch.agent import AgentError, run_agent

    def log(line: str) -> None:
        print(f"pipeq launch: {line}", file=sys.stderr, flush=True)

    try:
        # the stages made once on this node (as node 0 makes its own), not in each stage process;
        # node 0's description of them (plain data) is compared before any stage starts here
        recipe = job.recipe.stages_made()
        n = recipe.count_stages()
        tp_plans = None
        if job.tensor_parallel > 1:
            from pipeq.parallel import tensor as tensorpar

            tp_plans = tensorpar.check_plans(None, job.tp_plan, job.tensor_parallel, n)
        config = job.run_config()
        return run_agent(rz, recipe, n, RunSetup(config, config.numerics_for(n), tp_plans), log=log)
    except (AgentError, RuntimeError, ValueError) as exc:
        log(str(exc))
        return 1
