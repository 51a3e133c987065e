"""`python -m dflash.offline_gpu.cli dry-run`: every step on the tiny random target in a scratch folder, with a budget
of seconds and no GPU needed: what the CI test (tests/test_gpu_real.py) and scripts/gpu_checks.sh's first check run
before a GPU node's time is spent on the real target.

    stage      a few made-up ShareGPT conversations (no package needed) staged for model=tiny_random, no wheels,
               a run step of --budget-s 240 (more stage options as `stage_args`: --piece-mib, --return-file-mib, ...)
    checks     scripts/gpu_real_check.sh K for every step but the last, as the stage printed them: each piece checked
               and left in place
    refusal    a copy of the stage with one byte of the last piece changed: `assemble` stops and names that piece
    run        scripts/gpu_real_run.sh N on DEVICE (cpu or cuda): regeneration, training for seconds
               (train.max_minutes), the pack
    evaluate   the returned parts rebuilt into a run directory and evaluated (a jsonl suite: no package needed)

Each step is its own process, as on the node: the stage and work folders are set by DFLASH_GPU_STAGE and
DFLASH_GPU_WORK, the two sides' targets live in two caches (the run step unpacks its own from the staged pieces).
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
OVERRIDES = ["model=tiny_random", "train.seq_len=256", "train.num_anchors=4", "train.batch_size=2"]
TOPICS = (
    "sorting a list",
    "reading a file",
    "a for loop",
    "a dictionary",
    "a class",
    "an exception",
    "a set",
    "string formatting",
    "a generator",
    "a lambda",
    "recursion",
    "a tuple",
)


def synthetic_sharegpt(path: Path, n: int = 24) -> Path:
    """n short conversations in ShareGPT's own format (a .json array), two turns each."""
    convs = [
        {
            "id": str(i),
            "conversations": [
                {"from": "human", "value": f"How do I use {TOPICS[i % len(TOPICS)]} in Python? Show one example."},
                {
                    "from": "gpt",
                    "value": f"Here is {TOPICS[i % len(TOPICS)]} in Python:\n\ndef example(x):\n    return x\n\n"
                    "Call it with a value and print the result.",
                },
            ],
        }
        for i in range(n)
    ]
    path.write_text(json.dumps(convs))
    return path


def _run(cmd: list[str], env: dict, what: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    if check and proc.returncode != 0:
        raise RuntimeError(
            f"dry run: {what} failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        )
    return proc


def dry_run(root: Path, device: str = "cpu", stage_args: Sequence[str] = ()) -> dict:
    """Every step in `root`; returns what each left (raises naming the step that failed)."""
    root.mkdir(parents=True, exist_ok=True)
    py = sys.executable
    base = {**os.environ, "WANDB_MODE": "disabled", "PYTHONUNBUFFERED": "1", "PY": py}
    env = {
        **base,
        "DFLASH_GPU_STAGE": str(root / "stage"),
        "DFLASH_GPU_WORK": str(root / "work"),
        "DFLASH_CACHE_DIR": str(root / "cache"),
    }
    source = synthetic_sharegpt(root / "sharegpt.json")
    stage = [py, "-m", "dflash.offline_gpu.cli", "stage", "--records", "20", "--make-real-records", "0",
             "--no-wheels", "--source", str(source), "--budget-s", "240", *stage_args, *OVERRIDES]  # fmt: skip
    staged = _run(stage, env, "the stage")
    steps = json.loads((root / "stage" / "steps.json").read_text())
    checks = [
        _run(shlex.split(s["command"]), {**env, "OUT": str(root / f"out{k}")}, f"step {k}").stdout
        for k, s in enumerate(steps[:-1], start=1)
    ]

    last = len(steps)  # one byte of the last piece changed: the run step stops before any work, naming the piece
    bad = root / "stage_changed"
    shutil.copytree(root / "stage", bad)
    piece = next((bad / f"step{last}").glob(f"*.part{last}"))
    data = bytearray(piece.read_bytes())
    data[len(data) // 2] ^= 0xFF
    piece.write_bytes(bytes(data))
    refused = _run(
        [py, "-m", "dflash.offline_gpu.limits", "assemble", "--step", str(last)],
        {**env, "DFLASH_GPU_STAGE": str(bad), "DFLASH_GPU_WORK": str(root / "work_changed")},
        "assemble of a changed piece",
        check=False,
    )

    run_args = f"--device {device} --regen-s 30 --regen-batch 8 --max-new-tokens 8 --train-minutes 0.05"
    ran = _run(
        shlex.split(steps[-1]["command"]),
        {**env, "OUT": str(root / "out"), "DFLASH_CACHE_DIR": str(root / "node_cache"), "RUN_ARGS": run_args},
        f"step {last}, the run step",
    )
    suite = root / "suite.jsonl"
    suite.write_text("".join(json.dumps({"prompt": f"Explain {t} in Python."}) + "\n" for t in TOPICS[:3]))
    evaluate = [py, "-m", "dflash.offline_gpu.cli", "evaluate", str(root / "out"), "--into", str(root / "real"),
                "--make-real-run", "none", "--suites", f"jsonl:{suite}", "--samples", "2", "--replay-samples", "3",
                "--max-new-tokens", "8"]  # fmt: skip
    evaluated = _run(evaluate, env, "evaluate")
    return {
        "stage": staged.stdout,
        "steps": steps,
        "checks": checks,
        "refused": refused,
        "run_step": ran.stdout,
        "result": json.loads((root / "out" / "result.json").read_text()),
        "run": next((root / "real").glob("*/run")),
        "evaluate": evaluated.stdout,
    }


def main_dry_run(root: Path | None, device: str) -> int:
    scratch = root or Path(tempfile.mkdtemp(prefix="gpu_real_dry_"))
    try:
        out = dry_run(scratch, device)
    finally:
        if root is None:
            shutil.rmtree(scratch, ignore_errors=True)
    last = len(out["steps"])
    refused = out["refused"].returncode == 2 and f"part {last}" in out["refused"].stderr
    ok = refused and out["result"]["status"] == "completed"
    print(out["result"]["text"])
    print((out["run"] / "comparison.md").read_text() if root else out["evaluate"][-1500:])
    print(f"dry run ({device}, {last} steps): {'ok' if ok else 'FAILED'}; a changed piece {last} refused: "
          f"{out['refused'].stderr.strip()}")  # fmt: skip
    return 0 if ok else 1
