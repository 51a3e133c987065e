"""Run-directory files: secrets never reach them, every exit path ends status.json, files are readable."""

from __future__ import annotations

import json
import os
import stat

from dflash.jsonio import _UMASK, write_json
from dflash.rundir import StatusFile
from dflash.secrets import REDACTED, redact, scrub_text


def test_secret_keys_are_redacted_with_or_without_hydra_prefixes():
    overrides = [
        "hf_token=abc",
        "+hf_token=abc",
        "++wandb_api_key=abc",
        "data.hf_token=abc",
        "logging.wandb.api_key=abc",
        "+db_password=abc",
    ]
    assert redact(overrides) == [o.split("=")[0] + "=" + REDACTED for o in overrides]
    keep = ["eval.max_new_tokens=8", "model.mask_token_id=5", "model.mask_token=<|MASK|>", "loss.kl_weight=0.5"]
    assert redact(keep) == keep  # config about tokens is not a secret
    assert redact({"hf_token": "abc", "max_new_tokens": 8, "nested": {"api_key": "k"}}) == {
        "hf_token": REDACTED,
        "max_new_tokens": 8,
        "nested": {"api_key": REDACTED},
    }


def test_values_of_secret_environment_variables_are_scrubbed(monkeypatch):
    for name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "GH_TOKEN", "WANDB_API_KEY"):
        monkeypatch.setenv(name, f"value-of-{name.lower()}-1234")
    text = " ".join(
        f"value-of-{n.lower()}-1234" for n in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "GH_TOKEN", "WANDB_API_KEY")
    )
    assert scrub_text(text) == " ".join([REDACTED] * 4)


def test_failed_status_scrubs_error_and_traceback(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_SECRETVALUE123")
    st = StatusFile(tmp_path)
    st.running()
    st.finish("failed", error="401 for token=hf_SECRETVALUE123", traceback="  ... token=hf_SECRETVALUE123\n")
    text = (tmp_path / "status.json").read_text()
    assert "hf_SECRETVALUE123" not in text and json.loads(text)["status"] == "failed"


def test_run_files_get_the_umask_mode_not_0600(tmp_path):
    write_json(tmp_path / "summary.json", {"a": 1})
    mode = stat.S_IMODE(os.stat(tmp_path / "summary.json").st_mode)
    assert mode == 0o666 & ~_UMASK and mode & stat.S_IRUSR
