"""Overrides that do nothing: a key the chosen loss, schedule, pipeline, optimizer, drafter family or W&B sink does
not read (`read_keys.READ_ONLY_BY`), or one another key turns off (`read_keys.UNREAD_WHILE`: DSpark's markov_head_type
under markov_rank=0). launch.py's W&B flags are such overrides too (`--wandb-project P` is
`logging.wandb.project=P`), and are named in the message: under logging=jsonl they name no W&B run.

A run warns once about each such key set on its command line (`warn_unused_overrides`, rank 0, against the config
the job runs with: a resume's saved one). A multirun whose swept key no job reads is refused before its first
job (`SweepEffects`, a Hydra callback: conf/config.yaml): `-m loss.kl_temperature=1,2,4` on the default dpace loss
(kl_weight 0) would run three identical jobs. Each job's options are composed as the sweeper will compose them
(the sweep's values of the overrides that choose an option: groups, `loss.name`, `experiment`, ...), so
`-m loss=kl_streak loss.streak_alpha=0,0.5` passes; a swept key some jobs read and others do not warns, naming
the jobs that repeat each other. A W&B key set (not swept) for a multirun none of whose jobs logs to W&B is refused
too; one that some jobs do not read warns.
"""

from __future__ import annotations

import itertools
import logging
import os
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from dflash.core.cli_flags import NAME_FLAGS
from dflash.core.read_keys import OPTION_KEYS, READ_ONLY_BY, UNREAD_WHERE, UNREAD_WHILE

log = logging.getLogger(__name__)

_MAX_COMPOSED = 64  # option combinations composed to check a sweep; past it the sweep goes unchecked
_CHOOSERS = ("experiment", *OPTION_KEYS)  # groups whose choice sets a loss, schedule or pipeline option


def _group(key: str) -> str:
    return key.split(".", 1)[0]


def _option(cfg, key: str) -> Any:
    return OmegaConf.select(cfg, OPTION_KEYS[_group(key)])


def _label(group: str) -> str:
    """How a message names a group's option: `loss=dpace` where the group's choice is its option, the key itself
    where a value inside the group decides (`logging.wandb.mode=disabled`)."""
    key = OPTION_KEYS[group]
    return group if key.count(".") == 1 else key


