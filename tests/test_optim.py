"""The optim group: adamw (the default) and muon (Muon on the drafter's hidden matrices, AdamW on the rest),
each resumed bitwise from its checkpoint; the old train.betas / train.weight_decay keys refused or upgraded."""

from __future__ import annotations

import pytest
import torch
from conftest import REPO
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from dflash.core.config import ConfigError, register_configs
from dflash.core.validation import validate
from dflash.data.batches import Batch
from dflash.model.build import build_drafter_config
from dflash.model.drafter import DFlashDraftModel
from dflash.model.target import TargetModel
from dflash.train.checkpoint import load_checkpoint, save_checkpoint
from dflash.train.optimizers import split_for_muon
from dflash.train.trainer import DrafterTrainer, TargetForward

register_configs()


def _compose(overrides: list[str]):
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        return compose(config_name="config", overrides=overrides)


@pytest.fixture()
def parts(tiny_target, tiny_tokenizer):
    target = TargetModel.load(str(tiny_target), [1, 2])
    return target, tiny_tokenizer.mask_token_id


def _drafter(cfg, target, mask_id) -> DFlashDraftModel:
    torch.manual_seed(0)
    return DFlashDraftModel(build_drafter_config(target.model.config, cfg.model, [1, 2], mask_id))


def _item(target, seed: int):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, 500, (2, 64), generator=g)
    return TargetForward(target, torch.device("cpu"))(
        Batch(ids, torch.ones(2, 64, dtype=torch.bool), ids.numel(), 0, seed)
    )


def _cfg(tiny_target, optim: str, *more: str):
    return _compose(["experiment=smoke", f"model.target={tiny_target}", f"optim={optim}", "train.max_steps=100", *more])


def test_muon_takes_the_hidden_matrices_and_adamw_the_norms(parts, tiny_target):
    target, mask_id = parts
    cfg = _cfg(tiny_target, "muon")
    drafter = _drafter(cfg, target, mask_id)
    muon, adamw = split_for_muon(drafter)
    names = {id(p): n for n, p in drafter.named_parameters()}
    assert {names[id(p)] for p in muon} >= {
        "fc.weight",
        "layers.0.self_attn.q_proj.weight",
        "layers.0.mlp.down_proj.weight",
    }
    assert all(p.ndim == 2 for p in muon) and all(p.ndim == 1 for p in adamw)
    assert {names[id(p)] for p in adamw} >= {"norm.weight", "hidden_norm.weight", "layers.0.input_layernorm.weight"}
    muon, adamw = split_for_muon(drafter, ("fc",))
    assert "fc.weight" in {names[id(p)] for p in adamw} and "fc.weight" not in {names[id(p)] for p in muon}

    trainer = DrafterTrainer(cfg, target, drafter, mask_id, total_steps=100)
    assert set(trainer.optimizer.parts) == {"muon", "adamw"}
    assert isinstance(trainer.optimizer.parts["muon"], torch.optim.Muon)
    trainer.train_on(_item(target, 0))
    fc_state = trainer.optimizer.parts["muon"].state[drafter.fc.weight]
    assert set(fc_state) == {"momentum_buffer"}  # Muon's one buffer, not AdamW's two moments


def _family_drafter(tiny_dir, *overrides: str):
    from dflash.model.build import init_drafter
    from dflash.model.families import configure_family
    from dflash.model.target import load_target_config

    cfg = _compose(["experiment=smoke", f"model.target={tiny_dir}", "optim=muon", *overrides])
    config = build_drafter_config(load_target_config(str(tiny_dir)), cfg.model, [1, 2], 3)
    configure_family(config, cfg.drafter)
    return cfg, init_drafter(config, 0)


FAMILY_TABLES = {
    "dspark": ({"markov_head.markov_w1.weight", "markov_head.markov_w2.weight", "confidence_head.proj.weight"}, set()),
    "dspark_gated": (
        {"markov_head.markov_w1.weight", "markov_head.markov_w2.weight"},
        {"markov_head.gate_proj.weight"},
    ),
    "dspark_rnn": ({"markov_head.markov_w1.weight", "markov_head.markov_w2.weight"}, {"markov_head.joint_proj.weight"}),
    "dflash2": (
        {"candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook"},
        {"candidate_selector.hidden_projection.weight", "layers.0.attention_conv.kernel_projection.weight"},
    ),
}


