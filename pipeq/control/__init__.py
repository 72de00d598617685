"""The control plane: the runner users embed, its settings and checks, and process mode's driver.

The runner (:class:`pipeq.PipelineRunner`) is a facade over collaborators with one job each; the
stages run on a :class:`~pipeq.runtime.backend.Backend`: the driver here (``mode="process"``) or
the simulated engine (:mod:`pipeq.runtime.simulated`). Its modules:

    runner.py           PipelineRunner, the embedding API
    lifecycle.py        built, running, closed: started once, stopped once
    pipeline.py         the runner's backend: built (at the first batch with schedule="auto"), started, closed
    feed.py             batches as the backend takes them: checked, split, routed, numbered
    dict_batch.py       a dict batch matched to stage 0's inputs and the stages' (or refused)
    streaming.py        the steps in flight, their losses handed back in order
    state.py            state dicts, checkpoints and snapshots under the flat model's names
    snapshots.py        in-memory snapshots every K steps, kept by the driver
    reports.py          what the stages report: stats, learning rates, runner.memory()'s StageMemory
    shape_check.py      FirstBatchCheck: the shapes between stages, before the first batch
    assembly.py         BackendPlan: the configuration and the backend (after schedule="auto")
    exclusive.py        one thread at a time in a runner
    config.py           RunConfig: every setting, built and checked once
    checks.py           the model's checks; main_guard.py: the main script a stage process sees
    batching.py         microbatch sizes and loss weights; stage_inputs.py: inputs beside x
    ties.py             the runner's ties=: declared, copies made equal, other sharing refused
    evaluation.py       runner.evaluate and its metrics
    auto_schedule.py    schedule="auto": profile, then the schedule the costs favour
    memory_limit.py     auto_memory_limit: bytes or a fraction of the device, per stage process

process mode:

    driver.py           ProcessBackend: commands and replies
    startup.py          StageProcesses: start, READY, PEERS; stop and teardown
    processes.py        RunSetup (what a stage process is told, from the RunConfig: the one
                        place), worker_configs, place_leads, start_workers
    stage_handle.py     a stage process watched and stopped by its pid
    forkserver.py       the fork server stage processes are forked from
    supervisor.py       every wait watched: errors, deaths, silence, stuck actions
    waiting.py          wait_until and every grace period the driver waits with, with its reason
    replica_loss.py     fault_tolerance="replicas": a failed replica dropped and rebuilt
    degraded.py         fault_tolerance="replicas": which steps a lost replica degraded, and where
    rendezvous.py       multi-host: node 0, the store, which stages run where
    trace_collector.py  a traced run on the driver's side
"""

__all__: list[str] = []  # nothing: its modules are imported by their own names
