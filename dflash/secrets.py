"""Secrets never reach a run file, a log line or W&B: values of secret-looking keys are redacted, and the
values of secret environment variables (WANDB_API_KEY, HF_TOKEN, ...) are scrubbed from text."""

from __future__ import annotations

import json
import os
import re
from typing import Any

from dflash.jsonio import json_safe

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


def redact(obj: Any) -> Any:
    """Replace the value of any key that looks like a secret, and secret-looking `key=value` strings."""
    if isinstance(obj, dict):
        return {
            k: (REDACTED if _SECRET_KEY.search(str(k)) and v not in (None, "") else redact(v)) for k, v in obj.items()
        }
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


def scrub_json(info: dict) -> dict:
    """info without the values of secret environment variables anywhere in it."""
    return json.loads(scrub_text(json.dumps(json_safe(info))))
