"""`key=value` options of a benchmark, checked against its defaults."""

from __future__ import annotations


def parse_opts(args: list[str], defaults: dict[str, str]) -> dict[str, str]:
    opts = dict(defaults)
    for arg in args:
        key, sep, value = arg.partition("=")
        if not sep or key not in defaults:
            raise SystemExit(f"bad option {arg!r}: expected key=value with key in {', '.join(defaults)}")
        opts[key] = value
    return opts
