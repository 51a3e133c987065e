"""The target's argmax carried with its features (`target_next`): a feature store holds argmax(lm_head(last_hidden)),
and a loss without the KL given it computes no teacher logits, with the loss, gradients and train/sim_tau hits of
the teacher-logits path; a store built before it (no such field) still trains."""

from __future__ import annotations

import pytest
import torch
from conftest import compose_config
from safetensors.torch import load_file
from torch.utils.flop_counter import FlopCounterMode

from dflash.data.batches import Batch
from dflash.model import families
from dflash.model.build import build_drafter_config, init_drafter
from dflash.model.families import configure_family
from dflash.model.losses import dflash_loss
from dflash.model.target import TargetModel, greedy_tokens
from dflash.runner.feature_build import build_store
from dflash.train import trainer as trainer_module
from dflash.train.feature_store import StoreReader, StoreWriter
from dflash.train.trainer import DrafterTrainer, TargetForward

MASK = 3


def test_a_store_built_now_holds_the_targets_argmax(tmp_path, tiny_target, cache_dir):
    cfg = compose_config(
        ["experiment=smoke", f"model.target={tiny_target}", f"paths.cache_dir={cache_dir}", "features=store",
         f"features.path={tmp_path / 'store'}", "train.max_steps=3", "features.shard_batches=2"]
    )  # fmt: skip
    store = build_store(cfg)
    target = TargetModel.load(str(tiny_target), [1, 2])
    batches = 0
    for shard in sorted(store.glob("shard_*.safetensors")):
        tensors = load_file(shard)
        for i in range(len({k.split("/")[0] for k in tensors})):
            stored = tensors[f"{i}/target_next"]
            _, last_hidden = target.features(tensors[f"{i}/input_ids"])
            assert stored.dtype == torch.int32 and stored.shape == tensors[f"{i}/input_ids"].shape
            assert torch.equal(stored.long(), target.logits(last_hidden).argmax(-1))
            batches += 1
    assert batches == 3


def _loss_inputs(n=9, width=7, hidden=32, vocab=300):
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(vocab, hidden, generator=g)
    teacher = torch.randn(n, width, hidden, generator=g)
    draft = (teacher + 0.5 * torch.randn(n, width, hidden, generator=g)).requires_grad_(True)  # often the same argmax
    labels = torch.randint(0, vocab, (n, width), generator=g)
    valid = torch.rand(n, width, generator=g) > 0.2
    return draft, labels, valid, weight, teacher


@pytest.mark.parametrize("loss_name, kl_weight", [("ce_decay", 0.0), ("dpace", 0.0), ("kl", 0.5)])
def test_the_loss_given_the_argmax_skips_the_teacher_matmul_and_changes_nothing_else(loss_name, kl_weight):
    draft, labels, valid, weight, teacher = _loss_inputs()
    kw = dict(loss_name=loss_name, block_size=8, decay_gamma=None, kl_temperature=2.0, kl_weight=kl_weight,
              streak_alpha=0.5, teacher_hidden=teacher, chunk_size=5)  # fmt: skip
    runs = {}
    for name, extra in (("old", {}), ("new", {"target_next": greedy_tokens(teacher, weight)})):
        draft.grad = None
        with FlopCounterMode(display=False) as counter:
            out = dflash_loss(draft, labels, valid, weight, **kw, **extra)
        out.loss.backward()
        runs[name] = (out, draft.grad.clone(), counter.get_total_flops())
    (old, old_grad, old_flops), (new, new_grad, new_flops) = runs["old"], runs["new"]
    assert torch.equal(new.loss, old.loss) and torch.equal(new_grad, old_grad)
    assert torch.equal(new.loss_ce, old.loss_ce) and torch.equal(new.loss_kl, old.loss_kl)
    assert torch.equal(new.target_correct, old.target_correct) and old.target_correct.any()
    teacher_matmul = 2 * int(valid.sum()) * weight.shape[1] * weight.shape[0]
    assert old_flops - new_flops == (0 if loss_name == "kl" else teacher_matmul)  # the KL still needs the logits


