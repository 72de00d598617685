"""Virtual stages: which model stages each process holds, looped or in a V.

A schedule may give each of N processes v model chunks (its :attr:`~pipeq.schedules.SchedulePolicy.stages_per_process`),
so that the model is cut into S = v·N stages. *Looped* placement (Megatron's interleaving,
torch's ``ScheduleInterleaved1F1B``): process p holds stages p, p+N, p+2N, ... as its chunks 0,
1, 2, ... *V* placement (zero-bubble ZBV, DualPipeV; two chunks): process p holds stage p and
stage 2N-1-p, so the last process holds the two middle stages and stage 0 and stage S-1 share
process 0. An action's ``chunk`` names which of its process's stages runs it. Pure: no I/O.
"""

from __future__ import annotations

from pipeq.errors import ScheduleError

__all__ = ["PLACEMENTS", "stage_index", "process_chunk", "stages_of", "n_processes"]

PLACEMENTS = ("loop", "v")


def _check_placement(placement: str) -> None:
    if placement not in PLACEMENTS:
        raise ValueError(f"placement is one of {', '.join(PLACEMENTS)}, got {placement!r}")


def stage_index(process: int, chunk: int, n_processes: int, placement: str = "loop") -> int:
    """The model stage chunk ``chunk`` of process ``process`` (of ``n_processes``) holds."""
    _check_placement(placement)
    if placement == "v":
        if chunk not in (0, 1):
            raise ScheduleError(f"V placement holds two chunks per process, got chunk {chunk}")
        return process if chunk == 0 else 2 * n_processes - 1 - process
    return process + chunk * n_processes


def process_chunk(stage: int, n_processes: int, placement: str = "loop") -> tuple[int, int]:
    """The (process, chunk) that holds model stage ``stage`` (inverse of :func:`stage_index`)."""
    _check_placement(placement)
    if placement == "v":
        if not 0 <= stage < 2 * n_processes:
            raise ScheduleError(f"stage {stage} is out of range 0..{2 * n_processes - 1} for V placement")
        return (stage, 0) if stage < n_processes else (2 * n_processes - 1 - stage, 1)
    return stage % n_processes, stage // n_processes


def stages_of(process: int, n_processes: int, chunks: int, placement: str = "loop") -> list[int]:
    """The model stages process ``process`` holds, by chunk."""
    return [stage_index(process, c, n_processes, placement) for c in range(chunks)]


def n_processes(n_stages: int, chunks: int, placement: str = "loop") -> int:
    """The processes ``n_stages`` model stages take at ``chunks`` per process (ScheduleError
    when they do not divide, or V placement is given other than two chunks)."""
    _check_placement(placement)
    if type(chunks) is not int or chunks < 1:
        raise ScheduleError(f"stages_per_process must be a positive integer, got {chunks!r}")
    if placement == "v" and chunks != 2:
        raise ScheduleError(f"V placement holds two stages per process, got stages_per_process={chunks}")
    if n_stages % chunks:
        raise ScheduleError(f"{n_stages} stages do not divide into processes of {chunks} stages each: give "
                            f"a multiple of {chunks} stages (e.g. {(n_stages // chunks + 1) * chunks})")
    return n_stages // chunks