@pytest.mark.parametrize("family", sorted(FAMILY_TABLES))
def test_muon_leaves_every_familys_vocabulary_tables_to_adamw(tiny_dir, family):
    """Muon takes hidden matrices by their role, not every 2-D parameter: DSpark's Markov head (an embedding over the
    vocabulary and a projection onto it), its confidence head's output layer and DFlash2's token codebooks are
    AdamW's; the families' hidden projections stay Muon's. No Muon parameter spans the vocabulary."""
    name, _, head = family.partition("_")
    cfg, drafter = _family_drafter(tiny_dir, f"drafter={name}", *([f"drafter.markov_head_type={head}"] if head else []))
    tables, hidden = FAMILY_TABLES[family]
    muon, adamw = split_for_muon(drafter)
    names = {id(p): n for n, p in drafter.named_parameters()}
    assert tables <= {names[id(p)] for p in adamw} and hidden <= {names[id(p)] for p in muon}
    vocab = drafter.config.vocab_size
    assert not [names[id(p)] for p in muon if vocab in p.shape]


def test_muon_leaves_the_markov_rows_of_unseen_tokens_as_they_were(tiny_dir):
    """A step under optim=muon moves the Markov embedding's rows of the tokens the batch conditioned on and no
    other (AdamW at weight decay 0; Muon's orthogonalised, decayed update moved every row)."""
    cfg, drafter = _family_drafter(tiny_dir, "drafter=dspark", "schedule.lr=0.01", "schedule.warmup_ratio=0")
    target = TargetModel.load(str(tiny_dir), [1, 2])
    trainer = DrafterTrainer(cfg, target, drafter, 3, total_steps=10)
    w1 = drafter.markov_head.markov_w1.weight
    before = w1.detach().clone()
    ids = torch.randint(5, 300, (2, 48), generator=torch.Generator().manual_seed(0))
    trainer.train_on(
        TargetForward(target, torch.device("cpu"))(Batch(ids, torch.ones(2, 48, dtype=torch.bool), 96, 0, 0))
    )
    moved = (w1.detach() != before).any(-1)
    assert moved[:300].any() and not moved[300:].any()


def test_a_checkpoint_of_another_muon_split_is_refused_naming_init_from(tiny_dir):
    """A DSpark run saved when Muon took its Markov tables holds a Muon state of more matrices than this run's:
    one error naming model.init_from, not torch's group-size error (optim.muon_exclude stands in for the old split)."""
    from dflash.train.optimizers import DrafterOptimizer

    cfg, drafter = _family_drafter(tiny_dir, "drafter=dspark")
    saved = DrafterOptimizer(drafter, OmegaConf.merge(cfg.optim, {"muon_exclude": ["fc"]}), lr=1e-3).state_dict()
    with pytest.raises(ConfigError, match="optimizer holds 11 parameters, this run.s 10: .* model.init_from=RUN_DIR"):
        DrafterOptimizer(drafter, cfg.optim, lr=1e-3).load_state_dict(saved)


def test_muon_trains_other_weights_than_adamw(parts, tiny_target):
    target, mask_id = parts
    after = {}
    for optim in ("adamw", "muon"):
        cfg = _cfg(tiny_target, optim)
        drafter = _drafter(cfg, target, mask_id)
        trainer = DrafterTrainer(cfg, target, drafter, mask_id, total_steps=100)
        for i in range(2):
            trainer.train_on(_item(target, i))
        after[optim] = drafter.fc.weight.detach().clone()
    assert not torch.equal(after["adamw"], after["muon"])


@pytest.mark.parametrize("optim", ["adamw", "muon"])
def test_resume_from_a_checkpoint_is_bitwise(parts, tiny_target, tmp_path, optim):
    """3 steps, checkpoint, 3 more == the checkpoint loaded into a new trainer, the same 3 steps: bitwise."""
    target, mask_id = parts
    cfg = _cfg(tiny_target, optim)
    drafter = _drafter(cfg, target, mask_id)
    trainer = DrafterTrainer(cfg, target, drafter, mask_id, total_steps=100)
    for i in range(3):
        trainer.train_on(_item(target, i))
    ckpt = save_checkpoint(tmp_path, drafter, trainer.state_dict(), {}, keep_last=1)
    for i in range(3, 6):
        trainer.train_on(_item(target, i))

    resumed_drafter = DFlashDraftModel(drafter.config)  # other initial weights: all come from the checkpoint
    resumed = DrafterTrainer(cfg, target, resumed_drafter, mask_id, total_steps=100)
    load_checkpoint(ckpt, resumed_drafter, resumed)
    assert resumed.step == 3
    for i in range(3, 6):
        resumed.train_on(_item(target, i))
    for k, v in drafter.state_dict().items():
        assert torch.equal(v, resumed_drafter.state_dict()[k]), k


