"""data=stdlib's regeneration with the target (dflash/data/regenerate.py): its cache is keyed on what the target
is, not where it lies, and a stop request ends it within a generated token, not after a batch."""

from __future__ import annotations

import shutil

import pytest
from omegaconf import OmegaConf

from dflash.core import interrupts
from dflash.core.config import DataConfig, RegenerateConfig
from dflash.data.regenerate import regenerate_documents, regenerated_corpus


@pytest.fixture(scope="module")
def target(tiny_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(tiny_dir).eval(), AutoTokenizer.from_pretrained(tiny_dir)


def _data_cfg():
    regen = RegenerateConfig(num_prompts=2, prompt_len=8, max_new_tokens=4, batch_size=2)
    return OmegaConf.structured(DataConfig(name="stdlib", max_files=3, regenerate=regen))


def test_the_cache_survives_a_moved_target_and_misses_a_changed_one(tmp_path, tiny_dir, target):
    """DFLASH_CACHE_DIR moved: the embedded target now lies elsewhere (new path, new mtimes), same bytes."""
    model, tokenizer = target
    cache = tmp_path / "cache"
    docs = regenerated_corpus(model, tokenizer, str(tiny_dir), _data_cfg(), 0, str(cache))
    moved = tmp_path / "moved" / "target"
    shutil.copytree(tiny_dir, moved, copy_function=shutil.copyfile)  # copyfile: new mtimes too
    again = regenerated_corpus(None, tokenizer, str(moved), _data_cfg(), 0, str(cache))  # None: no target to run
    assert [(d.ids, d.loss_mask) for d in again] == [(d.ids, d.loss_mask) for d in docs]
    config = moved / "config.json"
    config.write_text(config.read_text().replace("{", '{"note": "other weights",', 1))
    with pytest.raises(RuntimeError, match="needs the target"):  # other content: a miss, so it would regenerate
        regenerated_corpus(None, tokenizer, str(moved), _data_cfg(), 0, str(cache))


def test_a_stop_request_ends_regeneration_within_a_token(target):
    """The stop is requested during the 2nd forward of a 40-token batch: generation ends there, not 38 tokens on,
    and the cut batch is not returned as data."""
    model, tokenizer = target
    stop = interrupts.stop_event()
    forwards = []

    def count_and_stop(*_):
        forwards.append(1)
        if len(forwards) == 2:
            stop.set()

    hook = model.register_forward_hook(count_and_stop)
    regen = OmegaConf.structured(RegenerateConfig(num_prompts=4, prompt_len=8, max_new_tokens=40, batch_size=4))
    prompts = [[5 + i, 6, 7, 8, 9, 10, 11, 12] for i in range(4)]
    try:
        with pytest.raises(interrupts.Interrupted, match="data regeneration"):
            regenerate_documents(model, tokenizer, prompts, regen, seed=0)
    finally:
        hook.remove()
        stop.clear()
    assert len(forwards) == 2
