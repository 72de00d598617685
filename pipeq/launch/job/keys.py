"""The job-file keys: each one's TOML type, default, one-line help and section, in one table.

A key that is a run setting (a field of :class:`~pipeq.RunConfig` or of one of its parts, of the
key's name) declares no default of its own: it is written :data:`RUN`, and its default is read
from the dataclass field (:func:`pipeq.control.config.setting_default`), but where ``pipeq launch``
sets another on purpose (:data:`LAUNCH_DEFAULTS`, each with why). Every other key's default is
declared here, once.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from typing import Any

from pipeq.control.config import setting_default

__all__ = ["Key", "KEYS", "SECTIONS", "TOML_TYPES", "REQUIRED", "RECIPE_KEYS", "FACTORY_ARGS", "LENGTH_RULE",
           "RUN", "LAUNCH_DEFAULTS", "field_of"]

#: How long a job trains, as ``pipeq launch --help`` and the README state it.
LENGTH_RULE = ("a job trains for steps or for epochs, never both: set one of them in the job file; "
               "--steps or --epochs on the command line replaces whichever the file sets")

#: The sections the keys are grouped in, in the order a reference lists them, with their titles.
SECTIONS: dict[str, str] = {
    "stages": "What the stages are",
    "training": "How they train",
    "schedule": "The schedule",
    "data": "The training data",
    "evaluation": "Evaluation",
    "output": "The output directory and logging",
    "processes": "The stage processes",
    "numerics": "How the stages compute",
    "multi-host": "Multi-host runs",
}

#: What a TOML value of each type is called, with its article.
TOML_TYPES: dict[type, str] = {str: "a string", int: "an integer", float: "a float", dict: "a table",
                               list: "an array", bool: "a boolean"}


@dataclass(frozen=True)
class Key:
    """One job-file key: the TOML type(s) it takes, its default (None: not set), a one-line help,
    its section (:data:`SECTIONS`), and where it goes: the stages' ``Recipe`` or the ``Job``."""

    type: type | tuple[type, ...]
    default: Any
    help: str
    section: str
    goes_to: str = "job"  # "recipe": the stage processes build from it; "job": the driver uses it
    minimum: int | None = None  # the smallest value an integer key takes
    required: bool = False  # a job file must set it ("loss" too, but with Associated Learning)
    setting: bool = False  # a run setting: its default is its RunConfig field's (or LAUNCH_DEFAULTS')

    @property
    def types(self) -> tuple[type, ...]:
        return self.type if isinstance(self.type, tuple) else (self.type,)

    def type_text(self) -> str:
        """The types the key takes, as a sentence says them: "a string or a table"."""
        return " or ".join(TOML_TYPES[t] for t in self.types)


def _recipe(type_: type | tuple[type, ...], default: Any, help: str, section: str, **more: Any) -> Key:
    return Key(type_, default, help, section, goes_to="recipe", **more)


NUMBER = (int, float)


class _Run:
    """The default of a key that is a run setting: its RunConfig field's (see the module)."""

    def __repr__(self) -> str:
        return "RUN"


#: Written as a key's default: the key is a run setting, whose default its RunConfig field declares.
RUN: Any = _Run()

#: The run settings whose default ``pipeq launch`` sets otherwise than a library runner, with why.
LAUNCH_DEFAULTS: dict[str, tuple[Any, str]] = {
    "step_timeout": (300.0, "a job runs unattended: a stage stuck in one action fails the run (and a restart "
                            "may follow) instead of hanging it; a library cannot know how long a user's "
                            "actions may take, so a runner's is off"),
}