@pytest.mark.parametrize("family, teacher_matmuls", [("dflash", 1), ("dflash2", 2)])
def test_a_store_item_with_the_argmax_trains_as_the_teacher_logits_did_and_an_old_one_still_trains(
    family, teacher_matmuls, tiny_dir, tmp_path, monkeypatch
):
    """Items of a store with target_next and of one built before it against the old path (the loss's own teacher
    logits): the same loss, gradients and sim_tau hits; the stored argmax saves every teacher matmul (DFlash2's
    selector has one too), an old store's item computes it once per distinct position its blocks read."""
    overrides = ["drafter.selector_rank=8", "drafter.selector_top_k=4"] if family == "dflash2" else []
    # 24 anchors' blocks of 3 drafted positions in 48 tokens overlap
    cfg = compose_config(["experiment=smoke", f"model.target={tiny_dir}", f"drafter={family}", "loss=ce_decay",
                          "train.num_anchors=24", *overrides])  # fmt: skip
    target = TargetModel.load(str(tiny_dir), [1, 2])
    config = build_drafter_config(target.model.config, cfg.model, [1, 2], MASK)
    configure_family(config, cfg.drafter)
    drafter = init_drafter(config, 0)
    ids = torch.randint(5, 500, (2, 48), generator=torch.Generator().manual_seed(0))
    batch = Batch(ids, torch.ones(2, 48, dtype=torch.bool), ids.numel(), 0, 0)
    online = TargetForward(target, torch.device("cpu"))(batch)
    items = {}
    for name, argmax in (("new", greedy_tokens(online.last_hidden, target.lm_head.weight)), ("old", None)):
        manifest = {"feature_version": 1, "model.target_layer_ids": [1, 2], "features.dtype": "float32"}
        writer = StoreWriter(tmp_path / name, manifest, 1)
        writer.add(batch, online.target_hidden, online.last_hidden, argmax)  # "old": what older builds wrote
        writer.commit(0)
        writer.close(1)
        items[name] = next(iter(StoreReader(tmp_path / name, (0, 0), torch.device("cpu"))))
    assert items["new"].target_next.dtype == torch.int32 and items["old"].target_next is None

    distinct = []
    greedy_at = families.greedy_tokens_at

    def counting(hidden, positions, valid, *args):  # records the positions computed once each
        flat = positions + hidden.shape[1] * torch.arange(positions.shape[0]).view(-1, 1, 1)
        distinct.append(int(flat[valid].unique().numel()))
        return greedy_at(hidden, positions, valid, *args)

    monkeypatch.setattr(families, "greedy_tokens_at", counting)
    trainer = DrafterTrainer(cfg, target, drafter, MASK, total_steps=10)

    def step(item):
        drafter.zero_grad(set_to_none=True)
        with FlopCounterMode(display=False) as counter:
            out = trainer.compute_loss(item, 0, 0.0)
        out.loss.backward()
        return out, [p.grad.clone() for p in drafter.parameters() if p.grad is not None], counter.get_total_flops()

    runs = {name: step(item) for name, item in items.items()}
    with monkeypatch.context() as m:  # the old path: no argmax given, the loss takes it from the teacher's logits
        m.setattr(trainer_module, "target_argmax", lambda *args: None)
        ref, ref_grads, ref_flops = step(items["old"])
    for out, grads, _ in runs.values():
        assert torch.equal(out.loss, ref.loss) and torch.equal(out.target_correct, ref.target_correct)
        assert len(grads) == len(ref_grads) and all(torch.equal(a, b) for a, b in zip(grads, ref_grads))
    valid = int(ref.valid.sum())
    head = 2 * target.hidden_size * target.vocab_size
    assert distinct and distinct[0] < valid  # overlapping blocks: fewer positions than drafted slots
    assert ref_flops - runs["new"][2] == teacher_matmuls * valid * head
    assert ref_flops - runs["old"][2] == (teacher_matmuls * valid - distinct[0]) * head
    assert trainer.train_on(items["old"]) and "train/sim_tau" in trainer.metrics()
