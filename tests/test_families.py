"""Drafter families (drafter=dflash|dspark): composition, DSpark's blocks, heads and loss, its training, its
sequential proposal and lossless verification, the confidence calibration, and the export speculators loads."""

from __future__ import annotations

import re

import pytest
import torch
from conftest import compose_config, launch
from transformers import AutoConfig, AutoModelForCausalLM

from dflash.core.config import ConfigError
from dflash.core.validation import validate
from dflash.data.batches import Batch
from dflash.evaluation.calibration import confidence_calibration
from dflash.evaluation.decoding import DFlashProposer, speculative_generate
from dflash.model.blocks import build_training_blocks
from dflash.model.build import build_drafter_config, init_drafter
from dflash.model.families import configure_family, draft_slots, training_blocks
from dflash.model.families.dspark import DSparkDraftModel
from dflash.model.families.dspark_loss import dspark_loss
from dflash.model.target import TargetModel
from dflash.train.trainer import DrafterTrainer, TargetForward

MASK = 3


def _drafter(tiny_dir, *overrides: str, seed: int = 0):
    cfg = compose_config(["experiment=smoke", f"model.target={tiny_dir}", *overrides])
    config = build_drafter_config(AutoConfig.from_pretrained(tiny_dir), cfg.model, [1, 2], MASK)
    configure_family(config, cfg.drafter)
    return cfg, init_drafter(config, seed)


