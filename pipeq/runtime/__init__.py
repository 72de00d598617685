"""The event loop: a stage process serving the driver, the one action interpreter, the simulated engine.

A stage process holds ``v >= 1`` stages, its *chunks* (one, unless the schedule places several per
process: :mod:`pipeq.schedules.placement`); a process of one stage is a process of one chunk, run
by the very same code::

    driver --commands--> loop.EventLoop (every chunk's commands) --a batch--> interpreter.execute
                                  ^                                                |
                                  +------ requests.Recv / Send / Emit / SwapTies --+
                                         carried out with the process's transport
                                         (pipeq.wire.transport), ties with links.swap_ties

The interpreter runs compute actions inline on each chunk's executor, hands a message between two
chunks of the process over in memory and sums their tied weights' gradients in memory; whatever
crosses to another process it yields as a typed request. The simulated engine runs the same
interpreter for every process the schedule plans, answering from an in-memory mailbox.

Its modules:

    worker.py         a stage process's entry: builds its chunks, reports READY, reports errors
    loop.py           EventLoop and Chunk: the driver's commands, served for every chunk
    interpreter.py    ProcessPlan and execute: a process's action list over its chunks' executors
    requests.py       what the interpreter asks for: Recv, Send, Emit, SwapTies
    batch_command.py  what one stage takes of a TRAIN or PREDICT command
    config.py         StageSettings, ChunkConfig, WorkerConfig: what a process is told at start
                      (made from the RunConfig in pipeq.control.processes, nowhere else)
    links.py          PeerLinks (a chunk's replicas and tie peers); swap_ties
    executors.py      make_executor: the executor the schedule asks for
    backend.py        Backend: the protocol simulated.py and pipeq.control.driver implement
    simulated.py      SimulatedBackend: every planned process in this one
    faults.py         PIPEQ_FAULT: failures injected on purpose
    os_process.py     the process in the OS: name, cores, threads, timers, parent
    preload.py        what the fork server imports once
    preload_compile.py  what it imports too for a run that compiles its stages
"""

__all__: list[str] = []  # nothing: its modules are imported by their own names
