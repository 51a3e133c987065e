"""`python -m dflash.offline_gpu.cli dry-run`: the whole lease on the tiny random target in a scratch folder, with a
budget of seconds and no GPU needed: what the CI test (tests/test_gpu_real.py) and scripts/gpu_checks.sh's first
check run before a lease is spent on the real target.

    stage      a few made-up ShareGPT conversations (no package needed) staged for model=tiny_random, no wheels
    call 1     scripts/gpu_real_call1.sh: part 1 checked and left in place
    refusal    a copy of the stage with one byte of part 2 changed: `assemble` stops and names part 2
    call 2     scripts/gpu_real_call2.sh on DEVICE (cpu or cuda): regeneration, training for seconds
               (train.max_minutes), the pack
    evaluate   the returned parts rebuilt into a run directory and evaluated (a jsonl suite: no package needed)

Each step is its own process, as on the device: the stage and work folders are set by DFLASH_GPU_STAGE and
DFLASH_GPU_WORK, the two sides' targets live in two caches (call 2 unpacks its own from the staged parts).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
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


def dry_run(root: Path, device: str = "cpu") -> dict:
    """Every step of the lease in `root`; returns what each step left (raises naming the step that failed)."""
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
    _run(
        [
            py,
            "-m",
            "dflash.offline_gpu.cli",
            "stage",
            "--records",
            "20",
            "--make-real-records",
            "0",
            "--no-wheels",
            "--source",
            str(source),
            *OVERRIDES,
        ],
        env,
        "the stage",
    )
    call1 = _run(["bash", "scripts/gpu_real_call1.sh"], {**env, "OUT": str(root / "out1")}, "call 1")

    bad = root / "stage_changed"  # one byte of part 2 changed: call 2 stops before any work, naming the part
    shutil.copytree(root / "stage", bad)
    part2 = next((bad / "call2").glob("*.part2"))
    data = bytearray(part2.read_bytes())
    data[len(data) // 2] ^= 0xFF
    part2.write_bytes(bytes(data))
    refused = _run(
        [py, "-m", "dflash.offline_gpu.limits", "assemble"],
        {**env, "DFLASH_GPU_STAGE": str(bad), "DFLASH_GPU_WORK": str(root / "work_changed")},
        "assemble of a changed part",
        check=False,
    )

    run_args = f"--device {device} --regen-s 30 --regen-batch 8 --max-new-tokens 8 --train-minutes 0.05"
    call2 = _run(
        ["bash", "scripts/gpu_real_call2.sh"],
        {
            **env,
            "OUT": str(root / "out2"),
            "DFLASH_CACHE_DIR": str(root / "device_cache"),
            "BUDGET_S": "240",
            "RUN_ARGS": run_args,
        },
        "call 2",
    )
    suite = root / "suite.jsonl"
    suite.write_text("".join(json.dumps({"prompt": f"Explain {t} in Python."}) + "\n" for t in TOPICS[:3]))
    evaluated = _run(
        [
            py,
            "-m",
            "dflash.offline_gpu.cli",
            "evaluate",
            str(root / "out2"),
            "--into",
            str(root / "real"),
            "--make-real-run",
            "none",
            "--suites",
            f"jsonl:{suite}",
            "--samples",
            "2",
            "--replay-samples",
            "3",
            "--max-new-tokens",
            "8",
        ],
        env,
        "evaluate",
    )
    result = json.loads((root / "out2" / "result.json").read_text())
    run = next((root / "real").glob("*/run"))
    return {
        "call1": call1.stdout,
        "refused": refused,
        "call2": call2.stdout,
        "result": result,
        "run": run,
        "evaluate": evaluated.stdout,
    }


def main_dry_run(root: Path | None, device: str) -> int:
    scratch = root or Path(tempfile.mkdtemp(prefix="gpu_real_dry_"))
    try:
        out = dry_run(scratch, device)
    finally:
        if root is None:
            shutil.rmtree(scratch, ignore_errors=True)
    ok = out["refused"].returncode == 2 and "part 2" in out["refused"].stderr and out["result"]["status"] == "completed"
    print(out["result"]["text"])
    print((out["run"] / "comparison.md").read_text() if root else out["evaluate"][-1500:])
    print(f"dry run ({device}): {'ok' if ok else 'FAILED'}; a changed part 2 refused: {out['refused'].stderr.strip()}")
    return 0 if ok else 1
