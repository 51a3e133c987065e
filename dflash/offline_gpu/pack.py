"""What comes back from the run step: the run's files in one tar.gz, cut into parts no larger than a returned file may
be (--return-file-mib, 16 by default; each part 15/16 of it), beside result.json (the parts' sha256s, the phases, the
throughput) and summary.txt (the same in a few lines, also printed): at most --return-files files (8) in all.

The tar holds run/ (the drafter in bf16, sharded into files of at most SHARD_BYTES, with its config; metrics.jsonl,
run.json, summary.json, status.json, config_resolved.yaml, the job's log), data/ (the token files trained on:
the GPU's regenerated answers, worth keeping; left out when the whole would need more files than may come back),
target_build_info.json (where the target came from), stage.json (what was staged, each file's sha256) and node.json
(the machine, the phases, the converted target's weights' sha256, the regeneration's and the training's figures). A
run cut off before its export packs the drafter of its latest checkpoint instead.
"""

from __future__ import annotations

import json
import shutil
import tarfile
import time
from pathlib import Path

from dflash.core.hashing import file_sha256
from dflash.offline_gpu.limits import FORMAT, WORK, Limits, split_file

SHARD_BYTES = 12 << 20  # a drafter shard (inside the tar)
RESULT = "result.json"
TAR = "result.tar.gz"
RUN_FILES = (
    "metrics.jsonl",
    "run.json",
    "summary.json",
    "status.json",
    "config_resolved.yaml",
    "launch.log",
    "eval.json",
)


def bf16_drafter(src: Path, dest: Path) -> dict:
    """The drafter's weights (an export's folder, or a checkpoint's drafter.safetensors) as bf16 shards in dest,
    with an index when there are several (the layout from_pretrained reads), and the export's other files."""
    import torch
    from huggingface_hub import save_torch_state_dict
    from safetensors.torch import load_file

    weights = src / "model.safetensors" if src.is_dir() else src
    tensors = {k: (v.to(torch.bfloat16) if v.is_floating_point() else v) for k, v in load_file(str(weights)).items()}
    dest.mkdir(parents=True, exist_ok=True)
    if src.is_dir():
        for f in src.iterdir():
            if f.is_file() and f.suffix != ".safetensors":
                shutil.copy2(f, dest / f.name)
    save_torch_state_dict(dict(sorted(tensors.items())), dest, max_shard_size=SHARD_BYTES)
    return {"files": len(list(dest.glob("*.safetensors"))), "dtype": "bfloat16"}


def _drafter_source(run_dir: Path) -> tuple[Path | None, str]:
    if (run_dir / "drafter" / "model.safetensors").is_file():
        return run_dir / "drafter", "export"
    ckpts = sorted(run_dir.glob("checkpoints/step_*/drafter.safetensors"), key=lambda p: int(p.parent.name[5:]))
    return (ckpts[-1], f"checkpoint {ckpts[-1].parent.name}") if ckpts else (None, "none")


