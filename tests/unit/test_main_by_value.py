"""A main module with no file (a notebook, ``python -``, ``python -c``): what it defines reaches the
stage processes by value, multiprocessing is not told to run ``<stdin>`` again, and what would
travel by name is refused saying what to do. (The runs themselves: tests/smoke/test_interactive_main.py.)"""

from __future__ import annotations

import pickle
import sys
import types
from multiprocessing import spawn

import pytest

from pipeq.control import main_guard
from pipeq.errors import MainScriptError


def _fake_main(monkeypatch, **attrs) -> types.ModuleType:
    """A ``__main__`` like a notebook kernel's (no file, no spec), holding a class ``Cell``."""
    main = types.ModuleType("__main__")
    main.__dict__.update(attrs)
    exec("class Cell:\n    def __init__(self):\n        self.x = 3\n", main.__dict__)
    monkeypatch.setitem(sys.modules, "__main__", main)
    return main


def test_which_mains_have_no_file(monkeypatch, tmp_path):
    _fake_main(monkeypatch)
    assert main_guard.main_without_file()  # a notebook, python -c
    _fake_main(monkeypatch, __file__="<stdin>")
    assert main_guard.main_without_file()  # python -
    script = tmp_path / "train.py"
    script.write_text("")
    _fake_main(monkeypatch, __file__=str(script))
    assert not main_guard.main_without_file()
    _fake_main(monkeypatch, __spec__=types.SimpleNamespace(name="pkg.train"))
    assert not main_guard.main_without_file()  # python -m: imported by name


def test_what_main_defines_travels_by_value(monkeypatch):
    main = _fake_main(monkeypatch)
    obj = main.Cell()
    data = main_guard.stage_pickle(obj)
    plain = pickle.dumps(obj)
    del main.Cell  # as in a stage process: __main__ there has no Cell
    with pytest.raises(AttributeError):
        pickle.loads(plain)
    assert pickle.loads(data).x == 3
    exec("loss = lambda out, y: out.sum()", main.__dict__)
    main_guard.check_picklable("loss_fn", main.loss, by_value=True)  # lambdas too


def test_only_what_main_defines_travels_by_value(monkeypatch):
    """A module's lambda is refused as when __main__ has a file (the stage could not import it)."""
    _fake_main(monkeypatch)
    with pytest.raises(ValueError, match="optimizer cannot be pickled to start its stage process"):
        main_guard.check_picklable("optimizer", lambda params: None, by_value=True)


def test_what_travels_by_name_is_refused_saying_what_to_do(monkeypatch):
    main = _fake_main(monkeypatch)
    with pytest.raises(MainScriptError, match=r"schedule: Cell is defined in __main__, which has no file here "
                       r".*Define Cell in a module of its own and import it, or use mode='simulated'"):
        main_guard.check_picklable("schedule", main.Cell())


def test_stages_are_not_told_to_run_stdin_again(monkeypatch, tmp_path):
    """spawn and the fork server prepare a stage's ``__main__`` from this preparation data."""
    main = _fake_main(monkeypatch, __file__="<stdin>")
    assert "init_main_from_path" in spawn.get_preparation_data("stage")
    with main_guard.starting_stages():
        assert "init_main_from_path" not in spawn.get_preparation_data("stage")
    assert main.__file__ == "<stdin>"
    script = tmp_path / "train.py"
    script.write_text("")
    main = _fake_main(monkeypatch, __file__=str(script))
    with main_guard.starting_stages():  # a script with a file: run again, as always
        assert spawn.get_preparation_data("stage")["init_main_from_path"] == str(script)