@pytest.mark.parametrize(
    "overrides, needle",
    [
        (["loss.tv_weight=1"], "loss.tv_weight=1.0 is invalid: the total-variation term is DSpark's"),
        (["loss.confidence_weight=0.5"], "drafter=dflash has no confidence head"),
        (["drafter=dspark", "drafter.confidence_head=false", "loss.confidence_weight=1"], "has no confidence head"),
        (["drafter=dspark", "drafter.markov_rank=0"], "drafter.confidence_head_with_markov=True is invalid"),
        (["drafter=dspark", "parallel=fsdp"], "parallel.name='fsdp' is invalid"),
        (["drafter=dspark", "loss.selector_weight=1"], "loss.selector_weight=1.0 is invalid: is DFlash2's"),
        (["drafter=dflash2", "drafter.conv_kernel_size=9"], "drafter.conv_kernel_size=9 is invalid"),
        (["drafter=dflash2", "loss.tv_weight=1"], "the total-variation term is DSpark's"),
        (["drafter=dflash2", "parallel=fsdp"], "parallel.name='fsdp' is invalid"),
        (["drafter=dspark", "drafter.markov_head_type=lstm"], "drafter.markov_head_type='lstm' is invalid"),
    ],
)
def test_a_wrong_family_combination_is_refused_naming_the_key(overrides, needle):
    with pytest.raises(ConfigError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        validate(compose_config(overrides))


def test_dspark_composes_with_every_loss_and_its_terms():
    for loss in ("ce_decay", "kl", "kl_streak", "dpace"):
        validate(compose_config(["drafter=dspark", f"loss={loss}", "loss.tv_weight=1", "loss.confidence_weight=0.5"]))
    assert compose_config([]).drafter.name == "dflash"  # the default is today's drafter


@pytest.mark.parametrize("family", ["dspark", "dflash2"])
def test_every_family_composes_with_replay_as_the_real_targets_sweep_runs_it(family):
    """#38's comparison on the real target: each family in the loss ablation's sweep, tau by eval.replay (its
    proposal rule replayed: tests/test_replay.py)."""
    cfg = compose_config(["experiment=smollm2_ablation_loss", f"drafter={family}", "loss=dpace", "train.seed=1"])
    validate(cfg)
    assert cfg.eval.replay and cfg.drafter.name == family


def test_anchor_sampling_runs_one_slot_fewer_with_dflash_labels(tiny_dir):
    _, drafter = _drafter(tiny_dir, "drafter=dspark", "drafter.markov_rank=8")
    B = drafter.block_size
    assert draft_slots(drafter) == B - 1 and drafter.first_drafted_slot == 0
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(5, 500, (2, 40), generator=g)
    mask = torch.rand(2, 40, generator=g) > 0.2
    anchors = torch.tensor([[0, 10, 36], [5, 20, 33]])
    valid = torch.tensor([[True, True, True], [True, False, True]])
    ours = training_blocks(drafter, ids, mask, anchors, valid, B, MASK, "sdpa")
    dflash = build_training_blocks(ids, mask, anchors, valid, B, MASK, "sdpa")
    assert ours.input_ids.shape == (2, 3 * (B - 1))  # [anchor, MASK x (B-2)] per block
    assert torch.equal(ours.input_ids.view(2, 3, B - 1), dflash.input_ids.view(2, 3, B)[:, :, : B - 1])
    # slot j predicts the token at anchor + j + 1: the labels, validity and teachers of DFlash's slots 1..B-1
    assert torch.equal(ours.labels, dflash.labels) and torch.equal(ours.label_valid, dflash.label_valid)
    assert torch.equal(ours.teacher_positions, dflash.teacher_positions)


def test_rnn_markov_factors_teacher_forced_equal_step_by_step(tiny_dir):
    _, drafter = _drafter(tiny_dir, "drafter=dspark", "drafter.markov_rank=8", "drafter.markov_head_type=rnn")
    prev, hidden = torch.randint(0, 500, (3, 5)), torch.randn(3, 5, 64)
    z, _ = drafter.head_outputs(hidden, prev)
    state = None
    for j in range(5):
        zj, state = drafter.markov_head.step(drafter.prev_embeddings(prev[:, j]), hidden[:, j], state)
        assert torch.allclose(z[:, j], zj)
    stateless = drafter.markov_head.step(drafter.prev_embeddings(prev[:, 1]), hidden[:, 1], None)[0]
    assert not torch.allclose(z[:, 1], stateless)  # the state carries the block's earlier positions


def _reference(h, labels, valid, W, z, w2, conf, teacher, tv_weight, conf_weight, gamma):
    """DSpark's loss on full logits with plain autograd (ce_decay weights), the chunked loss's reference."""
    s = h @ W.T + z @ w2.T
    ce = torch.nn.functional.cross_entropy(s.flatten(0, 1), labels.flatten(), reduction="none").view_as(labels)
    tv = 1 - torch.minimum(s.softmax(-1), (teacher @ W.T).softmax(-1)).sum(-1)
    decay = torch.exp(-torch.arange(labels.shape[1]) / gamma).expand_as(ce) * valid
    main = (decay * (ce + tv_weight * tv)).sum() / decay.sum()
    bce = torch.nn.functional.binary_cross_entropy_with_logits(conf, (1 - tv).detach(), reduction="none")
    return main + conf_weight * (decay * bce).sum() / decay.sum()


def test_dspark_loss_in_chunks_equals_the_full_logit_reference():
    g = torch.Generator().manual_seed(1)
    N, K, H, V, r = 4, 5, 16, 50, 6
    h = torch.randn(N, K, H, generator=g, requires_grad=True)
    z = torch.randn(N, K, r, generator=g, requires_grad=True)
    w2 = torch.randn(V, r, generator=g, requires_grad=True)
    conf = torch.randn(N, K, generator=g, requires_grad=True)
    W, teacher = torch.randn(V, H, generator=g), torch.randn(N, K, H, generator=g)
    labels, valid = torch.randint(0, V, (N, K), generator=g), torch.rand(N, K, generator=g) > 0.3
    out = dspark_loss(
        h, labels, valid, W, z, w2, conf, tv_weight=0.7, confidence_weight=0.4, loss_name="ce_decay", block_size=K + 1,
        decay_gamma=3.0, kl_temperature=1.0, kl_weight=0.0, streak_alpha=0.0, dpace_alpha=0.5, teacher_hidden=teacher,
        chunk_size=3,
    )  # fmt: skip
    ref = _reference(h, labels, valid, W, z, w2, conf, teacher, 0.7, 0.4, 3.0)
    assert torch.allclose(out.loss, ref, atol=1e-5)
    grads = torch.autograd.grad(out.loss, (h, z, w2, conf))
    for got, want in zip(grads, torch.autograd.grad(ref, (h, z, w2, conf))):
        assert torch.allclose(got, want, atol=1e-5)
    assert set(out.extra) == {"train/loss_tv", "train/loss_confidence"}


def test_dspark_training_trains_both_heads_and_reports_their_terms(tiny_dir):
    cfg, drafter = _drafter(tiny_dir, "drafter=dspark", "drafter.markov_rank=8", "loss.tv_weight=1", "schedule.lr=0.01")
    target = TargetModel.load(str(tiny_dir), [1, 2])
    before = {k: v.clone() for k, v in drafter.state_dict().items() if "head" in k}
    trainer = DrafterTrainer(cfg, target, drafter, MASK, total_steps=10)
    ids = torch.randint(5, 500, (2, 48), generator=torch.Generator().manual_seed(0))
    batch = Batch(ids, torch.ones(2, 48, dtype=torch.bool), ids.numel(), 0, 0)
    item = TargetForward(target, torch.device("cpu"))(batch)
    for _ in range(3):
        trainer.train_on(item)
    metrics = trainer.metrics()
    assert metrics["train/loss_tv"] > 0 and metrics["train/loss_confidence"] > 0
    moved = [k for k, v in drafter.state_dict().items() if k in before and not torch.equal(v, before[k])]
    assert sorted(moved) == sorted(before)  # markov_w1, markov_w2, the confidence projection


def test_dspark_proposer_chooses_sequentially_and_verification_stays_lossless(tiny_dir):
    _, drafter = _drafter(tiny_dir, "drafter=dspark", "drafter.markov_rank=8", "drafter.markov_head_type=rnn")
    with torch.no_grad():  # a strong bias, so the Markov head changes the drafts
        drafter.markov_head.markov_w2.weight.mul_(500.0)
    drafter.eval()
    target = AutoModelForCausalLM.from_pretrained(tiny_dir).eval()
    prompt = list(range(10, 30))
    with torch.no_grad():
        out = target(torch.tensor([prompt]), output_hidden_states=True)
    feats = torch.cat([out.hidden_states[i + 1] for i in (1, 2)], dim=-1)
    B = drafter.block_size
    proposer = DFlashProposer(drafter, target)
    drafts = proposer.propose(prompt, feats[:, :-1], B - 1)
    # by hand: one backbone forward of B - 1 slots, then argmax(base + bias(previous choice)) slot by slot
    fresh = DFlashProposer(drafter, target)
    hidden = fresh.block_hidden(prompt, feats[:, :-1], B - 1)
    base = hidden @ target.get_output_embeddings().weight.T
    prev, state, expect, no_markov = prompt[-1], None, [], base.argmax(-1).tolist()
    for j in range(B - 1):
        e = drafter.prev_embeddings(torch.tensor([prev]))
        z, state = drafter.markov_head.step(e, hidden[j : j + 1], state)
        prev = int((base[j] + (z @ drafter.markov_head.markov_w2.weight.T)[0]).argmax())
        expect.append(prev)
    assert drafts == expect and drafts != no_markov
    assert len(proposer.confidences) == 1 and len(proposer.confidences[0]) == B - 1
    spec = speculative_generate(target, drafter, prompt, 24, B)
    alone = speculative_generate(target, None, prompt, 24, 1)
    assert spec.tokens == alone.tokens
    assert spec.confidences is not None and len(spec.confidences) == spec.cycles


def test_confidence_calibration_counts_reached_positions():
    # two cycles of 3 drafts: accepted 1 draft (length 2), then all 3 (length 4)
    got = confidence_calibration([[[0.9, 0.5, 0.2], [0.8, 0.6, 0.4]]], [[2, 4]])
    assert got["eval/conf_pred_1"] == pytest.approx(0.85) and got["eval/conf_obs_1"] == 1.0
    assert got["eval/conf_pred_2"] == pytest.approx(0.55) and got["eval/conf_obs_2"] == 0.5
    # position 3 was reached only in the second cycle (the first stopped at position 2)
    assert got["eval/conf_pred_3"] == pytest.approx(0.4) and got["eval/conf_obs_3"] == 1.0
    assert got["eval/conf_error"] == pytest.approx((2 * 0.15 + 2 * 0.05 + 0.6) / 5)
    tau = ((1 + 0.9 + 0.45 + 0.09) + (1 + 0.8 + 0.48 + 0.192)) / 2
    assert got["eval/conf_tau_pred"] == pytest.approx(tau)
    assert confidence_calibration([], []) == {}


def test_an_untrained_dflash2_is_the_dflash_drafter(tiny_dir):
    """The convolutions start as the identity: with the backbone's weights, DFlash2's blocks equal DFlash's."""
    _, dflash = _drafter(tiny_dir)
    _, dflash2 = _drafter(tiny_dir, "drafter=dflash2", "drafter.selector_rank=8", "drafter.selector_top_k=4")
    missing, unexpected = dflash2.load_state_dict(dflash.state_dict(), strict=False)
    assert not unexpected and all("conv" in k or "selector" in k for k in missing)
    B, g = dflash.block_size, torch.Generator().manual_seed(0)
    noise, ctx = torch.randn(1, 2 * B, 64, generator=g), torch.randn(1, 10, 128, generator=g)
    pos = torch.cat([torch.arange(10), torch.arange(3, 3 + B), torch.arange(6, 6 + B)])[None]
    assert torch.allclose(dflash(noise, ctx, pos), dflash2(noise, ctx, pos), atol=1e-6)
    with torch.no_grad():  # a kernel that mixes slots changes a block's later slots only, never across blocks
        dflash2.layers[0].attention_conv.base_kernel[:, 1].fill_(0.5)
    moved = (dflash(noise, ctx, pos) - dflash2(noise, ctx, pos)).abs().amax(-1)[0]
    assert moved.view(2, B)[:, 1:].min() > 0


def test_dflash2_trains_its_convolutions_and_selector(tiny_dir):
    overrides = ("drafter=dflash2", "drafter.selector_rank=8", "drafter.selector_top_k=4", "schedule.lr=0.01")
    cfg, drafter = _drafter(tiny_dir, *overrides)
    target = TargetModel.load(str(tiny_dir), [1, 2])
    before = {k: v.clone() for k, v in drafter.state_dict().items() if "conv" in k or "selector" in k}
    trainer = DrafterTrainer(cfg, target, drafter, MASK, total_steps=10)
    ids = torch.randint(5, 500, (2, 48), generator=torch.Generator().manual_seed(0))
    item = TargetForward(target, torch.device("cpu"))(
        Batch(ids, torch.ones(2, 48, dtype=torch.bool), ids.numel(), 0, 0)
    )
    for _ in range(3):
        trainer.train_on(item)
    assert trainer.metrics()["train/loss_selector"] > 0
    moved = {k for k, v in drafter.state_dict().items() if k in before and not torch.equal(v, before[k])}
    assert moved == set(before)


def test_dflash2_chooses_a_greedy_path_through_the_top_k_and_stays_lossless(tiny_dir):
    _, drafter = _drafter(tiny_dir, "drafter=dflash2", "drafter.selector_rank=8", "drafter.selector_top_k=4")
    with torch.no_grad():  # strong transitions, so the selector changes the unary argmax
        drafter.candidate_selector.predecessor_codebook.mul_(2000.0)
        drafter.candidate_selector.successor_codebook.mul_(100.0)
    drafter.eval()
    target = AutoModelForCausalLM.from_pretrained(tiny_dir).eval()
    prompt = list(range(10, 30))
    with torch.no_grad():
        out = target(torch.tensor([prompt]), output_hidden_states=True)
    feats = torch.cat([out.hidden_states[i + 1] for i in (1, 2)], dim=-1)[:, :-1]
    B = drafter.block_size
    drafts = DFlashProposer(drafter, target).propose(prompt, feats, B - 1)
    hidden = DFlashProposer(drafter, target).block_hidden(prompt, feats, B)[1:]
    unary = hidden @ target.get_output_embeddings().weight.T
    prev, expect = prompt[-1], []
    for j in range(B - 1):
        cands = unary[j].topk(4).indices
        score = unary[j, cands] + drafter.candidate_selector.transition(hidden[j], torch.tensor(prev), cands)
        prev = int(cands[score.argmax()])
        expect.append(prev)
    assert drafts == expect and drafts != unary.argmax(-1).tolist()
    assert all(d in unary[j].topk(4).indices.tolist() for j, d in enumerate(drafts))
    assert (
        speculative_generate(target, drafter, prompt, 24, B).tokens
        == speculative_generate(target, None, prompt, 24, 1).tokens
    )


@pytest.mark.parametrize("head", ["vanilla", "gated", "rnn"])
def test_dspark_export_loads_with_speculators_own_classes(tiny_dir, tmp_path, head):
    pytest.importorskip("speculators", reason="the test-only install: pip install --no-deps speculators==0.9.0 ...")
    from speculators import SpeculatorModel

    from dflash.model.export import export_drafter, load_drafter

    _, drafter = _drafter(tiny_dir, "drafter=dspark", "drafter.markov_rank=8", f"drafter.markov_head_type={head}")
    export_drafter(drafter, tmp_path / "out", target=str(tiny_dir))
    theirs = SpeculatorModel.from_pretrained(str(tmp_path / "out"))
    assert type(theirs).__name__ == "DSparkDraftModel" and theirs.config.speculators_model_type == "dspark"
    assert theirs.config.aux_hidden_state_layer_ids == [2, 3]  # HF hidden_states indices of target layers 1, 2
    assert theirs.config.block_size == drafter.block_size - 1  # sample_from_anchor: B - 1 slots draft B - 1 tokens
    assert theirs.config.speculators_config.proposal_methods[0].speculative_tokens == drafter.block_size - 1
    their_state = theirs.state_dict()
    for key, value in drafter.state_dict().items():
        assert torch.equal(their_state[key], value), key
    prev, hidden = torch.randint(0, 500, (2, 3)), torch.randn(2, 3, 64)
    z, conf = drafter.head_outputs(hidden, prev)
    bias = theirs.markov_head.block_bias(prev_token_ids=prev, hidden_states=hidden)
    assert torch.allclose(bias, z @ drafter.markov_head.markov_w2.weight.T, atol=1e-6)
    their_conf = theirs.confidence_head(torch.cat([hidden, theirs.markov_head.prev_embeddings(prev)], dim=-1))
    assert torch.allclose(their_conf, conf, atol=1e-6)
    back = load_drafter(tmp_path / "out")  # and ours reads it back (python -m dflash.evaluate)
    assert isinstance(back, DSparkDraftModel) and back.config.dflash_config == drafter.config.dflash_config
    assert all(torch.equal(a, b) for a, b in zip(back.state_dict().values(), drafter.state_dict().values()))


def test_cost_per_draft_cycle_counts_the_heads_and_prints_every_family(capsys):
    from dflash.benchmarks.families import _drafter, _options, bench, proposal_flops

    opts = _options(["hidden=64", "vocab=500", "layers=1", "heads=2", "kv_heads=1", "head_dim=32",
                     "intermediate=128", "block=4", "ctx=8", "rank=8"])  # fmt: skip
    dflash, rnn = _drafter(opts, "dflash", None), _drafter(opts, "dspark", "rnn")
    layer = sum(p.numel() for p in dflash.layers.parameters())
    backbone = lambda slots: 2 * layer * slots + 4 * 2 * 32 * slots * (8 + slots)  # noqa: E731
    assert proposal_flops(dflash, opts) == backbone(4) + 2 * 64 * 500 * 3
    # sample_from_anchor: one slot fewer; the bias, the rnn's joint projection and the confidence head per draft
    markov = 2 * 8 * 500 * 3 + 2 * (2 * 8 + 64) * 3 * 8 * 3 + 2 * (64 + 8) * 3
    assert proposal_flops(rnn, opts) == backbone(3) + 2 * 64 * 500 * 3 + markov
    dflash2 = _drafter(opts, "dflash2", None)  # group 16: 4 groups; 2 taps; selector rank 8, top 16
    conv = 2 * (2 * 64 * 2 * 2 * 4) * 4 + 2 * 2 * 2 * 2 * 64 * 4
    selector = (2 * 64 + 1 + 2 * 16) * 8 * 3
    assert proposal_flops(dflash2, opts) == backbone(4) + 2 * 64 * 500 * 3 + conv + selector
    bench(["hidden=64", "vocab=500", "layers=1", "heads=2", "kv_heads=1", "head_dim=32", "intermediate=128",
           "block=4", "ctx=8", "rank=8", "repeats=1", "warmup=0"])  # fmt: skip
    rows = capsys.readouterr().out.splitlines()[2:]
    assert [r.split()[0] for r in rows] == ["dflash", "dspark/vanilla", "dspark/gated", "dspark/rnn", "dflash2"]


def test_cost_per_draft_cycle_with_a_target_gives_each_family_its_break_even_tau(capsys):
    from dflash.benchmarks.families import bench

    bench(["hidden=64", "vocab=500", "layers=1", "heads=2", "kv_heads=1", "head_dim=32", "intermediate=128",
           "block=4", "ctx=8", "rank=8", "repeats=1", "warmup=0", "target_layers=2"])  # fmt: skip
    out = capsys.readouterr().out.splitlines()
    assert out[1].split()[-2:] == ["break-even", "tau"]
    step, verify = (float(x) for x in re.findall(r"decode step ([\d.]+) ms, verify forward of 4 tokens ([\d.]+) ms",
                                                 out[-1])[0])  # fmt: skip
    for row in out[2:7]:  # (verify + proposal) / decode step, from the printed latencies (2 decimals)
        ms, even = float(row.split()[-3]), float(row.split()[-1])
        assert abs(even - (verify + ms) / step) < 0.01 + 0.01 * even


@pytest.mark.slow
def test_a_sweep_over_families_is_one_multirun(tmp_path, cache_dir):
    import json

    launch(
        ["-m", "experiment=smoke", "drafter=dflash,dspark,dflash2", "train.seed=0,1", "drafter.markov_rank=8",
         "drafter.selector_rank=8", "eval.baselines=false", f"hydra.sweep.dir={tmp_path}"],
        cache_dir, timeout=1200, check=True,
    )  # fmt: skip
    jobs = sorted(p for p in tmp_path.iterdir() if p.is_dir() and (p / "summary.json").exists())
    layouts = []
    for job in jobs:
        summary = json.loads((job / "summary.json").read_text())
        family = json.loads((job / "drafter" / "config.json").read_text()).get("speculators_model_type", "dflash")
        layouts.append(family)  # dflash: z-lab's layout, the others speculators'
        assert summary["status"] == "completed" and summary["eval/lossless"] == 1.0
        assert ("train/loss_tv" in summary) == ("eval/conf_error" in summary) == (family == "dspark")
        assert ("train/loss_selector" in summary) == (family == "dflash2")
    assert sorted(layouts) == ["dflash", "dflash", "dflash2", "dflash2", "dspark", "dspark"]


def test_a_resume_keeps_the_drafter_family(tmp_path):
    from omegaconf import OmegaConf

    from dflash.runner.resume import resume_config

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    OmegaConf.save(compose_config(["drafter=dspark"]), run_dir / "config_resolved.yaml")
    for change in ("drafter=dflash", "drafter.markov_head_type=rnn"):
        with pytest.raises(ConfigError, match="would change the drafter family or its heads"):
            resume_config(compose_config([f"resume={run_dir}", change]), run_dir, [f"resume={run_dir}", change])
    merged = resume_config(compose_config([f"resume={run_dir}"]), run_dir, [f"resume={run_dir}"])
    assert merged.drafter.name == "dspark"  # the saved run's family, not the default's


def test_dflash2_export_loads_with_speculators_own_classes(tiny_dir, tmp_path):
    pytest.importorskip("speculators", reason="the test-only install: pip install --no-deps speculators==0.9.0 ...")
    from speculators import SpeculatorModel
    from speculators.models.dflash2.model_definitions import grouped_dynamic_conv

    from dflash.model.export import export_drafter, load_drafter
    from dflash.model.families.dflash2 import block_conv

    _, drafter = _drafter(tiny_dir, "drafter=dflash2", "drafter.selector_rank=8", "drafter.selector_top_k=4")
    with torch.no_grad():  # weights that are not the identity init, so the comparison means something
        for name, param in drafter.named_parameters():
            if "conv" in name or "selector" in name:
                param.normal_(generator=torch.Generator().manual_seed(len(name)))
    export_drafter(drafter, tmp_path / "out", target=str(tiny_dir))
    theirs = SpeculatorModel.from_pretrained(str(tmp_path / "out"))
    assert type(theirs).__name__ == "DFlash2DraftModel" and theirs.config.speculators_model_type == "dflash2"
    assert theirs.config.block_size == drafter.block_size and not theirs.config.sample_from_anchor
    assert theirs.config.speculators_config.proposal_methods[0].speculative_tokens == drafter.block_size - 1
    their_state = theirs.state_dict()
    for key, value in drafter.state_dict().items():
        assert torch.equal(their_state[key], value), key
    g = torch.Generator().manual_seed(0)
    x, delta, base = torch.randn(2, 12, 64, generator=g), torch.randn(2, 12, 2, 4, generator=g), torch.randn(2, 64)
    assert torch.allclose(
        grouped_dynamic_conv(x, delta, base, block_size=4, group_size=16), block_conv(x, delta, base, 4, 16)
    )
    h, prev, cands = torch.randn(5, 64, generator=g), torch.randint(0, 500, (5,)), torch.randint(0, 500, (5, 4))
    ours = drafter.candidate_selector.transition(h, prev, cands)
    assert torch.allclose(theirs.candidate_selector.transition_scores(h, prev, cands), ours, atol=1e-6)
    back = load_drafter(tmp_path / "out")
    assert type(back) is type(drafter) and back.config.dflash2_config == drafter.config.dflash2_config
    assert all(torch.equal(a, b) for a, b in zip(back.state_dict().values(), drafter.state_dict().values()))


def test_a_block_size_the_family_cannot_run_is_refused_naming_both_sizes(tiny_dir, tmp_path, capsys):
    """DFlash2's convolutions span its training block: evaluate and benchmark refuse another size (a block of 8 at
    size 4 ran as two blocks of 4), naming both, before the target loads; DFlash and DSpark run at any size."""
    from dflash.cli.benchmark import main as benchmark_main
    from dflash.evaluation.cli import main as evaluate_main
    from dflash.evaluation.evaluator import evaluate
    from dflash.model.export import export_drafter

    _, drafter = _drafter(tiny_dir, "drafter=dflash2", "drafter.selector_rank=8", "drafter.selector_top_k=4")
    export_drafter(drafter, tmp_path / "dflash2", target=str(tiny_dir))
    args = ["--block-size", "8", "--device", "cpu"]
    assert evaluate_main([str(tmp_path / "dflash2"), *args, "--out", str(tmp_path / "e.json")]) == 2
    assert benchmark_main([str(tmp_path / "dflash2"), *args, "--out", str(tmp_path / "bench")]) == 2
    errors = capsys.readouterr().err.splitlines()
    assert len(errors) == 2 and all("block size 8" in e and "trained at block size 4" in e for e in errors)
    assert not (tmp_path / "e.json").exists() and not (tmp_path / "bench").exists()
    target = AutoModelForCausalLM.from_pretrained(tiny_dir)
    with pytest.raises(ValueError, match="block size 2 cannot run this drafter=dflash2 drafter: it was trained at"):
        evaluate(target, drafter, [[5, 6, 7]], max_new_tokens=4, block_size=2, baselines=False)
    for family in ("dflash", "dspark"):
        _, other = _drafter(tiny_dir, f"drafter={family}")
        out = evaluate(target, other, [[5, 6, 7]], max_new_tokens=8, block_size=6, baselines=False)
        assert out["eval/cycles"] > 0 and max(out["details"]["prompts"][0]["accept_lengths"]) <= 6
