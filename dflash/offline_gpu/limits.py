"""The device side of `python -m dflash.offline_gpu.cli` (scripts/gpu_real_call1.sh and _call2.sh run it on the lent
GPU machine, which has a CUDA torch and transformers, no network and no package index).

    check     call 1: part 1 of the target file (left on the machine for call 2) checked against its sha256; the
              machine's GPU, Python and packages reported
    assemble  call 2: the target file rebuilt from part 1 (left by call 1) and part 2, every part and the whole
              checked by sha256 (a missing or changed part stops here, named); the staged wheels unpacked
    (run)     call 2, then `python -m dflash.offline_gpu.node_run`: the target converted (model.build as make real
              does it), the staged prompts answered again by it on the GPU (batched, greedy, for a fixed time), the
              drafter trained for what the call has left (train.max_minutes), the result packed into $OUT

This module imports only the standard library at its top: `check` and `assemble` run before the staged wheels
(hydra-core, omegaconf, ...) are on the path. The stage and the evaluation here use its file helpers.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import sys
import time
import zipfile
from collections.abc import Sequence
from pathlib import Path

from dflash.core.hashing import file_sha256  # stdlib only at its top, like this module

log = logging.getLogger("dflash.gpu_device")

FORMAT = "dflash-gpu-stage-v1"
# git-ignored: carried to the device by name (the device tool's `carry`); the dry run points both elsewhere
STAGE_DIR = Path(os.environ.get("DFLASH_GPU_STAGE", "outputs/gpu_stage"))
CALL_DIRS = {1: STAGE_DIR / "call1", 2: STAGE_DIR / "call2"}
MANIFEST = "stage.json"  # in call 2's folder: everything staged
PART_MANIFEST = "part.json"  # in each call's folder: that call's part of the target file
WORK = Path(os.environ.get("DFLASH_GPU_WORK", "outputs/gpu_device"))  # the device's working folder (git-ignored)
# what the device may lack: the modules a job imports beyond torch and transformers (call 1 reports them)
NEEDED_MODULES = ("omegaconf", "hydra", "antlr4", "gguf", "accelerate", "numpy", "safetensors", "yaml", "psutil")


class StageError(RuntimeError):
    """A staged file is missing or changed: the message names it and what to do."""


def check_part(part: dict, root: Path | None = None) -> Path:
    """A part of the target file, present and unchanged (its size, then its sha256), or StageError naming it."""
    path = (root or STAGE_DIR) / part["path"]  # a manifest's paths are relative to the stage folder
    call = part["call"]
    if not path.is_file():
        how = (
            "call 1 left it on the machine: run call 1 again, then call 2 at once (a machine idle for ~30 s is given "
            "back, and what call 1 left goes with it)"
            if call == 1
            else f"call {call} carries it: name {CALL_DIRS[call]} in that call's carry"
        )
        raise StageError(f"part {part['index']} of the target file ({path}) is missing: {how}")
    size = path.stat().st_size
    if size != part["bytes"] or file_sha256(path) != part["sha256"]:
        raise StageError(
            f"part {part['index']} of the target file ({path}, {size} bytes) is not the part staged "
            f"({part['bytes']} bytes, sha256 {part['sha256'][:12]}...): stage again (python -m dflash.offline_gpu.cli "
            "stage) and carry both parts of one stage"
        )
    return path


def join_parts(parts: list[dict], dest: Path, sha256: str, root: Path | None = None) -> Path:
    """The target file rebuilt from its parts in order, each checked first, the whole checked after."""
    paths = [check_part(p, root) for p in sorted(parts, key=lambda p: p["index"])]
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(dest.name + ".tmp")
    h = hashlib.sha256()
    with open(tmp, "wb") as out:
        for path in paths:
            with open(path, "rb") as f:
                for chunk in iter(lambda: f.read(1 << 20), b""):
                    h.update(chunk)
                    out.write(chunk)
    if h.hexdigest() != sha256:
        tmp.unlink()
        raise StageError(f"the rebuilt target file has sha256 {h.hexdigest()}, not the staged {sha256}: stage again")
    tmp.replace(dest)
    return dest


def split_file(src: Path, sizes: Sequence[int | None], dests: Sequence[Path]) -> list[dict]:
    """src cut into consecutive parts of `sizes` bytes (None: the rest), written to `dests`; each part's record."""
    parts, offset = [], 0
    with open(src, "rb") as f:
        for index, (size, dest) in enumerate(zip(sizes, dests), start=1):
            dest.parent.mkdir(parents=True, exist_ok=True)
            data = f.read() if size is None else f.read(size)
            dest.write_bytes(data)
            parts.append(
                {
                    "index": index,
                    "path": str(dest),
                    "bytes": len(data),
                    "sha256": hashlib.sha256(data).hexdigest(),
                    "offset": offset,
                }
            )
            offset += len(data)
    return parts


