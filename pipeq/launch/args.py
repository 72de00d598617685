"""The command line of ``pipeq launch``: its arguments, and the job-file keys they set."""

from __future__ import annotations

import argparse
from typing import Any

from pipeq.control import rendezvous as rdzv
from pipeq.launch.job.keys import KEYS, LENGTH_RULE

__all__ = ["EPILOG", "add_arguments", "job_overrides"]

EPILOG = (
    f"Length: {LENGTH_RULE}. "
    "Output directory: it belongs to one run. Launching into an --out that holds another run's files "
    "is refused (nothing in it changes) unless --resume continues that run or --overwrite deletes its "
    "files first; a second launch into a directory in use is refused (OUT/.lock). "
    "SIGINT (Ctrl-C) or SIGTERM: the steps already sent finish, a checkpoint of the last one is "
    "written, every stage stops, and the command exits with 130 / 143; --resume continues from that "
    "step. A second signal abandons the steps in flight (the last checkpoint stays)."
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """``pipeq launch``'s arguments and epilog, on its subparser ``p``."""
    p.epilog = EPILOG
    p.add_argument("job", help="the job file (TOML)")
    g = p.add_argument_group("training (override the job file's keys)")
    length = g.add_mutually_exclusive_group()
    length.add_argument("--steps", type=int, help="optimizer steps to train (replaces the file's steps or epochs)")
    length.add_argument("--epochs", type=int, help="passes over the job's data (replaces the file's steps or epochs)")
    g.add_argument("--schedule", help="schedule name, e.g. 1f1b or pairwise (replaces the job's schedule "
                   "table; options need the table)")
    g.add_argument("--microbatches", type=int, metavar="M", help=_key_help("microbatches"))
    g.add_argument("--out", help="output directory")
    g.add_argument("--seed", type=int, help="seed of the stages' initial weights")
    g.add_argument("--checkpoint-every", type=int, metavar="N", help="checkpoint every N steps (0: never)")
    g.add_argument("--keep-checkpoints", type=int, metavar="K", help="keep the newest K checkpoints (0: all)")
    g.add_argument("--eval-every", type=int, metavar="N", help="evaluate every N steps (0: at the end)")
    g.add_argument("--threads-per-stage", type=int, metavar="T", help=KEYS["threads_per_stage"].help)
    g.add_argument("--data-parallel", type=int, metavar="R", help="R replicas of the pipeline, gradients all-reduced")
    g.add_argument("--tensor-parallel", type=int, metavar="T",
                   help="each stage split over T processes of one host, as the job's tp_plan says")
    g.add_argument("--heartbeat-timeout", type=float, help=_key_help("heartbeat_timeout"))
    g.add_argument("--trace", metavar="PATH", help="write a Chrome trace of every stage's actions "
                   "(read it with pipeq report PATH)")
    g.add_argument("--tensorboard", action=argparse.BooleanOptionalAction, default=None,
                   help="write TensorBoard event files of the metrics in OUT/tb/ (default: when the tensorboard "
                        "package is installed; --tensorboard: an error when it is not)")
    g.add_argument("--start-timeout", type=float, help=_key_help("start_timeout"))
    g.add_argument("--max-restarts", type=int, metavar="K",
                   help="after a stage fails, restart the stages from the newest checkpoint, up to K times "
                        f"(default {KEYS['max_restarts'].default}: a failure ends the run)")
    g.add_argument("--snapshot-every", type=int, metavar="N",
                   help="every N steps, keep the stages' state in the driver's memory, so that a restart "
                        f"(--max-restarts) goes on from it without reading the disk (default {KEYS['snapshot_every'].default}: "
                        "none)")
    run_dir = p.add_mutually_exclusive_group()
    run_dir.add_argument("--resume", action="store_true",
                         help="continue the run in --out from its newest complete checkpoint")
    run_dir.add_argument("--overwrite", action="store_true",
                         help="delete the files of the run in --out (metrics, checkpoints, final/, model.pt, tb/) "
                              "and start a new one there")
    p.add_argument("--quiet", action="store_true", help="plain log lines instead of a progress bar")
    m = p.add_argument_group("multi-host (default: torchrun's RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT, "
                             "or SLURM_PROCID/SLURM_NTASKS)")
    m.add_argument("--nnodes", type=int, help="number of pipeq nodes (node 0 runs the driver)")
    m.add_argument("--node-rank", type=int, help="this node's rank")
    m.add_argument("--master-addr", help="node 0's address (the rendezvous store)")
    m.add_argument("--master-port", type=int, help=f"the rendezvous store's port (default {rdzv.DEFAULT_PORT})")
    m.add_argument("--bind", help="address or interface this node's processes bind to (default: "
                                  "the one that routes to the master address)")
    m.add_argument("--rejoin-timeout", type=float, metavar="SECONDS",
                   help="with --max-restarts: after a node is lost (its agent died or was cut off), wait this "
                        "long for it to join again, i.e. for `pipeq launch --node-rank R` started anew on any "
                        f"host (default {KEYS['rejoin_timeout'].default:g})")
    m.add_argument("--min-nodes", type=int, metavar="N",
                   help="with --max-restarts: if a lost node does not rejoin within --rejoin-timeout, re-place "
                        "its stages on the nodes left, as long as at least N remain (default: every node, i.e. "
                        "the run ends instead)")
    m.add_argument("--trusted-network", action="store_true", default=None,
                   help=KEYS["trusted_network"].help + " (default: false)")
    m.add_argument("--run-id", help="keeps concurrent runs on one store apart")
    m.add_argument("--secret-file", metavar="PATH",
                   help="the job's secret, the same on every node, in a file only its owner may read "
                        "(make one with `pipeq secret --out PATH`); default: $PIPEQ_SECRET. A multi-host "
                        "run refuses to start without one; a single-host run makes its own")


def _key_help(name: str) -> str:
    """The flag of job key ``name``: the key's help and its default (:data:`KEYS`, which reads a run
    setting's from its RunConfig field)."""
    key = KEYS[name]
    return f"{key.help} (default {key.default:g})" if isinstance(key.default, float) else f"{key.help} (default {key.default})"


def job_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The job-file keys the command line sets (None: not given)."""
    keys = ("steps", "epochs", "schedule", "microbatches", "out", "seed", "checkpoint_every", "keep_checkpoints",
            "eval_every", "threads_per_stage", "heartbeat_timeout", "start_timeout", "trace", "data_parallel",
            "tensor_parallel", "max_restarts", "snapshot_every", "rejoin_timeout", "min_nodes", "tensorboard",
            "trusted_network")
    return {k: getattr(args, k) for k in keys}
