"""train.data_seed: several training seeds on one data order, so that they read one feature store."""

from __future__ import annotations

import itertools

import torch

from dflash.data.training_data import run_training_data
from dflash.runner.resume import _frozen_reason
from dflash.train.feature_store import manifest_for, store_path
from tests.conftest import compose_config

SMALL = ["data.regenerate.enabled=false", "data.max_files=6", "train.seq_len=64", "train.batch_size=2"]


def _first_batches(cfg, tokenizer, n=4):
    data = run_training_data(cfg, tokenizer, None, None)
    return [b.input_ids for b in itertools.islice(data.batches.iterate(), n)]


def test_a_fixed_data_seed_gives_every_training_seed_the_same_batches(tiny_tokenizer):
    base = [*SMALL, "train.data_seed=0"]
    a = _first_batches(compose_config([*base, "train.seed=0"]), tiny_tokenizer)
    b = _first_batches(compose_config([*base, "train.seed=1"]), tiny_tokenizer)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    c = _first_batches(compose_config([*SMALL, "train.seed=1"]), tiny_tokenizer)  # null: train.seed's order
    assert not all(torch.equal(x, y) for x, y in zip(a, c))


def test_the_store_is_keyed_by_the_data_seed_not_the_drafters():
    def path(*overrides):
        cfg = compose_config(["features=store", *SMALL, *overrides])
        return store_path(cfg, manifest_for(cfg, [1, 3], None))

    assert path("train.seed=0", "train.data_seed=0") == path("train.seed=2", "train.data_seed=0")
    assert path("train.seed=0") != path("train.seed=2")  # unset: the training seed orders the data
    assert path("train.seed=0") == path("train.seed=5", "train.data_seed=0")
    assert _frozen_reason("train.data_seed")  # a resume may not change the data stream
