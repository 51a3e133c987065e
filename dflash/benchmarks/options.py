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


def run_worker(module: str, variant: str, opts: dict[str, str]) -> dict:
    """`python -m MODULE _worker VARIANT OPTS` in a fresh process (its own peak memory), its last stdout line as
    JSON: the measured side of a side-by-side bench."""
    import json
    import os
    import subprocess
    import sys

    cmd = [sys.executable, "-m", module, "_worker", variant, json.dumps(opts)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=os.environ.copy())
    if proc.returncode != 0:
        raise SystemExit(f"{variant} worker failed (rc {proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])
