"""The oldest transformers that reads what the project writes for others (dflash/model/older_readers.py's
OLDEST_TRANSFORMERS, z-lab's pin; the README's support matrix), in a venv of its own: the faithful check is that
version's own code, which sees what a list of accepted keys would not (a RoPE base it silently defaults). The venv
is built once and cached under outputs/.cache/test-venvs (or $DFLASH_TEST_VENVS): transformers from the package
index, the torch this project runs (pip takes it from the local wheels, as `make setup` does), safetensors. About
30 s the first time with pip's cache, then only the reader's start (a few seconds).
"""

from __future__ import annotations

import fcntl
import functools
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dflash.model.older_readers import OLDEST_TRANSFORMERS

REPO = Path(__file__).resolve().parent.parent
READER = Path(__file__).with_name("old_transformers_reader.py")


def _requirements() -> list[str]:
    torch = importlib.metadata.version("torch").split("+")[0]  # 2.13.0+cpu -> torch==2.13.0, the local wheel
    return [f"transformers=={OLDEST_TRANSFORMERS}", f"torch=={torch}", "safetensors"]


@functools.cache
def old_python() -> Path:
    """The venv's python, built on first use (a lock: one build when several sessions start at once)."""
    root = Path(os.environ.get("DFLASH_TEST_VENVS", REPO / "outputs/.cache/test-venvs"))
    venv = root / f"transformers-{OLDEST_TRANSFORMERS}"
    python, stamp = venv / "bin" / "python", venv / ".installed"
    wanted = " ".join(_requirements())
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f".{venv.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if stamp.is_file() and stamp.read_text() == wanted:
            return python
        shutil.rmtree(venv, ignore_errors=True)  # half built, or for another torch
        steps = ([sys.executable, "-m", "venv", str(venv)],
                 [str(python), "-m", "pip", "install", "-q", "--only-binary=:all:", *_requirements()])  # fmt: skip
        for cmd in steps:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
            if proc.returncode != 0:
                tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-5:])
                pytest.fail(
                    f"could not build the venv of transformers {OLDEST_TRANSFORMERS} ({' '.join(cmd)}):\n{tail}"
                )
        stamp.write_text(wanted)
    return python


def read_with_old_transformers(tasks: list[dict], work: Path) -> list[dict]:
    """Each task's reading (tests/old_transformers_reader.py) under OLDEST_TRANSFORMERS, in one process."""
    spec = Path(work) / "reader_tasks.json"
    spec.write_text(json.dumps(tasks))
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS="1")
    proc = subprocess.run([str(old_python()), str(READER), str(spec)], capture_output=True, text=True, env=env,
                          cwd=work, timeout=600)  # fmt: skip
    assert proc.returncode == 0, f"transformers {OLDEST_TRANSFORMERS} could not read it:\n{proc.stderr[-4000:]}"
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    assert all(r["transformers"] == OLDEST_TRANSFORMERS for r in results), results
    return results


def model_fields(config) -> dict:
    """What the reader script's `fields` reads, from our (transformers 5) config: the RoPE base from
    rope_parameters, where 5 keeps it."""
    from old_transformers_reader import FIELDS

    out = {k: getattr(config, k, None) for k in FIELDS}
    rope = dict(getattr(config, "rope_parameters", None) or {})
    out["rope_theta"] = rope.pop("rope_theta", None)
    out["rope_scaling"] = None if set(rope) <= {"rope_type"} and rope.get("rope_type") == "default" else rope
    return out
