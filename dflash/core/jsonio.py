"""JSON in and out of run files: plain-Python conversion, strict JSON (NaN -> null), atomic writes and the
lenient readers that never crash on a file cut short by a killed process."""

from __future__ import annotations

import json
import logging
import math
import os
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

_UMASK = os.umask(0o022)  # read once at import (os.umask can only be read by setting it) ...
os.umask(_UMASK)  # ... and put back


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


def read_json(path: Path | str, default: Any = None) -> Any:
    """Parsed JSON, or `default` when the file is missing or not valid JSON (a run killed mid-write). The one
    lenient reader of every run-directory file: readers never crash on a half-written file."""
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError:
        return default
    except (OSError, ValueError) as e:
        log.warning("ignoring unreadable %s: %s", path, e)
        return default


def iter_jsonl(path: Path | str) -> Iterator[dict]:
    """Records of a JSONL file; a truncated or corrupt line (killed writer) is skipped."""
    try:
        f = Path(path).open()
    except FileNotFoundError:
        return
    with f:
        for lineno, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                rec = json.loads(line)
            except ValueError:
                log.debug("%s:%d: skipping unparsable line", path, lineno)
                continue
            if isinstance(rec, dict):
                yield rec


def is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)
