"""The checks a job file's keys pass before a Job is made of them: each failure names the key and the fix."""

from __future__ import annotations

from typing import Any, Mapping

from pipeq import balance as balancing
from pipeq.launch.job.keys import FACTORY_ARGS, KEYS, LENGTH_RULE
from pipeq.launch.job.names import did_you_mean
from pipeq.launch.job.schedule import check_schedule_keys, policy_of

__all__ = ["check_length", "check_types", "check_keys", "placement_nodes"]


def check_length(path: str, raw: Mapping[str, Any], given: Mapping[str, Any]) -> None:
    """The job's length: ``steps`` or ``epochs``, one of them (see :data:`LENGTH_RULE`); a flag
    replaces both of the file's keys, so only a file read as it is must not set both."""
    if "steps" in given and "epochs" in given:
        raise ValueError(f"--steps {given['steps']} and --epochs {given['epochs']}: give one of them "
                         f"({LENGTH_RULE})")
    if "steps" in raw and "epochs" in raw and not ("steps" in given or "epochs" in given):
        raise ValueError(f"job file {path}: sets both steps = {raw['steps']!r} and epochs = {raw['epochs']!r}; "
                         f"keep one of them ({LENGTH_RULE})")


def check_types(path: str, raw: Mapping[str, Any]) -> None:
    """Every key is one of :data:`KEYS`, of its type (a boolean is no number)."""
    unknown = sorted(set(raw) - set(KEYS))
    if unknown:
        raise ValueError(f"job file {path}: unknown key(s) {unknown}; {did_you_mean(unknown, KEYS, 'known keys')}")
    for name, key in KEYS.items():
        value = raw.get(name)
        if name in raw and (not isinstance(value, key.types) or isinstance(value, bool) and bool not in key.types):
            raise ValueError(f"job file {path}: {name} must be {key.type_text()}, got {value!r}")


def check_keys(path: str, raw: Mapping[str, Any]) -> None:
    """What the keys say together (their types checked, the schedule parsed): the stages'
    model and balance, what the schedule needs, the factories' arguments, the tensor-parallel
    plan, the counts' least values, and the job's length."""
    _check_model_keys(path, raw)
    check_schedule_keys(path, raw)
    _check_factory_keys(path, raw)
    _check_tp_plan(path, raw)
    _check_counts(path, raw)
    if "rejoin_timeout" in raw and not raw["rejoin_timeout"] > 0:
        raise ValueError(f"job file {path}: rejoin_timeout must be more than 0 seconds, got {raw['rejoin_timeout']}")
    if "steps" not in raw and "epochs" not in raw:
        raise ValueError(f"job file {path}: set steps or epochs (or pass --steps / --epochs)")


def placement_nodes(path: str, placement: Mapping[str, Any] | None) -> list[list[int]] | None:
    """The processes per node of a ``[placement]`` table (None without one)."""
    if placement is None:
        return None
    nodes = placement.get("nodes")
    if not isinstance(nodes, list) or not all(
        isinstance(n, list) and all(type(k) is int for k in n) for n in nodes
    ):
        raise ValueError(f"job file {path}: [placement] nodes must be a list of lists of stage indices")
    return nodes


def _check_counts(path: str, raw: Mapping[str, Any]) -> None:
    """The integer keys with a least value (:attr:`Key.minimum`) are at least that."""
    for name, key in KEYS.items():
        if key.minimum is not None and name in raw and raw[name] < key.minimum:
            least = f"at least {key.minimum}" if key.minimum else "0 or more"
            raise ValueError(f"job file {path}: {name} must be {least}, got {raw[name]}")


def _check_tp_plan(path: str, raw: Mapping[str, Any]) -> None:
    """``tp_plan``: an array of one table per stage, submodule names to "colwise" / "rowwise"."""
    plan = raw.get("tp_plan")
    if plan is None:
        return
    for k, stage in enumerate(plan):
        if not isinstance(stage, dict) or not all(isinstance(v, str) for v in stage.values()):
            raise ValueError(f"job file {path}: tp_plan[{k}] must be a table of submodule names to "
                             f"\"colwise\" or \"rowwise\" (e.g. {{ \"0\" = \"colwise\", \"2\" = \"rowwise\" }}), "
                             f"got {stage!r}")


