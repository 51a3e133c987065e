"""The chat rendering a drafter was trained on (`data.chat_template_kwargs`, e.g. Qwen3.6's `enable_thinking`):
recorded with its export (`dflash_chat_template_kwargs` in config.json) and in its run's config, and compared where
the drafter meets text again (model.init_from's fine-tuning, python -m dflash.benchmark): a drafter that meets the
other rendering loses acceptance, so a difference is said in one line."""

from __future__ import annotations

import json
import logging
from pathlib import Path

log = logging.getLogger(__name__)

EXPORT_KEY = "dflash_chat_template_kwargs"


def trained_rendering(source: str | Path) -> dict | None:
    """The chat-template kwargs a drafter was trained under: its run's config_resolved.yaml (a run directory, or a
    checkpoint or drafter/ inside one), else its export's config.json; None where neither records it."""
    from omegaconf import OmegaConf

    path = Path(source).expanduser()
    for d in (path, path.parent, path.parent.parent):
        if (d / "config_resolved.yaml").is_file():
            found = OmegaConf.select(OmegaConf.load(d / "config_resolved.yaml"), "data.chat_template_kwargs")
            return dict(found or {})
    config = path / "config.json"
    if config.is_file():
        recorded = json.loads(config.read_text()).get(EXPORT_KEY)
        return None if recorded is None else dict(recorded)
    return None


def warn_if_rendered_otherwise(source: str, trained: dict | None, here: dict, what: str) -> bool:
    """One warning line when `here` renders otherwise than the drafter's training data. Returns whether it did."""
    if trained is None or dict(trained) == dict(here):
        return False
    log.warning(
        "%s renders chats with data.chat_template_kwargs=%s, the drafter at %s was trained on %s: a drafter meeting "
        "the other rendering (thinking on or off) loses acceptance",
        what,
        dict(here),
        source,
        dict(trained),
    )
    return True
