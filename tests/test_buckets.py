"""Single-conversation batches: isolation from other conversations, length buckets, resume and rank slices."""

from __future__ import annotations

import json
import random

import pytest
import torch
from omegaconf import OmegaConf

from dflash.data.batches import rank_slice


@pytest.fixture(scope="module")
def chat_file(tmp_path_factory):
    """120 conversations of 1-4 turns and very different lengths."""
    rng = random.Random(1)
    path = tmp_path_factory.mktemp("chat") / "chat.jsonl"
    with open(path, "w") as f:
        for i in range(120):
            msgs = []
            for t in range(rng.randint(1, 4)):
                msgs.append({"role": "user", "content": f"task {i}.{t}"})
                body = f"    total = total + {i} * {t}\n" * rng.randint(1, 6)
                msgs.append({"role": "assistant", "content": "def f():\n" + body})
            f.write(json.dumps({"messages": msgs}) + "\n")
    return path


def _training_data(chat_file, tokenizer, target, cache, seq_len=256, batch_size=4, **data):
    from dflash.core.config import DataConfig
    from dflash.data import chat_dataset
    from dflash.data.training_data import build_training_data

    chat_dataset._loaded.clear()
    cfg = OmegaConf.merge(OmegaConf.structured(DataConfig(name="jsonl", path=str(chat_file))), data)
    train = OmegaConf.create({"seq_len": seq_len, "batch_size": batch_size, "seed": 3})
    return build_training_data(cfg, train, tokenizer, 4, target_path=str(target), cache_dir=str(cache))


def test_a_conversation_in_a_batch_has_the_features_it_has_alone(chat_file, tiny_tokenizer, tiny_target, tmp_path):
    """Each row is one record, right-padded: its target features equal the record run alone, and no block's
    drafter context reaches past the record's own tokens."""
    from dflash.model.blocks import build_training_attention_mask, sample_anchors
    from dflash.model.target import TargetModel

    td = _training_data(chat_file, tiny_tokenizer, tiny_target, tmp_path, seq_len=1024)
    assert td.chat.lengths.max() < 1024
    target = TargetModel.load(str(tiny_target), [1, 2], "float32", "cpu")
    records = {tuple(ids) for ids in td.chat.table["input_ids"]}
    checked = 0
    for batch, _ in zip(td.batches.iterate(), range(6)):
        # as wide as its longest row, rounded up to data.pad_to_multiple_of (64)
        assert batch.input_ids.shape[1] == -(-int(batch.lengths.max()) // 64) * 64
        hidden, last = target.features(batch.input_ids)
        anchors, valid = sample_anchors(batch.loss_mask, 8, 4, torch.Generator().manual_seed(0))
        visible = build_training_attention_mask(anchors, valid, batch.input_ids.shape[1], 4)[:, 0]
        for r, n in enumerate(batch.lengths.tolist()):
            assert tuple(batch.input_ids[r, :n].tolist()) in records  # exactly one whole record (none truncated here)
            assert not batch.loss_mask[r, n:].any()  # padding is never supervised
            alone_hidden, alone_last = target.features(batch.input_ids[r : r + 1, :n])
            torch.testing.assert_close(hidden[r : r + 1, :n], alone_hidden, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(last[r : r + 1, :n], alone_last, rtol=1e-5, atol=1e-5)
            context = visible[r, :, : batch.input_ids.shape[1]]
            assert not context[:, n:].any()  # no block sees past its conversation
            checked += 1
    assert checked == 24


def test_length_buckets_cut_padding(chat_file, tiny_tokenizer, tiny_target, tmp_path):
    def pad_fraction(bucket_batches: int) -> float:
        td = _training_data(chat_file, tiny_tokenizer, tiny_target, tmp_path, pad_to_multiple_of=1)
        td.batches.bucket_batches = bucket_batches
        tokens = slots = 0
        for batch, _ in zip(td.batches.iterate(), range(len(td.batches))):
            tokens, slots = tokens + batch.num_tokens, slots + batch.input_ids.numel()
        return 1 - tokens / slots

    unbucketed, bucketed = pad_fraction(1), pad_fraction(64)
    assert bucketed < 0.5 * unbucketed, (bucketed, unbucketed)


def test_bucketed_batches_resume_and_slice_by_rank(chat_file, tiny_tokenizer, tiny_target, tmp_path):
    td = _training_data(chat_file, tiny_tokenizer, tiny_target, tmp_path, seq_len=96)
    per_pass = len(td.batches)
    run = [b for b, _ in zip(td.batches.iterate(), range(per_pass + 5))]
    assert run[per_pass].data_pass == 1 and run[per_pass].index == 0
    assert max(b.input_ids.shape[1] for b in run) == 96  # long conversations are truncated to seq_len
    resumed = [b for b, _ in zip(td.batches.iterate(1, 2), range(3))]
    for a, b in zip(run[per_pass + 2 :], resumed):
        assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.loss_mask, b.loss_mask)
    orders = [tuple(map(tuple, td.batches.pass_order(p))) for p in (0, 1)]
    assert orders[0] != orders[1]  # every pass is shuffled anew
    batch = run[0]
    parts = [rank_slice(batch, r, 2) for r in range(2)]
    assert torch.equal(torch.cat([p.input_ids for p in parts]), batch.input_ids)
    assert sum(p.num_tokens for p in parts) == batch.num_tokens == int(batch.lengths.sum())
    assert all(p.global_tokens == batch.num_tokens for p in parts)
