"""The node's side of `python -m dflash.offline_gpu.cli`, and the limits of the transfer to and from it. The node has a
CUDA torch and transformers, no network and no package index; scripts/gpu_real_check.sh and gpu_real_run.sh run this
module there.

    check     every step but the last: the piece of the target file that step brought checked against its sha256
              and left where the last step finds it; the node's GPU, Python and packages reported
    assemble  the last step, first: the target file rebuilt from every piece, each and the whole checked by sha256 (a
              missing or changed piece stops here, named); the staged wheels unpacked
    (run)     the last step, then `python -m dflash.offline_gpu.node_run`: the target converted (model.build as make
              real does it), the staged prompts answered again by it on the GPU (batched, greedy, for a fixed time),
              the drafter trained for what the wall-clock budget has left (train.max_minutes), the result packed into
              $OUT in files small enough to come back

This module imports only the standard library at its top: `check` and `assemble` run before the staged wheels
(hydra-core, omegaconf, ...) are on the path. The stage and the evaluation here use its limits and file helpers.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
import time
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from dflash.core.hashing import file_sha256  # stdlib only at its top, like this module

log = logging.getLogger("dflash.offline_gpu")

MIB = 1 << 20
FORMAT = "dflash-gpu-stage-v2"
# git-ignored, so each step names its folder to bring it over; the dry run points both elsewhere
STAGE_DIR = Path(os.environ.get("DFLASH_GPU_STAGE", "outputs/gpu_stage"))
MANIFEST = "stage.json"  # in the last step's folder: everything staged
PIECE_MANIFEST = "piece.json"  # in each earlier step's folder: the piece of the target file it brings
WORK = Path(os.environ.get("DFLASH_GPU_WORK", "outputs/gpu_node"))  # the node's working folder (git-ignored)
# what the node may lack: the modules a job imports beyond torch and transformers (every check step reports them)
NEEDED_MODULES = ("omegaconf", "hydra", "antlr4", "gguf", "accelerate", "numpy", "safetensors", "yaml", "psutil")
MIN_BUDGET_S = 120  # the job's start, its end and the pack take 95 s of the run step (node_run.py)


class StageError(RuntimeError):
    """A limit that cannot work, or a staged or returned file missing or changed: the message says what to do."""


@dataclass(frozen=True)
class Limits:
    """What the transfers to and from the node allow, and the time the node gives the job: `stage`'s options, kept in
    stage.json for the node's side. Defaults: a transfer of at most 64 MiB a step (the working tree, which goes with
    every step, included), at most 8 files of 16 MiB coming back, 540 s for the run step."""

    piece_mib: float = 64.0  # the most one step brings to the node, the working tree included
    return_files: int = 8  # the most files that come back from the node
    return_file_mib: float = 16.0  # the largest file that comes back
    budget_s: float = 540.0  # the run step's wall clock, from its start to its files

    def __post_init__(self) -> None:
        for flag, value, least, why in (
            ("--piece-mib", self.piece_mib, 1, ""),
            ("--return-files", self.return_files, 3, ": result.json, summary.txt and a part of the result come back"),
            ("--return-file-mib", self.return_file_mib, 1, ""),
            ("--budget-s", self.budget_s, MIN_BUDGET_S, ": the job's start, its end and the pack take 95 s"),
        ):
            if not value >= least:  # NaN too
                raise StageError(f"{flag} must be at least {least}, not {value:g}{why}")

    @classmethod
    def of(cls, recorded: dict | None, **given) -> Limits:
        """The limits a stage recorded, each replaced by a value given (None: not given)."""
        return cls(**{**(recorded or {}), **{k: v for k, v in given.items() if v is not None}})

    @property
    def part_bytes(self) -> int:
        """A part of the returned result: under the largest file that comes back."""
        return int(self.return_file_mib * MIB) * 15 // 16

    @property
    def max_parts(self) -> int:
        return self.return_files - 2  # result.json and summary.txt come back too


def step_dir(step: int) -> Path:
    return STAGE_DIR / f"step{step}"


def _fix(part: dict, parts: int) -> str:
    """What to do when a staged piece is missing: its step brought it, or left it on the node."""
    step = part["index"]  # step k brings piece k
    if step == parts:
        return f"step {step} brings it: copy {step_dir(step)} to the node with that step"
    return (
        f"step {step} left it on the node: run the steps from step {step} again, all on one node (a new node lacks "
        "what earlier steps left)"
    )


def check_part(part: dict, root: Path | None = None, parts: int = 2, of: str = "the target file") -> Path:
    """A part of a file, present and unchanged (its size, then its sha256), or StageError naming it. A staged part
    (root None: the stage folder) says which step brings it; a returned part (`of` the result) says so."""
    path = (root or STAGE_DIR) / part["path"]  # a manifest's paths are relative to its folder
    what = f"part {part['index']} of {of} ({path}"
    if not path.is_file():
        fix = _fix(part, parts) if root is None else "is this the folder the run step's files came back in?"
        raise StageError(f"{what}) is missing: {fix}")
    size = path.stat().st_size
    if size != part["bytes"] or file_sha256(path) != part["sha256"]:
        fix = "stage again (python -m dflash.offline_gpu.cli stage) and bring the pieces of one stage"
        raise StageError(
            f"{what}, {size} bytes) is not the part written ({part['bytes']} bytes, sha256 {part['sha256'][:12]}...): "
            + (fix if root is None else "bring the run step's files back again")
        )
    return path


def join_parts(
    parts: list[dict], dest: Path, sha256: str, root: Path | None = None, of: str = "the target file"
) -> Path:
    """The file rebuilt from its parts in order, each checked first, the whole checked after."""
    paths = [check_part(p, root, len(parts), of) for p in sorted(parts, key=lambda p: p["index"])]
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(dest.name + ".tmp")
    with open(tmp, "wb") as out:
        for path in paths:
            with open(path, "rb") as f:
                shutil.copyfileobj(f, out)
    if (got := file_sha256(tmp)) != sha256:
        tmp.unlink()
        again = ": stage again" if root is None else ""
        raise StageError(f"{of} rebuilt from its parts has sha256 {got}, not the {sha256} written{again}")
    return tmp.replace(dest)


def split_file(src: Path, sizes: Sequence[int | None], dests: Sequence[Path]) -> list[dict]:
    """src cut into consecutive parts of `sizes` bytes (None: the rest), written to `dests`; each part's record, its
    path as given."""
    parts, offset = [], 0
    with open(src, "rb") as f:
        for index, (size, dest) in enumerate(zip(sizes, dests), start=1):
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_bytes(f.read() if size is None else f.read(size))
            n = dest.stat().st_size
            parts.append({"index": index, "path": str(dest), "bytes": n, "sha256": file_sha256(dest), "offset": offset})
            offset += n
    return parts


def install_wheels(wheels: list[dict], into: Path) -> list[str]:
    """The staged pure-Python wheels unpacked into `into` (a folder for PYTHONPATH; no pip needed), each checked."""
    into.mkdir(parents=True, exist_ok=True)
    for w in wheels:
        path = STAGE_DIR / w["path"]
        if not path.is_file() or file_sha256(path) != w["sha256"]:
            raise StageError(f"wheel {path} is missing or changed: stage again and bring {path.parent.parent}")
        with zipfile.ZipFile(path) as z:
            z.extractall(into)
    return [Path(w["path"]).name for w in wheels]


def read_manifest(step: int) -> dict:
    """The last step's stage.json, or an earlier step's piece.json."""
    folder = step_dir(step)
    path = folder / MANIFEST if (folder / MANIFEST).is_file() else folder / PIECE_MANIFEST
    if not path.is_file():
        raise StageError(f"{folder} holds no {MANIFEST} or {PIECE_MANIFEST}: bring {folder} with step {step} "
                         "(python -m dflash.offline_gpu.cli stage writes it)")  # fmt: skip
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
    """A step before the last: its piece checked where the last step will find it; the node reported (and its
    imports warmed)."""
    piece = read_manifest(args.step)
    if "part" not in piece:
        raise StageError(f"step {args.step} is the last step: run scripts/gpu_real_run.sh {args.step}")
    where = check_part(piece["part"], parts=piece["parts"])
    env = environment()
    lacking = [m for m in env["missing_modules"] if m not in piece.get("staged_modules", [])]
    report = {"step": args.step, "part": {"path": str(where), "bytes": piece["part"]["bytes"], "ok": True},
              "environment": env, "missing_and_not_staged": lacking}  # fmt: skip
    _write_out(args.out, f"step{args.step}.json", report)
    print(json.dumps(report, indent=2))
    if lacking:  # the run step would fail at its first import of them: stop here, before the long step
        print(f"error: this node lacks {', '.join(lacking)} and the stage has no wheel of them: stage them "
              "(stage.NODE_WHEELS)", file=sys.stderr)  # fmt: skip
        return 3
    print(f"part {piece['part']['index']} checked and left at {where}: run step {args.step + 1} next, on this node")
    return 0


def cmd_assemble(args) -> int:
    """The last step, first: the target file rebuilt and checked; the wheels unpacked into WORK/deps; the manifest
    kept as WORK/stage.json for node_run."""
    t0 = time.time()
    manifest = read_manifest(args.step)
    if "target" not in manifest:
        raise StageError(f"step {args.step} is not the last step: run scripts/gpu_real_check.sh {args.step}")
    target = manifest["target"]
    dest = WORK / "target" / target["file"]
    join_parts(manifest["parts"], dest, target["sha256"])
    data = manifest["data"]
    if file_sha256(STAGE_DIR / data["path"]) != data["sha256"]:
        raise StageError(f"{STAGE_DIR / data['path']} changed since it was staged: stage again")
    installed = install_wheels(manifest["wheels"], WORK / "deps")
    (WORK / MANIFEST).write_text(json.dumps(manifest, indent=2))
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
        s = sub.add_parser(name)
        s.add_argument("--step", type=int, required=True, help="the step this is (its folder: outputs/gpu_stage/stepN)")
        s.add_argument("--out", default=os.environ.get("OUT"), help="where the report goes")
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