def _check_factory_keys(path: str, raw: Mapping[str, Any]) -> None:
    """The keys that go with a factory key: its ``*_args`` (plain data), the scheduler's interval
    and monitor, the evaluation's metrics; each refused without what it belongs to."""
    for args_key, key in FACTORY_ARGS.items():
        if args_key in raw:
            if key not in raw:
                raise ValueError(f"job file {path}: {args_key} is given, but {key} is not: {args_key} are the "
                                 f"keyword arguments of the factory {key} names; set {key} or drop {args_key}")
            _check_plain(raw[args_key], args_key)
    for key in ("lr_scheduler_interval", "lr_scheduler_monitor"):
        if key in raw and "lr_scheduler" not in raw:
            raise ValueError(f"job file {path}: {key} is given, but there is no lr_scheduler to step; set "
                             f"lr_scheduler or drop {key}")
    from pipeq.stage.lr_schedulers import INTERVALS

    interval = raw.get("lr_scheduler_interval")
    if interval is not None and interval not in INTERVALS:
        raise ValueError(f"job file {path}: lr_scheduler_interval = {interval!r}; use \"step\" (the stages step "
                         'the scheduler after every optimizer step) or "epoch" (pipeq launch steps it after each '
                         "pass over the data)")
    metrics = raw.get("metrics", {})
    for name, spec in metrics.items():
        if not isinstance(spec, str) or spec.count(":") != 1:
            raise ValueError(f"job file {path}: metrics.{name} = {spec!r}: expected 'package.module:name' of a "
                             "function (output, target) -> float, e.g. metrics = { top3 = \"mymod:top3\" }")
    if metrics and "eval_data" not in raw:
        raise ValueError(f"job file {path}: metrics are computed on the evaluation data, but eval_data is not "
                         "set; set eval_data or drop metrics")
    monitor = raw.get("lr_scheduler_monitor")
    if monitor is not None:
        if interval != "epoch":
            raise ValueError(f"job file {path}: lr_scheduler_monitor = {monitor!r} feeds a ReduceLROnPlateau at "
                             'the end of each epoch: set lr_scheduler_interval = "epoch"')
        evals = ["eval_loss", "eval_accuracy"] + [f"eval_{name}" for name in metrics]
        known = ["train_loss"] + (evals if "eval_data" in raw else [])
        if monitor not in known:
            hint = ("; the eval_* values need eval_data" if monitor.startswith("eval_") and "eval_data" not in raw
                    else "")
            raise ValueError(f"job file {path}: lr_scheduler_monitor = {monitor!r} is not a value the run "
                             f"measures{hint}; {did_you_mean([monitor], known, 'choose one of')}")


def _check_plain(value: Any, where: str) -> None:
    """A TOML value that is plain data (strings, numbers, booleans, arrays, tables): what a
    recipe may carry to other hosts. TOML's dates and times are refused."""
    if isinstance(value, dict):
        for k, v in value.items():
            _check_plain(v, f"{where}.{k}")
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _check_plain(v, f"{where}[{i}]")
    elif not isinstance(value, (str, int, float, bool)):
        raise ValueError(f"{where} = {value!r}: a factory's arguments are strings, numbers, booleans, arrays "
                         f"and tables, not a {type(value).__name__}")


def _check_model_keys(path: str, raw: Mapping[str, Any]) -> None:
    """``model`` + ``balance`` (counts; or ``"time"`` / ``"memory"`` with ``balance_sample`` and
    ``n_stages``) instead of ``stages``."""
    if "model" in raw and "stages" in raw:
        raise ValueError(f"job file {path}: stages and model both name the stages: keep one (stages = 'pkg.mod:fn' "
                         "returns the stages; model = 'pkg.mod:fn' returns an nn.Sequential that balance splits)")
    for key in ("balance", "balance_sample"):
        if key in raw and "model" not in raw:
            raise ValueError(f"job file {path}: {key} splits the nn.Sequential that model names: set "
                             "model = 'pkg.mod:fn' (a function returning it) instead of stages")
    if "model" not in raw:
        if "split_modules" in raw:
            raise ValueError(f"job file {path}: split_modules splits the model that model names: set model = "
                             "'pkg.mod:fn' (a function returning it) instead of stages")
        return
    policy_of(raw["schedule"]).check_job(path, raw)  # e.g. AL refuses model + balance
    if "split_modules" in raw:
        mods = raw["split_modules"]
        if "balance" in raw:
            raise ValueError(f"job file {path}: split_modules names each stage's modules; drop balance")
        if not mods or not all(isinstance(s, list) and s and all(type(n) is str for n in s) for s in mods):
            raise ValueError(f"job file {path}: split_modules must be an array of arrays of module names, one per "
                             'stage: split_modules = [["tok_emb", "blocks.0"], ["blocks.1", "norm", "lm_head"]]')
        return
    balance = raw.get("balance")
    if balance is None:
        raise ValueError(f"job file {path}: model needs balance: layer counts per stage (balance = [3, 2, 1]), or "
                         'balance = "time" or "memory" with balance_sample and n_stages (measured when the run starts)')
    if isinstance(balance, str):
        _check_measured_balance(path, raw, balance)
        return
    if not balance or not all(type(c) is int and c >= 1 for c in balance):
        raise ValueError(f"job file {path}: balance must be an array of layer counts per stage, each at least 1 "
                         f"(or \"time\" / \"memory\"), got {balance!r}")
    if "balance_sample" in raw:
        raise ValueError(f"job file {path}: balance_sample is read only to measure (balance = \"time\" or "
                         "\"memory\"); balance gives the counts already: remove balance_sample")
    if "n_stages" in raw and raw["n_stages"] != len(balance):
        raise ValueError(f"job file {path}: n_stages = {raw['n_stages']}, but balance = {balance} makes "
                         f"{len(balance)} stages; drop n_stages or make them agree")


def _check_measured_balance(path: str, raw: Mapping[str, Any], by: str) -> None:
    if by not in balancing.BY:
        raise ValueError(f"job file {path}: balance = {by!r}; {did_you_mean([by], balancing.BY, 'choose one of')}, "
                         "or give layer counts per stage (balance = [3, 2, 1])")
    missing = [k for k in ("balance_sample", "n_stages") if k not in raw]
    if missing:
        raise ValueError(f"job file {path}: balance = {by!r} measures the layers on a sample when the run starts: "
                         f"set {' and '.join(missing)} (balance_sample = 'pkg.mod:fn' returns the model's input, "
                         "n_stages the number of stages)")