def test_resumed_muon_takes_the_resumed_configs_hyperparameters(parts, tiny_target):
    target, mask_id = parts
    cfg = _cfg(tiny_target, "muon")
    drafter = _drafter(cfg, target, mask_id)
    trainer = DrafterTrainer(cfg, target, drafter, mask_id, total_steps=100)
    trainer.train_on(_item(target, 0))
    state = trainer.state_dict()
    cfg.optim.muon_weight_decay, cfg.optim.muon_momentum, cfg.optim.weight_decay = 0.02, 0.9, 0.3
    resumed = DrafterTrainer(cfg, target, drafter, mask_id, total_steps=100)
    resumed.load_state_dict(state)
    muon, adamw = resumed.optimizer.parts["muon"].param_groups[0], resumed.optimizer.parts["adamw"].param_groups[0]
    assert (muon["weight_decay"], muon["momentum"], adamw["weight_decay"]) == (0.02, 0.9, 0.3)
    assert resumed.optimizer.parts["muon"].state  # the momentum buffers themselves are restored


def test_a_checkpoint_of_another_optimizer_is_refused(parts, tiny_target):
    target, mask_id = parts
    states = {}
    for optim in ("adamw", "muon"):
        cfg = _cfg(tiny_target, optim)
        trainer = DrafterTrainer(cfg, target, _drafter(cfg, target, mask_id), mask_id, total_steps=100)
        trainer.train_on(_item(target, 0))
        states[optim] = (cfg, trainer.state_dict())
    cfg, _ = states["adamw"]
    adamw = DrafterTrainer(cfg, target, _drafter(cfg, target, mask_id), mask_id, total_steps=100)
    with pytest.raises(ConfigError, match="optim=muon's, this run's optimizer is optim=adamw: resume with optim=muon"):
        adamw.load_state_dict(states["muon"][1])


def test_lr_follows_the_schedule_and_muons_ratio(parts, tiny_target):
    target, mask_id = parts
    cfg = _cfg(tiny_target, "muon", "optim.muon_lr_ratio=10")
    trainer = DrafterTrainer(cfg, target, _drafter(cfg, target, mask_id), mask_id, total_steps=100)
    trainer.train_on(_item(target, 0))
    assert trainer.optimizer.parts["adamw"].param_groups[0]["lr"] == trainer.lr_for(0)
    assert trainer.optimizer.parts["muon"].param_groups[0]["lr"] == pytest.approx(10 * trainer.lr_for(0))


def test_the_old_train_keys_are_refused_naming_the_optim_group():
    for old, new in (("train.betas=[0.8,0.9]", "optim.betas"), ("train.weight_decay=0.1", "optim.weight_decay")):
        with pytest.raises(ConfigError, match=rf"{old.split('=')[0]}.*moved to the optim group: set {new}"):
            validate(_compose([old]))


@pytest.mark.parametrize("own_betas", [True, False])
def test_a_run_saved_before_the_optim_group_resumes_with_its_settings(tmp_path, own_betas):
    """It trained with AdamW: it resumes with AdamW whatever today's default optimizer is (muon)."""
    from dflash.runner.resume import resume_config

    run_dir = tmp_path / "old"
    run_dir.mkdir()
    saved = OmegaConf.to_container(_compose([]), resolve=True)
    saved.pop("optim")
    if own_betas:
        saved["train"]["betas"], saved["train"]["weight_decay"] = [0.8, 0.9], 0.05
    OmegaConf.save(OmegaConf.create(saved), run_dir / "config_resolved.yaml")
    current = _compose([f"resume={run_dir}"])
    assert current.optim.name == "muon"
    merged = resume_config(current, run_dir, [f"resume={run_dir}"])
    if own_betas:
        assert list(merged.optim.betas) == [0.8, 0.9] and merged.optim.weight_decay == 0.05
    assert merged.optim.name == "adamw" and merged.train.betas is None and merged.train.weight_decay is None
    validate(merged)
