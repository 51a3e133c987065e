"""The original pipeline's W&B flags, accepted by launch.py as aliases of the Hydra keys that do the same:

    --wandb-project NAME     logging.wandb.project=NAME
    --wandb-run-name NAME    logging.wandb.name=NAME
    --no-wandb               logging.wandb.mode=disabled (JSONL and console only)

`--flag=value` and `--flag value` both work. The flags become Hydra overrides in argv before Hydra parses it
(on every torchrun rank alike), so the resolved config, `.hydra/overrides.yaml` and run.json show the key that
took effect. A NAME is taken literally, as argparse took it: it is quoted for Hydra where Hydra would read it
otherwise (`a,b` would be a sweep, `123` a number); a `${...}` in it is resolved, as in the key. A flag and
an override of its key with another value (or a W&B-on override beside `--no-wandb`) are refused, naming both.
"""

from __future__ import annotations

import re

NAME_FLAGS = {"--wandb-project": "logging.wandb.project", "--wandb-run-name": "logging.wandb.name"}
NO_WANDB = "--no-wandb"
NO_WANDB_KEY, NO_WANDB_VALUE = "logging.wandb.mode", "disabled"
# `logging=jsonl` is the other way to turn W&B off; any other `logging` option turns it on
WANDB_OFF_LOGGING = "jsonl"


class FlagError(ValueError):
    """A W&B flag without its value, or one that contradicts another flag or an override; the message says which."""


def _quoted(value: str) -> str:
    """`value` as a single-quoted Hydra string: a quote escaped, and backslashes that precede one (or the end)."""
    body = re.sub(r"(\\*)('|$)", lambda m: m.group(1) * 2 + ("\\'" if m.group(2) else ""), value)
    return f"'{body}'"


def _parse(arg: str):
    """The Hydra override `arg` parses to, or None for an argument Hydra will report itself."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        return OverridesParser.create().parse_override(arg)
    except Exception:  # noqa: BLE001 - not ours to report: Hydra names a malformed override after us
        return None


def name_override(key: str, name: str) -> str:
    """`key=name` as Hydra reads it back to the string `name`: unquoted where that is so, else quoted."""
    for candidate in (f"{key}={name}", f"{key}={_quoted(name)}"):
        o = _parse(candidate)
        if o is not None and not o.is_sweep_override() and o.value() == name:
            return candidate
    raise FlagError(f"cannot pass {name!r} to Hydra as {key}; set {key}=... with Hydra's quoting instead")


def _flag_values(argv: list[str]) -> tuple[list[str], list[tuple[str, str | None]]]:
    """argv without the W&B flags, and the flags found, in order, as (flag, value; None for --no-wandb)."""
    rest, found = [argv[0]], []
    i = 1
    while i < len(argv):
        arg = argv[i]
        flag, eq, value = arg.partition("=")
        if flag == NO_WANDB:
            if eq:
                raise FlagError(f"{NO_WANDB} takes no value (got {arg}); drop '={value}'")
            found.append((flag, None))
        elif flag in NAME_FLAGS:
            if not eq:  # `--flag value`; like argparse, a next argument that starts with '-' is not a value
                if i + 1 >= len(argv) or argv[i + 1].startswith("-"):
                    raise FlagError(f"{flag} needs a value: {flag} NAME")
                i += 1
                value = argv[i]
            if not value:
                raise FlagError(f"{flag} needs a non-empty value: {flag} NAME")
            found.append((flag, value))
        else:
            rest.append(arg)
        i += 1
    return rest, found


def _wanted(found: list[tuple[str, str | None]]) -> dict[str, tuple[str, str]]:
    """{key: (value, the flag as typed)} of the flags; the same flag twice with two values is refused."""
    wanted: dict[str, tuple[str, str]] = {}
    for flag, value in found:
        shown = flag if value is None else f"{flag} {value}"
        key, value = (NO_WANDB_KEY, NO_WANDB_VALUE) if value is None else (NAME_FLAGS[flag], value)
        if key in wanted and wanted[key][0] != value:
            raise FlagError(f"{wanted[key][1]} contradicts {shown}: give one of them")
        wanted[key] = (value, shown)
    return wanted


def _contradiction(arg: str, wanted: dict[str, tuple[str, str]]) -> tuple[str, str | None] | None:
    """(the flag as typed, the override's key if it says the same) for an override `arg` of a flag's key, else
    None. The key is None when the override contradicts the flag."""
    if arg.startswith("-") or not ("=" in arg or arg.startswith("~")):
        return None
    o = _parse(arg)
    if o is None:
        return None
    key = o.key_or_group
    same = not o.is_sweep_override() and not o.is_delete()
    if key == "logging" and NO_WANDB_KEY in wanted:  # a group choice: only jsonl keeps W&B off
        return wanted[NO_WANDB_KEY][1], (key if same and o.value() == WANDB_OFF_LOGGING else None)
    if key in wanted:
        return wanted[key][1], (key if same and str(o.value()) == wanted[key][0] else None)
    return None


def translate_wandb_flags(argv: list[str]) -> list[str]:
    """argv with the W&B flags replaced by the Hydra overrides they stand for. The overrides go just before the
    command line's first override (else right after the program), so Hydra's parser sees one run of overrides
    wherever the flags were (`--no-wandb -m a=1,2` -> `-m logging.wandb.mode=disabled a=1,2`). An override of a
    flag's key with the same value makes the flag's override unnecessary; with another value it is refused."""
    rest, found = _flag_values(argv)
    if not found:
        return list(argv)
    wanted = _wanted(found)
    covered = set()
    for arg in rest[1:]:
        hit = _contradiction(arg, wanted)
        if hit is None:
            continue
        shown, same_key = hit
        if same_key is None:
            raise FlagError(f"{shown} contradicts the override {arg}: give one of them")
        covered.add(NO_WANDB_KEY if same_key == "logging" else same_key)
    overrides = [
        f"{NO_WANDB_KEY}={NO_WANDB_VALUE}" if key == NO_WANDB_KEY else name_override(key, value)
        for key, (value, _) in wanted.items()
        if key not in covered
    ]
    first = next((i for i, a in enumerate(rest) if i and not a.startswith("-") and ("=" in a or a[:1] == "~")), None)
    at = 1 if first is None else first
    return [*rest[:at], *overrides, *rest[at:]]