#: Every key a job file may set. Types are checked, so a typo or a wrong value fails loudly.
KEYS: dict[str, Key] = {
    # -- read by the stage processes (the Recipe) --
    "stages": _recipe(str, None, "'pkg.mod:fn': () -> [stage modules], or (k, n) -> stage k (with n_stages)",
                      "stages", required=True),
    "loss": _recipe(str, None, "the end-to-end loss: a class, a zero-argument factory, or the loss itself "
                    "(required but with Associated Learning, whose layers default to MSE)", "training"),
    "optimizer": _recipe(str, None, "called with a stage's parameters and optimizer_args, e.g. 'torch.optim:SGD'",
                         "training", required=True),
    "optimizer_args": _recipe(dict, {}, "keyword arguments of optimizer", "training"),
    "lr_scheduler": _recipe(str, None, "called with each stage's optimizer and lr_scheduler_args", "training"),
    "lr_scheduler_args": _recipe(dict, {}, "keyword arguments of lr_scheduler", "training"),
    "n_stages": _recipe(int, None, "the number of stages: needed by the (k, n) form of stages and by a measured "
                        "balance", "stages", minimum=1),
    "seed": _recipe(int, 0, "the stages and heads are built under torch.manual_seed(seed): the same weights on "
                    "every host", "stages"),
    "aux_heads": _recipe(str, None, "interlocking: () or (n_stages) -> the N-1 auxiliary heads", "schedule"),
    "aux_loss": _recipe(str, None, "the auxiliary heads' loss (default: cross-entropy)", "schedule"),
    "stages_args": _recipe(dict, {}, "keyword arguments of stages", "stages"),
    "loss_args": _recipe(dict, {}, "keyword arguments of loss", "training"),
    "aux_heads_args": _recipe(dict, {}, "keyword arguments of aux_heads", "schedule"),
    "aux_loss_args": _recipe(dict, {}, "keyword arguments of aux_loss", "schedule"),
    "lr_scheduler_interval": _recipe(str, None, '"step" (the default: the stages step the scheduler after every '
                                     'optimizer step) or "epoch" (pipeq launch steps it between epochs)',
                                     "training"),
    "model": _recipe(str, None, "'pkg.mod:fn': () -> the whole model (instead of stages): an nn.Sequential that "
                     "balance splits, or any nn.Module that split_modules splits by name", "stages"),
    "split_modules": _recipe(list, None, 'each stage\'s module names ([["tok_emb", "blocks.0"], ["blocks.1", '
                             '"lm_head"]]): model split by name (pipeq.split(model, modules=...)); each stage runs '
                             "the model's forward, which skips the modules it lacks", "stages"),
    "balance": _recipe((list, str), None, 'layers per stage ([3, 2, 1]), or "time" / "memory": measured on '
                       "balance_sample into n_stages stages when the run starts", "stages"),
    "balance_sample": _recipe(str, None, "() -> the model's input, which a measured balance runs", "stages"),
    "model_args": _recipe(dict, {}, "keyword arguments of model", "stages"),
    "balance_sample_args": _recipe(dict, {}, "keyword arguments of balance_sample", "stages"),
    # -- read by the driver (the Job) --
    "data": Key(str, None, "'pkg.mod:fn': (epoch) -> an iterable of (x, target) batches", "data", required=True),
    "eval_data": Key(str, None, "() -> (x, target) or a list of such batches, evaluated every eval_every steps "
                     "and at the end", "evaluation"),
    "schedule": Key((str, dict), RUN, 'a schedule name, or a table of its name and options '
                    '({ name = "nwise", distance = 2 })', "schedule"),
    "auto_memory_limit": Key((str, int, float), RUN, 'with schedule = "auto": the memory each stage process may '
                             'hold, "8GiB" (or bytes) or a fraction of its device (0.8, "80%"); auto picks the '
                             "fastest schedule whose predicted peak fits", "schedule"),
    "microbatches": Key(int, RUN, "microbatches each batch is split into", "training", minimum=1),
    "steps": Key(int, None, f"optimizer steps to train ({LENGTH_RULE})", "training", minimum=1),
    "epochs": Key(int, None, "passes over the data to train (instead of steps)", "training", minimum=1),
    "out": Key(str, "pipeq-run", "the output directory: checkpoints, final state, metrics.jsonl, tb/", "output"),
    "max_restarts": Key(int, 0, "after a stage fails, restart from the newest checkpoint up to K times (0: a "
                        "failure ends the run)", "processes", minimum=0),
    "snapshot_every": Key(int, 0, "every N steps, keep every stage's state in the driver's memory, which a "
                          "restart (max_restarts) loads instead of the newest checkpoint when it is newer; "
                          "0: none", "processes", minimum=0),
    "fault_tolerance": Key(str, RUN, '"replicas" (data_parallel >= 2): a replica whose stage fails is left out of '
                           "that step (the mean over the other replicas' samples) and rebuilt from a healthy one "
                           "for the next; the run goes on", "processes"),
    "checkpoint_every": Key(int, 0, "checkpoint every N steps (0: only the final state)", "output", minimum=0),
    "keep_checkpoints": Key(int, 0, "keep the newest K checkpoints (0: keep all)", "output", minimum=0),
    "eval_every": Key(int, 0, "evaluate every N steps (0: at the end only)", "evaluation", minimum=0),
    "log_every": Key(int, 10, "with --quiet: a log line every N steps", "output", minimum=0),
    "tensorboard": Key(bool, None, "TensorBoard event files of the metrics (loss, lr, samples/s, eval metrics, "
                       "restarts; each stage's busy time and bubble with trace) in OUT/tb/: by default when the "
                       "tensorboard package is installed (pip install pipeq[tensorboard]); true: an error when it "
                       "is not; false: never", "output"),
    "placement": Key(dict, RUN, "[placement] nodes = [[0], [1, 2]]: the processes each node runs (process "
                     "r * n_stages + k is replica r's stage k)", "multi-host"),
    "threads_per_stage": Key(int, RUN, "torch threads per stage process (default: cores / stages)", "processes",
                             minimum=1),
    "heartbeat_timeout": Key(NUMBER, RUN, "seconds of silence before a stage is failed", "processes"),
    "start_timeout": Key(NUMBER, RUN, "seconds to wait for every stage (and node) to start", "processes"),
    "step_timeout": Key(NUMBER, RUN, "seconds one compute action (forward, backward, step) may take; 0: "
                        "no limit", "processes"),
    "trace": Key(str, RUN, "write a Chrome trace of every stage's actions there (read it with pipeq report)",
                 "output"),
    "data_parallel": Key(int, RUN, "R replicas of the pipeline (R x N processes), gradients all-reduced",
                         "processes", minimum=1),
    "tensor_parallel": Key(int, RUN, "T processes per stage, on one host (R x N x T), split as tp_plan says",
                           "processes", minimum=1),
    "stages_per_process": Key(int, RUN, "model stages per process (virtual stages): interleaved-1f1b and "
                              "looped-bfs take any number >= 2; zbv and dualpipev hold 2", "processes", minimum=1),
    "tp_plan": Key(list, RUN, 'one table per stage: submodule names to "colwise" / "rowwise"', "processes"),
    "sharding": Key(str, RUN, '"none" (whole replicas), "fsdp" (data_parallel >= 2: the replicas shard each '
                    "stage's parameters, gradients and optimizer state with torch's FSDP2; checkpoints stay whole) "
                    'or "hsdp" (shard in groups of shard_size replicas, replicate across the groups)',
                    "processes"),
    "shard_size": Key(int, RUN, 'with sharding = "hsdp": the replicas of each shard group (a divisor of '
                      "data_parallel)", "processes", minimum=2),
    "fsdp_reshard": Key(str, RUN, 'with sharding = "fsdp" or "hsdp": "step" (gathered parameters kept through a '
                        'step) or "microbatch" (freed after each forward and backward)', "processes"),
    "rejoin_timeout": Key(NUMBER, 60.0, "with max_restarts: seconds to wait for a lost node to join again (the "
                          "same --node-rank started anew) before its stages are re-placed or the run ends",
                          "multi-host"),
    "min_nodes": Key(int, None, "with max_restarts: the fewest nodes the run goes on with; a node that does not "
                     "rejoin in rejoin_timeout has its stages re-placed on the others (default: every node, "
                     "no re-placement)", "multi-host", minimum=1),
    "tcp_security": Key(str, RUN, 'TCP between hosts: "encrypt" (CURVE on every socket) or "authenticate" '
                        "(a Poly1305 MAC on every data message, not encrypted)", "multi-host"),
    "trusted_network": Key(bool, RUN, "the network between the hosts is yours alone: replicas across "
                           "hosts run torch's collectives, which authenticate and encrypt nothing (refused "
                           "without it)", "multi-host"),
    "max_message_mb": Key(int, RUN, "the largest tensor (MiB) one stage sends another", "processes"),
    "shm_slots": Key(int, RUN, "one host: shared-memory slots per data channel (0: every tensor in ZeroMQ frames)",
                     "processes"),
    "data_args": Key(dict, {}, "keyword arguments of data", "data"),
    "eval_data_args": Key(dict, {}, "keyword arguments of eval_data", "evaluation"),
    "metrics": Key(dict, {}, "eval metrics: name -> 'pkg.mod:fn', (output, target) -> float", "evaluation"),
    "lr_scheduler_monitor": Key(str, None, "what a ReduceLROnPlateau is stepped with after each epoch (default: "
                                "eval_loss, or train_loss without eval_data)", "training"),
    "precision": Key(str, RUN, '"fp32", "bf16" or "fp16" (autocast; fp16 with loss scaling)', "numerics"),
    "clip_grad_norm": Key(NUMBER, RUN, "clip the gradients by their global norm over every stage", "numerics"),
    "clip_norm_type": Key(NUMBER, RUN, "the p of clip_grad_norm's norm", "numerics"),
    "check_finite": Key((bool, str), RUN, 'false, "raise" (or true): fail naming the first NaN or Inf, or '
                        '"skip": skip a step whose gradients are not finite', "numerics"),
    "loss_weighting": Key(str, RUN, '"token" (each microbatch\'s mean loss weighted by its target\'s tokens, '
                          "ignore_index -100 left out: the batch's token mean) or \"sample\" (by its rows)",
                          "training"),
    "recompute": Key((bool, list), RUN, "recompute each stage's forward in its backward (or one boolean per "
                     "stage): less activation memory", "numerics"),
    "compile": Key((bool, dict), RUN, "torch.compile each stage in its process: true, or a table of torch.compile's "
                   "arguments (backend, mode, dynamic, fullgraph, options), cache_dir (default: OUT/compile-cache, "
                   "kept across restarts and runs) and mark_dynamic", "numerics"),
}

KEYS = {name: dataclasses.replace(key, default=LAUNCH_DEFAULTS[name][0] if name in LAUNCH_DEFAULTS
                                  else setting_default(name), setting=True) if key.default is RUN else key
        for name, key in KEYS.items()}

#: The keys a job file must set (and ``loss``, but with Associated Learning).
REQUIRED: tuple[str, ...] = tuple(name for name, key in KEYS.items() if key.required)
#: The keys the stage processes build from (:class:`pipeq.launch.job.Recipe`'s fields).
RECIPE_KEYS: tuple[str, ...] = tuple(name for name, key in KEYS.items() if key.goes_to == "recipe")
#: A factory's arguments -> the key naming the factory (``optimizer_args`` -> ``optimizer``).
FACTORY_ARGS: dict[str, str] = {name: name[: -len("_args")] for name in KEYS
                                if name.endswith("_args") and name[: -len("_args")] in KEYS}


def field_of(name: str) -> Any:
    """The dataclass field of key ``name``, with its default (a table's or an array's: a copy
    for each instance)."""
    default = KEYS[name].default
    if isinstance(default, (dict, list)):
        return dataclasses.field(default_factory=lambda: copy.deepcopy(default))
    return dataclasses.field(default=default)
