"""metrics.jsonl, a run's log of its steps: appended to, trimmed for a resumed run, read back."""

from __future__ import annotations

import json
import os
from typing import Any, TextIO

from pipeq.checkpoint.full import is_no_space, no_space_error

__all__ = ["MetricsLog"]


class MetricsLog:
    """The run's metrics.jsonl: one JSON line per step (step, epoch counted from 0, loss,
    samples_per_s, samples_per_s_avg, lr, and eval_* where evaluated; the launch's first step's
    also ``memory``, ``runner.memory()`` as dicts). Open (``with``) to append lines."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._file: TextIO | None = None

    def trim(self, step: int) -> None:
        """Keep the metrics of steps up to ``step`` (a resumed run rewrites the later ones), and
        every restart record, whatever its step: each restart stays on record."""
        path = self.path
        if not os.path.exists(path):
            return
        lines = [json.dumps(d) + "\n" for d in self._lines() if _kept(d, step)]
        if not lines:
            os.remove(path)
            return
        with open(path + ".tmp", "w") as f:
            f.writelines(lines)
        os.replace(path + ".tmp", path)

    def _lines(self) -> list[dict[str, Any]]:
        """The file's lines, read; a line cut short (a full disk, a kill mid-write) is left out."""
        out = []
        with open(self.path) as f:
            for ln in f:
                try:
                    out.append(json.loads(ln))
                except ValueError:  # blank, or half written
                    continue
        return out

    def losses(self, epoch: int) -> list[float]:
        """The step losses of ``epoch`` in the file (a resumed run's, trimmed to its step)."""
        if not os.path.exists(self.path):
            return []
        return [float(ln["loss"]) for ln in self._lines() if ln.get("epoch") == epoch and "loss" in ln]

    def __enter__(self) -> "MetricsLog":
        self._file = open(self.path, "a")
        return self

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        f, self._file = self._file, None
        if f is None:
            return
        try:
            f.close()  # (flushes what a failed write left buffered: on a full disk, fails again)
        except OSError as err:
            if exc_type is not None:  # the error on its way out says it
                return
            if is_no_space(err):
                raise self._full(err, "the metrics") from err
            raise

    def write(self, line: dict[str, Any]) -> None:
        """Append one step's line (the log is open), at once on disk. A full disk raises a
        :class:`~pipeq.checkpoint.NoSpaceError` naming the file (a line it cut short is skipped
        when the file is read: :meth:`trim`)."""
        if self._file is None:
            raise ValueError(f"{self.path} is not open: write its lines inside `with MetricsLog(...)`")
        try:
            self._file.write(json.dumps(line) + "\n")
            self._file.flush()
        except OSError as exc:
            if is_no_space(exc):
                raise self._full(exc, f"step {line.get('step')}'s metrics") from exc
            raise

    def _full(self, exc: OSError, what: str) -> Exception:
        """The NoSpaceError of a write of ``what`` that found the disk full: the file, what is intact."""
        return no_space_error(self.path, what, exc, "the lines written before are intact", "Free some space")


def _kept(line: dict[str, Any], step: int) -> bool:
    """Whether a trim to ``step`` keeps ``line``: a restart record, or a line of a step up to it."""
    return "restart" in line or line.get("step", 0) <= step