def _value(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else f"{value:g}" if isinstance(value, float) else str(value)


def _turned_on(other: str, off: Any) -> str:
    """What turns a switch on: `loss.kl_weight > 0`, `drafter.confidence_head=true`."""
    return f"{other}={_value(not off)}" if isinstance(off, bool) else f"{other} > {_value(off)}"


# the fix, where the option is chosen by another key than the one the message names
_TURN_ON = {"logging": ": logging=wandb turns W&B on"}


def why_unread(cfg, key: str, switch: bool = True) -> str | None:
    """Why `cfg`'s job does not read `key` (None: it does): its option, or (`switch`) the key that turns it off."""
    if key in UNREAD_WHERE:  # unread only where several keys are at their values together
        where, why = UNREAD_WHERE[key]
        return why if switch and all(OmegaConf.select(cfg, k) == v for k, v in where.items()) else None
    label, option, readers = _label(_group(key)), _option(cfg, key), READ_ONLY_BY[key]
    if option not in readers:
        also = f" with {_turned_on(*UNREAD_WHILE[key])}" if key in UNREAD_WHILE else ""
        hint = _TURN_ON.get(_group(key), "")
        return f"{label}={option} does not read it (only {' or '.join(f'{label}={r}' for r in readers)}{also}{hint})"
    if switch and key in UNREAD_WHILE:
        other, off = UNREAD_WHILE[key]
        if OmegaConf.select(cfg, other) == off:
            return f"{other}={_value(off)} turns it off ({label}={option}; set {_turned_on(other, off)})"
    return None


def _key_and_value(override: str) -> tuple[str, str] | None:
    key, sep, value = str(override).partition("=")
    key = key.lstrip("+")
    return (key, value) if sep and not key.startswith("~") else None


def _flag(key: str) -> str:
    """` (--wandb-project)` for a key one of launch.py's W&B flags sets (the override it became), else ``."""
    flags = [flag for flag, flag_key in NAME_FLAGS.items() if flag_key == key]
    return f" ({flags[0]})" if flags else ""


def unused_overrides(cfg, overrides) -> list[str]:
    """One line per override of `overrides` (`key=value`, as typed or as a W&B flag became one) whose key `cfg`'s
    job does not read."""
    found = []
    for override in overrides:
        key_value = _key_and_value(override)
        if key_value and _watched(key_value[0]) and (why := why_unread(cfg, key_value[0])):
            found.append(f"{key_value[0]}={key_value[1]}{_flag(key_value[0])} has no effect: {why}")
    return found


def warn_unused_overrides(cfg, overrides) -> None:
    for line in unused_overrides(cfg, overrides):
        log.warning(line)


# ----------------------------------------------------------------------------------------------- a sweep's keys


def _sweep_overrides(config: DictConfig) -> dict[str, Any]:
    """The multirun's overrides by key, as its sweeper reads them: hydra.sweeper.params, then the command line's."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    params = OmegaConf.select(config, "hydra.sweeper.params", default=None) or {}
    texts = [f"{k}={v}" for k, v in params.items()] + [str(o) for o in config.hydra.overrides.task]
    found = {}
    for text in texts:
        try:  # one at a time: a redacted secret does not parse, and names no key of the table
            (override,) = parser.parse_overrides([text])
        except Exception:  # noqa: BLE001
            continue
        found[override.key_or_group] = override
    return found


def _watched(key: str) -> bool:
    return key in READ_ONLY_BY or key in UNREAD_WHERE


def _switches(key: str) -> set[str]:
    """The keys that turn `key` off (UNREAD_WHILE's, UNREAD_WHERE's), beside its group's option."""
    return {UNREAD_WHILE[key][0]} if key in UNREAD_WHILE else set(UNREAD_WHERE.get(key, ({},))[0])


def _chooses_options(key: str) -> bool:
    return (
        key in _CHOOSERS
        or key in OPTION_KEYS.values()
        or any(key in _switches(k) for k in (*UNREAD_WHILE, *UNREAD_WHERE))
    )


def _combinations(config: DictConfig, overrides: dict) -> list[tuple[dict, DictConfig]] | None:
    """(the swept choosers' values, the job config they compose to) for each combination of the values that the
    sweep gives the overrides choosing an option; None when they cannot be listed or composed."""
    from hydra import compose

    fixed = [o.input_line for o in overrides.values() if not o.is_sweep_override()]
    swept = {}
    for key, o in overrides.items():
        if o.is_sweep_override() and _chooses_options(key) and o.is_discrete_sweep():
            try:
                swept[o.get_key_element()] = list(o.sweep_string_iterator())
            except Exception:  # noqa: BLE001 - glob(...) needs Hydra's config loader: the sweep goes unchecked
                return None
    combos = list(itertools.product(*swept.values()))
    if len(combos) > _MAX_COMPOSED:
        return None
    name = OmegaConf.select(config, "hydra.job.config_name", default="config")
    out = []
    for values in combos:
        chosen = dict(zip(swept, values))
        try:
            job = compose(config_name=name, overrides=[*fixed, *(f"{k}={v}" for k, v in chosen.items())])
        except Exception as e:  # noqa: BLE001 - the jobs themselves will say what is wrong
            log.debug("sweep check skipped: composing %s failed: %s", chosen, e)
            return None
        out.append((chosen, job))
    return out


def sweep_problems(config: DictConfig) -> tuple[list[str], list[str]]:
    """(refusals, warnings) for the multirun `config` is of: a swept key no job reads, one some jobs do not."""
    overrides = _sweep_overrides(config)
    # swept keys, and a sink's keys set for every job (--wandb-project P under logging=jsonl names no W&B run)
    watched = [k for k, o in overrides.items() if _watched(k) and (o.is_sweep_override() or _sink(k))]
    if not watched:
        return [], []
    combos = _combinations(config, overrides)
    if not combos:
        return [], []
    continuous = {k for k, o in overrides.items() if o.is_sweep_override() and not o.is_discrete_sweep()}
    refusals, warnings = [], []
    for key in watched:
        # a switch swept over an interval (loss.kl_weight=interval(0,1)) turns the key on in some jobs
        switch = not _switches(key) & continuous
        whys = [why_unread(c, key, switch) for _, c in combos]
        shown = overrides[key].input_line.split("=", 1)[1]
        if not overrides[key].is_sweep_override():
            set_ = f"{key}={shown}{_flag(key)} is set but"
            if all(whys):
                refusals.append(f"{set_} no job reads it: {whys[0]}")
            elif any(whys):
                warnings.append(
                    f"{set_} the jobs with {_jobs(combos, whys)} do not read it ({next(w for w in whys if w)})"
                )
        elif all(whys):
            refusals.append(f"{key} is swept ({shown}) but no job reads it: {whys[0]}")
        elif any(whys):
            warnings.append(
                f"{key} is swept ({shown}) but the jobs with {_jobs(combos, whys)} do not read it: those jobs repeat "
                f"each other over its values ({next(w for w in whys if w)})"
            )
    return refusals, warnings


def _sink(key: str) -> bool:
    return _group(key) == "logging"


def _jobs(combos: list, whys: list) -> str:
    return " / ".join(sorted({_describe(chosen) for (chosen, _), why in zip(combos, whys) if why}))


def _describe(chosen: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in chosen.items()) or "the sweep's options"


class SweepEffects(Callback):
    """Hydra callback: a multirun refuses a swept key that no job reads, before its first job (Hydra turns a
    callback's exception into a warning: the refusal exits), and warns about one that some jobs do not read."""

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        refusals, warnings = sweep_problems(config)
        if refusals:
            raise SystemExit(
                "error: " + "; ".join(refusals) + ". Such a key changes no job (swept: every value runs the same "
                "job): set it with an option that reads it, or leave it out of the sweep"
            )
        if os.environ.get("RANK", "0") == "0":  # torchrun: every rank runs the multirun; one says it
            for line in warnings:
                log.warning(line)
