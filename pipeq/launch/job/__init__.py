"""Job files: what ``pipeq launch JOB.toml`` trains, as importable names and settings.

A job file (TOML, read with the standard library's tomllib)::

    stages = "examples.digits_job:stages"        # () -> [stage modules], or (k, n) -> stage k
    n_stages = 3                                 # needed with the (k, n) form
    # or, instead of stages: one nn.Sequential split into stages (pipeq.balance)
    # model = "pkg.mod:model"                    # () -> nn.Sequential
    # balance = [3, 2, 1]                        # layers per stage; or "time" / "memory",
    # balance_sample = "pkg.mod:sample"          # measured on () -> the model's input, into
    #                                            # n_stages stages, once, when the run starts
    loss = "torch.nn:CrossEntropyLoss"           # a class, a zero-argument factory, or the loss
    optimizer = "torch.optim:SGD"                # called with a stage's parameters (+ the args)
    optimizer_args = { lr = 0.1, momentum = 0.9 }
    lr_scheduler = "torch.optim.lr_scheduler:StepLR"   # optional, called with the optimizer
    lr_scheduler_args = { step_size = 20, gamma = 0.5 }
    lr_scheduler_interval = "step"               # or "epoch": stepped between epochs (see below)
    lr_scheduler_monitor = "eval_loss"           # ReduceLROnPlateau's metric (default: eval_loss,
                                                 # or train_loss without eval_data)
    data = "examples.digits_job:train_batches"   # (epoch) -> iterable of (x, target) batches
    data_args = { batch = 32 }                   # keyword arguments of data (optional)
    eval_data = "examples.digits_job:heldout"    # optional: () -> (x, target) or batches
    metrics = { top3 = "examples.digits_job:top3" }   # eval metrics: (output, target) -> float
    schedule = "1f1b"                            # or a table with the schedule's options:
                                                 # { name = "nwise", distance = 2 }
                                                 # { name = "async", warmup = 3, weight_stashing = false }
                                                 # { name = "al", first_loss = "mse", inference_layer = 1 }
    aux_heads = "pkg.mod:heads"                  # interlocking: () -> the N-1 auxiliary heads
    aux_loss = "torch.nn:CrossEntropyLoss"       # their loss (optional, this is the default)
    microbatches = 4
    steps = 60                                   # or epochs = 3 (one of them: see LENGTH_RULE)
    out = "runs/digits"
    checkpoint_every = 20                        # 0: only the final state
    max_restarts = 0                             # optional: after a stage fails, go on from the newest
                                                 # checkpoint, up to this many times
    snapshot_every = 10                          # optional: every 10 steps, the stages' state kept in
                                                 # the driver's memory (a restart loads it, no disk)
    rejoin_timeout = 60                          # optional, multi-host with max_restarts: seconds a lost
                                                 # node has to join again (--node-rank r started anew)
    min_nodes = 1                                # optional: then go on with fewer nodes, its stages
                                                 # re-placed (default: every node, never fewer)
    keep_checkpoints = 3                         # the newest 3 (0: keep all)
    tensorboard = false                          # optional: no TensorBoard event files in out/tb/ (default:
                                                 # written when the tensorboard package is installed)
    seed = 0
    data_parallel = 1                            # R replicas of the pipeline (R x N processes)
    fault_tolerance = "replicas"                 # optional, data_parallel >= 2: a replica whose stage
                                                 # fails is left out of that step and rebuilt; the run goes on
    tensor_parallel = 1                          # optional: T processes per stage (R x N x T), with
    tp_plan = [{ "0" = "colwise", "2" = "rowwise" }, {}]   # one table per stage (pipeq.parallel.tensor)
    sharding = "fsdp"                            # optional, data_parallel >= 2: the replicas shard each
                                                 # stage with torch's FSDP2 (default "none": whole replicas)
    fsdp_reshard = "step"                        # optional: "step" (default) or "microbatch"
    stages_per_process = 1                       # optional: model stages per process (virtual stages:
                                                 # interleaved-1f1b, looped-bfs; zbv, dualpipev hold 2)
    precision = "bf16"                           # optional: "fp32" (default), "bf16", "fp16"
    clip_grad_norm = 1.0                         # optional: clip by the global norm (clip_norm_type = 2.0)
    check_finite = "raise"                       # optional: false (default), "raise" (or true), "skip"
    recompute = true                             # optional: or one boolean per stage
    loss_weighting = "token"                     # optional: microbatch losses by their tokens (default)
                                                 # or "sample" (by their rows)
    [placement]                                  # optional, multi-host: processes per node
    nodes = [[0], [1, 2]]                        # (process r * n_stages + k: replica r's stage k)

Every factory the job names takes keyword arguments from its ``*_args`` table: ``stages_args``,
``loss_args``, ``optimizer_args``, ``lr_scheduler_args``, ``data_args``, ``eval_data_args``,
``aux_heads_args``, ``aux_loss_args`` (plain TOML tables; an argument the factory does not take
is refused, naming both). With ``lr_scheduler_interval = "epoch"``, ``pipeq launch`` steps the
schedulers between two epochs (an epoch is one pass over the iterable ``data(epoch)`` returns,
also when the job counts ``steps``), a ReduceLROnPlateau with its ``lr_scheduler_monitor``.

Every host builds its stages from these names (``Recipe.build``): nothing but plain data crosses
hosts, and every host builds the same weights (the stages and heads functions run under
``torch.manual_seed(seed)``). A stages function returning every stage is called once per host
(:meth:`Recipe.stages_made`: :mod:`~pipeq.launch.job.made`), each stage process handed its own stage
as it starts; ``stages(k, n)`` is called in stage k's process. With Associated
Learning (``schedule = "al"``) the stages function returns ``pipeq.research.ALLayer`` s (e.g. from
``pipeq.research.build_al``) and ``loss`` (optional, MSE by default) is the layers' local criterion.

With ``model`` and ``balance``, stage k is ``pipeq.balance.split(model(), counts)[k]``, the model
built under the job's seed. A measured balance (``"time"``, ``"memory"``) is measured once, in
the launching process (:meth:`Recipe.prepared`): the stage processes receive the counts as plain
data in the recipe, and :meth:`Recipe.describe` shows them.

Its modules: :mod:`~pipeq.launch.job.keys` (every key: type, default, help), :mod:`~pipeq.launch.job.load`
(reading a file), :mod:`~pipeq.launch.job.checks` (what the keys must satisfy),
:mod:`~pipeq.launch.job.schedule`, :mod:`~pipeq.launch.job.names` (resolving ``"pkg.mod:name"``),
:mod:`~pipeq.launch.job.recipe` (:class:`Recipe`) and :mod:`~pipeq.launch.job.spec` (:class:`Job`).
"""


from pipeq.launch.job.keys import KEYS, LENGTH_RULE, Key
from pipeq.launch.job.names import check_args, did_you_mean, resolve
from pipeq.lazy import lazy_getattr

# Imported on first use: the keys (``pipeq launch --help`` shows them) come without torch.
_LAZY: dict[str, tuple[str, str | None]] = {name: (f"{__name__}.{module}", name) for name, module in (
    ("load_job", "load"), ("Recipe", "recipe"), ("parse_schedule", "schedule"), ("Job", "spec"))}

__all__ = ["Job", "Recipe", "load_job", "resolve", "check_args", "parse_schedule", "did_you_mean", "KEYS", "Key",
           "LENGTH_RULE"]


__getattr__ = lazy_getattr(__name__, _LAZY, globals())
