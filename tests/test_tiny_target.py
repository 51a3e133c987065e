"""The embedded target's cache: keyed by its path, so a changed build setting must not be reused in silence."""

from __future__ import annotations

import json
import logging

from omegaconf import OmegaConf

from dflash.model.tiny import build_differences, ensure_target


def test_a_cached_target_built_with_other_settings_is_named(tiny_dir, caplog):
    built = json.loads((tiny_dir / "build_info.json").read_text())["build"]
    assert build_differences(tiny_dir, OmegaConf.create(built)) == []
    other = OmegaConf.create({**built, "pretrain_steps": 600, "seed": built["seed"] + 1})
    assert build_differences(tiny_dir, other) == [
        "model.build.pretrain_steps: built 0 vs config 600",
        f"model.build.seed: built {built['seed']} vs config {built['seed'] + 1}",
    ]
    with caplog.at_level(logging.WARNING, logger="dflash.model.tiny"):
        assert ensure_target(OmegaConf.create({"target": str(tiny_dir), "build": other})) == tiny_dir
    assert "built with other settings" in caplog.text and "pretrain_steps: built 0 vs config 600" in caplog.text