def throughput(run_dir: Path, target: Path) -> dict:
    """Steps, tokens/s (the median monitor window after the first two) and MFU against the GPU's bf16 peak (the
    plan's FLOP model: target forward + drafter step per token at the run's seq_len and anchors)."""
    from omegaconf import OmegaConf

    from dflash.model.plan import flops_per_token, target_shape

    records = []
    for line in (run_dir / "metrics.jsonl").read_text().splitlines() if (run_dir / "metrics.jsonl").is_file() else []:
        rec = json.loads(line)
        if rec.get("perf/ktok_s") is not None:
            records.append(rec)
    summary = _read(run_dir / "summary.json")
    out = {"steps": summary.get("step"), "tokens": summary.get("tokens"), "stop_reason": summary.get("stop_reason")}
    steady = sorted(r["perf/ktok_s"] for r in records[2:] or records)
    if not steady:
        return out
    ktok_s = steady[len(steady) // 2]
    cfg = OmegaConf.load(run_dir / "config_resolved.yaml")
    per_token = flops_per_token(cfg, target_shape(str(target)))
    out.update({"ktok_s": round(ktok_s, 2), "tflop_per_s": round(ktok_s * 1e3 * sum(per_token.values()) / 1e12, 2)})
    peak = _peak_tflops()
    if peak:
        out.update({"peak_tflops": peak, "mfu": round(out["tflop_per_s"] / peak, 4)})
    return out


def _peak_tflops() -> float | None:
    import torch

    from dflash.benchmarks.pipeline import PEAK_TFLOPS

    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name(0)
    return next((v for k, v in PEAK_TFLOPS.items() if k in name), None)


def _read(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def pack(out: Path, run_dir: Path | None, manifest: dict, info: dict, limits: Limits | None = None) -> dict:
    """The tar's parts, result.json and summary.txt in `out`, within `limits`' returned files; returns result.json's
    content (with `text`)."""
    limits = limits or Limits()
    tar, status, drafter = _tar(run_dir, manifest, info, with_data=True)
    if -(-tar.stat().st_size // limits.part_bytes) > limits.max_parts:  # too much to come back: the drafter and logs
        info = {**info, "left_out": "data/ (over the files that may come back)"}
        tar, status, drafter = _tar(run_dir, manifest, info, with_data=False)
    size = tar.stat().st_size
    if -(-size // limits.part_bytes) > limits.max_parts:
        info = {**info, "over_return_limit": f"{size} bytes: more than {limits.max_parts} parts of {limits.part_bytes}"}
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob(f"{TAR}.*"):
        old.unlink()
    n = max(1, -(-size // limits.part_bytes))
    parts = split_file(tar, [limits.part_bytes] * (n - 1) + [None], [out / f"{TAR}.{k:02d}" for k in range(n)])
    for p in parts:
        p["path"] = Path(p["path"]).name  # read relative to the folder they came back in
    result = {
        "format": FORMAT,
        "status": status,
        "created": time.strftime("%Y-%m-%d %H:%M:%S"),
        "sha256": file_sha256(tar),
        "bytes": size,
        "parts": parts,
        "drafter": drafter,
        "info": info,
    }
    result["text"] = summary_text(result)
    (out / RESULT).write_text(json.dumps(result, indent=2, default=str))
    (out / "summary.txt").write_text(result["text"] + "\n")
    return result


def _tar(run_dir: Path | None, manifest: dict, info: dict, with_data: bool) -> tuple[Path, str, dict]:
    """WORK/result.tar.gz of the run's files (and its data); the run's status and where its drafter came from."""
    stage = WORK / "pack"
    shutil.rmtree(stage, ignore_errors=True)
    (stage / "run").mkdir(parents=True)
    status = _read(run_dir / "status.json").get("status", "missing") if run_dir else "not started"
    drafter = {"source": "none"}
    if run_dir is not None:
        for name in RUN_FILES:
            if (run_dir / name).is_file():
                shutil.copy2(run_dir / name, stage / "run" / name)
        src, what = _drafter_source(run_dir)
        if src is not None:
            drafter = {"source": what, **bf16_drafter(src, stage / "run" / "drafter")}
    if with_data and (WORK / "data").is_dir():
        shutil.copytree(WORK / "data", stage / "data")
    target = Path(info.get("target_dir", "")) / "build_info.json"
    if target.is_file():
        shutil.copy2(target, stage / "target_build_info.json")
    node = {**info, "status": status, "drafter": drafter, "stage": {k: manifest.get(k) for k in ("git", "created")}}
    (stage / "stage.json").write_text(json.dumps(manifest, indent=2))  # what was staged: every file's sha256
    (stage / "node.json").write_text(json.dumps(node, indent=2, default=str))
    tar = WORK / TAR
    with tarfile.open(tar, "w:gz") as t:
        t.add(stage, arcname="gpu_real")
    return tar, status, drafter


def summary_text(result: dict) -> str:
    info = result["info"]
    phases = info.get("phases", {})
    t, r, tr = info.get("throughput", {}), info.get("regenerate", {}), info.get("train", {})
    lines = [
        f"gpu_real: status {result['status']}" + (f", error {info['error']}" if info.get("error") else ""),
        "phases: " + ", ".join(f"{k} {v.get('seconds', 0):.0f} s" for k, v in phases.items()),
        f"regenerated {r.get('answers')} of {r.get('prompts')} answers, {r.get('new_tok_s')} new tok/s; "
        f"data files {r.get('files')}",
        f"train: batch {tr.get('batch_size')}, max_minutes {tr.get('max_minutes')}, {t.get('steps')} steps "
        f"({t.get('stop_reason')}), {t.get('tokens')} tokens, {t.get('ktok_s')} ktok/s, "
        f"{t.get('tflop_per_s')} TFLOP/s, MFU {t.get('mfu')}",
        f"drafter: {result['drafter']}; {len(result['parts'])} parts, {result['bytes']} bytes, sha256 "
        f"{result['sha256'][:16]}",
    ]
    lines += [f"{k.replace('_', ' ')}: {info[k]}" for k in ("left_out", "over_return_limit") if info.get(k)]
    return "\n".join(lines)
