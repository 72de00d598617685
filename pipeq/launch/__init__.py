"""``pipeq launch JOB.toml``: train a job file, on one host or several.

On one host (the default) this process is the driver and starts every stage. In a multi-host run
(``--nnodes``/``--node-rank``/``--master-addr``/``--master-port``, or torchrun's / srun's
environment) node 0 is the driver and every other node runs an agent that starts its stages::

    anywhere: pipeq secret --out job.secret          # then copy it to every host (mode 0600)
    host A: pipeq launch job.toml --nnodes 2 --node-rank 0 --master-addr A --secret-file job.secret
    host B: pipeq launch job.toml --nnodes 2 --node-rank 1 --master-addr A --secret-file job.secret

(``PIPEQ_SECRET`` in the environment instead of ``--secret-file``). Node 0 runs the driver and
stage 0, node 1 stages 1 and 2; nothing without the secret can join or redirect the run.

The driver trains for the job's steps or epochs with ``runner.stream`` (the pipeline stays full
across batches; it drains only before an evaluation, a checkpoint and the end), shows progress
(tqdm; ``--quiet`` logs plain lines), checkpoints every ``--checkpoint-every`` steps
(``--resume`` continues from the newest complete one), and writes into the output directory::

    checkpoints/step-00000020/   manifest.json + stage-<k>.pt (global names; loads into any split)
    final/                       the same, for the final state
    model.pt                     the final parameters and buffers, a plain state_dict of the
                                 flat model nn.Sequential(*layers) (global names)
    metrics.jsonl                one JSON line per step: step, epoch, loss, samples_per_s (the
                                 step's own), samples_per_s_avg (over the last 20 steps: what the
                                 progress shows), lr (the learning rate the step trained with), and
                                 eval_loss / eval_accuracy / eval_NAME (the job's metrics) where
                                 evaluated; the first step's line holds every byte each stage
                                 holds (``memory``: runner.memory()'s, also logged as a table);
                                 with ``compile``, the last step's line holds each stage's
                                 compile figures (``compile``: runner.stats()'s)
    compile-cache/               with ``compile``: torch's compile cache, shared by the stage
                                 processes and kept for restarts and later runs

Epochs: messages count them from 1 (the first epoch is epoch 1); metrics.jsonl's ``epoch`` field
and a checkpoint's counts them from 0, as the job's ``data(epoch)`` receives them.

With ``lr_scheduler_interval = "epoch"`` the stream also drains at the end of each epoch that
another follows, and the schedulers step there (``runner.scheduler_step``), before the next
epoch's first batch: a ReduceLROnPlateau with the job's ``lr_scheduler_monitor`` (evaluated then,
or the mean of the epoch's step losses). An epoch is one pass over ``data(epoch)``, also in a job
that counts steps. A checkpoint at an epoch's last step holds the state before that step of the
schedulers; a run resumed from it takes it first (:class:`pipeq.launch.stream.EpochEnd`).

Runs with auxiliary heads (interlocking) or Associated Learning checkpoint and resume like the
others (their heads and layers are part of the state); model.pt holds ``runner.state_dict()``
under the flat-model names (the main path, or the AL layers).

A failing stage ends the command with exit code 1 and that stage's traceback, unless
``max_restarts`` lets the run restart from its newest state (:mod:`pipeq.launch.restarts`).

Its modules: :mod:`~pipeq.launch.cli` (the ``pipeq`` command), :mod:`~pipeq.launch.args` (this
command's arguments), :mod:`~pipeq.launch.command` (what it runs), :mod:`~pipeq.launch.job` (job
files), :mod:`~pipeq.launch.trainer` (the driver), :mod:`~pipeq.launch.loop` (the training loop),
:mod:`~pipeq.launch.stream` (the batches through the pipeline), :mod:`~pipeq.launch.data`,
:mod:`~pipeq.launch.evaluator`, :mod:`~pipeq.launch.checkpoints`, :mod:`~pipeq.launch.snapshots`
(in-memory snapshots across restarts), :mod:`~pipeq.launch.metrics` (metrics.jsonl),
:mod:`~pipeq.launch.tensorboard`, :mod:`~pipeq.launch.progress`, :mod:`~pipeq.launch.rundir` (the
output directory and its lock), :mod:`~pipeq.launch.signals`, :mod:`~pipeq.launch.restarts`
(``--max-restarts``), :mod:`~pipeq.launch.elastic` (restarts of a multi-host run: a lost node
rejoins or its stages are re-placed), :mod:`~pipeq.launch.agent` (the other nodes),
:mod:`~pipeq.launch.csv_schedule` (schedule CSV files) and :mod:`~pipeq.launch.reference` (the
docs site's generated reference pages).
"""

__all__: list[str] = []
