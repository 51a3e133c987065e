"""What a run directory says about itself: config_resolved.yaml, run.json, status.json, summary.json."""

from __future__ import annotations

import json
import math
import os
import platform
import re
import socket
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from collections.abc import Mapping
from typing import Any

from omegaconf import DictConfig, OmegaConf

PACKAGES = ("torch", "transformers", "hydra-core", "omegaconf", "wandb", "safetensors", "tokenizers", "dflash")
# keys whose values are secrets wherever they appear (config, argv, overrides)
# (not "token" alone: max_new_tokens and mask_token_id are config, not secrets)
# (a key may carry Hydra's +, ++ or ~ prefix: `+hf_token=...`)
_SECRET_KEY = re.compile(
    r"(api[_-]?key|secret|password|passwd|credential|"
    r"(^[+~]*|[_.-])(hf|hf_hub|hub|huggingface|hugging_face_hub|auth|access|bearer|api|wandb|github|gh|refresh|"
    r"session)[_-]?token$)",
    re.IGNORECASE,
)
REDACTED = "<redacted>"
_UMASK = os.umask(0o022)  # read once at import (os.umask can only be read by setting it) ...
os.umask(_UMASK)  # ... and put back


def now_iso() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def to_python(value: Any) -> Any:
    """Tensors, numpy scalars/arrays and nested containers as plain Python; floats keep NaN/inf.
    Duck-typed (`.item()` / `.tolist()`) so this module imports neither torch nor numpy."""
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    if isinstance(value, Mapping):
        return {str(k): to_python(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_python(v) for v in value]
    if hasattr(value, "item") and getattr(value, "ndim", 0) == 0:
        return value.item()  # 0-d tensor or numpy scalar; .item() syncs a CUDA tensor once
    if hasattr(value, "tolist"):
        return value.tolist()
    return str(value)


def json_safe(value: Any) -> Any:
    """`to_python`, then non-finite floats -> None, so every file is strict JSON (RFC 8259 has no NaN): a NaN
    metric is written as `null` under its own key, and any parser (jq, pandas, JavaScript) reads it."""
    value = to_python(value)
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, list):
        return [json_safe(v) for v in value]
    return value


def write_text_atomic(path: Path, text: str) -> None:
    """Write a uniquely named temp file then rename, so a crash or a parallel writer never leaves half a file."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.chmod(tmp, 0o666 & ~_UMASK)  # mkstemp makes 0600; run files are for everyone the umask allows
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_json(path: Path, data: Any) -> None:
    write_text_atomic(path, json.dumps(json_safe(data), indent=2) + "\n")


def redact(obj: Any) -> Any:
    """Replace the value of any key that looks like a secret, and secret-looking `key=value` strings."""
    if isinstance(obj, dict):
        return {k: (REDACTED if _SECRET_KEY.search(str(k)) and v not in (None, "") else redact(v)) for k, v in obj.items()}
    if isinstance(obj, list):
        return [redact(v) for v in obj]
    if isinstance(obj, str) and "=" in obj:
        key, _, _ = obj.partition("=")
        if _SECRET_KEY.search(key):
            return f"{key}={REDACTED}"
    return obj


def _secret_env_values() -> set[str]:
    return {v for k, v in os.environ.items() if _SECRET_KEY.search(k) and len(v) >= 8}


def scrub_text(text: str) -> str:
    """Remove the values of secret environment variables (WANDB_API_KEY, HF_TOKEN, ...) from text."""
    for value in _secret_env_values():
        text = text.replace(value, REDACTED)
    return text


def git_info(cwd: Path) -> dict:
    def git(*args: str) -> str | None:
        try:
            out = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=5)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return out.stdout.strip() if out.returncode == 0 else None

    sha = git("rev-parse", "HEAD")
    if sha is None:
        return {"sha": None, "dirty": None}
    return {"sha": sha, "dirty": bool(git("status", "--porcelain", "--untracked-files=no"))}


def package_versions() -> dict:
    out = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def device_info() -> dict:
    import torch

    info = {"cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(), "cuda": torch.cuda.is_available()}
    if torch.cuda.is_available():
        info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return info


def write_config_snapshot(run_dir: Path, cfg: DictConfig) -> None:
    resolved = redact(OmegaConf.to_container(cfg, resolve=True))
    write_text_atomic(run_dir / "config_resolved.yaml", scrub_text(OmegaConf.to_yaml(OmegaConf.create(resolved))))


def write_run_info(run_dir: Path, overrides: list[str], choices: dict, extra: dict | None = None) -> dict:
    info = {
        "argv": redact(list(sys.argv)),
        "overrides": redact(list(overrides)),
        "choices": dict(choices),
        "cwd": os.getcwd(),
        "git": git_info(Path(__file__).resolve().parent.parent),
        "packages": package_versions(),
        "host": socket.gethostname(),
        "platform": platform.platform(),
        "device": device_info(),
        "start_time": now_iso(),
        **(extra or {}),
    }
    info = _scrubbed(info)
    write_json(run_dir / "run.json", info)
    return info


def append_resume_info(run_dir: Path, overrides: list[str]) -> None:
    """run.json keeps how the run was started; each resume is appended to its `resumes` list."""
    path = run_dir / "run.json"
    info = json.loads(path.read_text()) if path.exists() else {}
    entry = {"time": now_iso(), "argv": redact(list(sys.argv)), "overrides": redact(list(overrides))}
    info.setdefault("resumes", []).append(_scrubbed(entry))
    write_json(path, info)


def _scrubbed(info: dict) -> dict:
    """info without the values of secret environment variables anywhere in it."""
    return json.loads(scrub_text(json.dumps(json_safe(info))))


class StatusFile:
    """status.json: `running` at start, then exactly one of completed / failed / interrupted."""

    def __init__(self, run_dir: Path):
        self.path = run_dir / "status.json"
        self.t0 = time.time()
        self.start_time = now_iso()

    def running(self, **extra: Any) -> None:
        write_json(self.path, {"status": "running", "start_time": self.start_time, "pid": os.getpid(), **extra})

    def finish(self, status: str, error: str | None = None, **extra: Any) -> None:
        extra = {k: scrub_text(v) if isinstance(v, str) else v for k, v in extra.items()}  # e.g. the traceback
        write_json(self.path, {
            "status": status, "error": scrub_text(error) if error else None, "start_time": self.start_time,
            "end_time": now_iso(), "wall_time_s": round(time.time() - self.t0, 3), **extra,
        })