def install_wheels(wheels: list[dict], into: Path) -> list[str]:
    """The staged pure-Python wheels unpacked into `into` (a folder for PYTHONPATH; no pip needed), each checked."""
    into.mkdir(parents=True, exist_ok=True)
    names = []
    for w in wheels:
        path = STAGE_DIR / w["path"]
        if not path.is_file() or file_sha256(path) != w["sha256"]:
            raise StageError(f"wheel {path} is missing or changed: stage again and carry {CALL_DIRS[2]}")
        with zipfile.ZipFile(path) as z:
            z.extractall(into)
        names.append(path.name)
    return names


def read_manifest(call: int = 2) -> dict:
    path = CALL_DIRS[call] / (MANIFEST if call == 2 else PART_MANIFEST)
    if not path.is_file():
        raise StageError(
            f"{path} is missing: carry {CALL_DIRS[call]} (python -m dflash.offline_gpu.cli stage writes it)"
        )
    manifest = json.loads(path.read_text())
    if manifest.get("format") != FORMAT:
        raise StageError(f"{path}: format {manifest.get('format')!r}, not {FORMAT!r}: stage again")
    return manifest


def environment() -> dict:
    """The machine as a job sees it: Python, torch, transformers, the GPU, the modules it lacks."""
    import importlib.util

    env = {"python": sys.version.split()[0], "cpus": os.cpu_count()}
    env["missing_modules"] = [m for m in NEEDED_MODULES if importlib.util.find_spec(m) is None]
    try:
        import torch
        import transformers

        env.update(torch=torch.__version__, cuda=torch.version.cuda, transformers=transformers.__version__)
        if torch.cuda.is_available():
            free, total = torch.cuda.mem_get_info()
            env.update(
                gpu=torch.cuda.get_device_name(0), gpu_gib=round(total / 2**30, 1), bf16=torch.cuda.is_bf16_supported()
            )
    except ImportError as e:
        env["error"] = f"{type(e).__name__}: {e}"
    return env


def cmd_check(args) -> int:
    """Call 1: part 1 checked where call 2 will find it; the machine reported (and its imports warmed)."""
    part = read_manifest(1)
    check_part(part["part"])
    env = environment()
    where = STAGE_DIR / part["part"]["path"]
    lacking = [m for m in env["missing_modules"] if m not in part.get("staged_modules", [])]
    report = {"part1": {"path": str(where), "bytes": part["part"]["bytes"], "ok": True}, "environment": env,
              "missing_and_not_staged": lacking}  # fmt: skip
    _write_out(args.out, "call1.json", report)
    print(json.dumps(report, indent=2))
    if lacking:  # call 2 would fail at its first import of them: stop here, before the lease's long call
        print(f"error: this machine lacks {', '.join(lacking)} and the stage has no wheel of them: stage them "
              "(gpu_stage.DEVICE_WHEELS), or let the machine go", file=sys.stderr)  # fmt: skip
        return 3
    print(f"part 1 checked and left at {where}: make call 2 now (within ~30 s)")
    return 0


def cmd_assemble(args) -> int:
    """Call 2, first: the target file rebuilt and checked; the wheels unpacked into WORK/deps."""
    t0 = time.time()
    manifest = read_manifest(2)
    target = manifest["target"]
    dest = WORK / "target" / target["file"]
    join_parts(manifest["parts"], dest, target["sha256"])
    data = manifest["data"]
    if file_sha256(STAGE_DIR / data["path"]) != data["sha256"]:
        raise StageError(f"{STAGE_DIR / data['path']} changed since it was staged: stage again")
    installed = install_wheels(manifest["wheels"], WORK / "deps")
    phases = {
        "assemble": {"seconds": round(time.time() - t0, 1), "target_bytes": dest.stat().st_size, "wheels": installed}
    }
    (WORK / "phases.json").write_text(json.dumps(phases, indent=2))
    print(
        f"target file {dest} rebuilt from {len(manifest['parts'])} parts, sha256 checked; {len(installed)} wheels in "
        f"{WORK / 'deps'}"
    )
    return 0


def _write_out(out: str | None, name: str, obj: dict) -> None:
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / name).write_text(json.dumps(obj, indent=2))


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dflash.offline_gpu.limits", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    for name in ("check", "assemble"):
        sub.add_parser(name).add_argument("--out", default=os.environ.get("OUT"), help="where the report goes")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        if args.command == "check":
            return cmd_check(args)
        return cmd_assemble(args)
    except StageError as e:
        print(f"error: {e}", file=sys.stderr)
        _write_out(args.out, "error.json", {"error": str(e), "command": args.command})
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
