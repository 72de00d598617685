"""The fork server's temporary directory: named after its process, and removed by the next start
once that process is dead (a SIGKILL leaves it behind), never while it lives or another user's."""

from __future__ import annotations

import os

from pipeq.control import forkserver


def _dead_pid() -> int:
    with open("/proc/sys/kernel/pid_max") as f:
        pid = int(f.read()) - 1
    while True:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return pid
        except OSError:
            pass
        pid -= 1


def test_remove_stale_removes_only_the_directories_of_dead_processes(tmp_path):
    dead = _dead_pid()
    made = {name: tmp_path / name for name in (f"pipeq-mp-{dead}-a1b2c3d4", f"pipeq-mp-{os.getpid()}-a1b2c3d4",
                                              f"pipeq-mp-{os.getppid()}-zz", "pymp-a1b2c3d4", f"pipeq-{dead}-x")}
    for path in made.values():
        path.mkdir()
    (made[f"pipeq-mp-{dead}-a1b2c3d4"] / f"listener-{dead}").write_text("")
    (tmp_path / f"pipeq-mp-{dead}-file").write_text("not a directory")
    assert forkserver.remove_stale(str(tmp_path)) == [str(made[f"pipeq-mp-{dead}-a1b2c3d4"])]
    assert sorted(os.listdir(tmp_path)) == sorted([f"pipeq-mp-{os.getpid()}-a1b2c3d4", f"pipeq-mp-{os.getppid()}-zz",
                                                   "pymp-a1b2c3d4", f"pipeq-{dead}-x", f"pipeq-mp-{dead}-file"])

