"""model.draft_vocab_size (dflash/model/draft_vocab.py, data/label_counts.py, runner/draft_vocab.py): speculators
0.9.0's maps built as its own code builds them, the drafter's frozen head of the target's rows, the loss over the
draft vocabulary (labels outside it replaced by the target's best token inside, as speculators' CE label; their
share reported), decoding in target ids, the export in speculators' layout loaded by its own class with its maps, and
z-lab's layout refusing it in one line."""

from __future__ import annotations

import pytest
import torch
from conftest import compose_config
from transformers import AutoConfig

from dflash.core.config import ConfigError
from dflash.data.label_counts import cache_file, cached, count_labels
from dflash.model.build import build_drafter_config, init_drafter
from dflash.model.draft_vocab import (
    OOV_METRIC,
    attach,
    build_maps,
    coverage,
    decoding_head,
    draft_targets,
    target_ids,
    to_draft_ids,
)
from dflash.model.families import configure_family, family_loss
from dflash.model.losses import dflash_loss_naive

MASK = 3
V = 512


def _drafter(tiny_dir, n=64, *overrides):
    cfg = compose_config(["experiment=smoke", f"model.target={tiny_dir}", f"model.draft_vocab_size={n}", *overrides])
    config = build_drafter_config(AutoConfig.from_pretrained(tiny_dir), cfg.model, [1, 2], MASK)
    configure_family(config, cfg.drafter)
    return init_drafter(config, 0), cfg


def _counts(seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 50, (V,), generator=g) * (torch.rand(V, generator=g) < 0.5)


def test_maps_are_speculators_own():
    from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution

    counts = _counts()
    freq = {i: int(c) for i, c in enumerate(counts.tolist()) if c}
    for n in (8, 100, 400):  # 400: more than the tokens seen, topped up with the lowest unused ids
        want_d2t, want_t2d = build_vocab_mappings_from_distribution(freq, n, V)
        d2t, t2d = build_maps(counts, n)
        assert torch.equal(d2t, want_d2t) and torch.equal(t2d, want_t2d)
    d2t, t2d = build_maps(counts, 100)
    assert coverage(counts, t2d) == pytest.approx(float(counts[t2d].sum()) / float(counts.sum()))
    with pytest.raises(ValueError, match="draft_vocab_size=512"):
        build_maps(counts, V)


def test_the_drafter_holds_the_maps_and_a_frozen_head_of_the_target_rows(tiny_dir):
    drafter, _ = _drafter(tiny_dir)
    assert drafter.t2d.shape == (V,) and drafter.d2t.shape == (64,) and drafter.lm_head.weight.shape == (64, 64)
    assert not drafter.lm_head.weight.requires_grad  # frozen, as speculators' lm_head
    head = torch.randn(V, 64)
    d2t, t2d = build_maps(_counts(), 64)
    attach(drafter, d2t, t2d, head)
    ids = target_ids(drafter)
    assert torch.equal(ids, t2d.nonzero().squeeze(-1)) and torch.equal(drafter.lm_head.weight, head[ids])
    assert torch.equal(to_draft_ids(drafter, ids), torch.arange(64))
    outside = (~t2d).nonzero()[0]
    assert int(to_draft_ids(drafter, outside)) == -1
    # decoding: target-vocabulary logits, -inf outside; the argmax a target id inside
    target_head = torch.nn.Linear(64, V, bias=False)
    target_head.weight.data.copy_(head)
    h = torch.randn(5, 64)
    logits = decoding_head(drafter, target_head)(h)
    assert logits.shape == (5, V) and torch.isinf(logits[:, ~t2d]).all()
    assert torch.equal(logits.argmax(-1), ids[(h @ head[ids].T).argmax(-1)])
    assert decoding_head(init_drafter(_drafter(tiny_dir)[0].config, 0), target_head) is not target_head


def test_the_loss_runs_over_the_draft_vocabulary_and_reports_labels_outside(tiny_dir):
    drafter, cfg = _drafter(tiny_dir, 32)
    head = torch.randn(V, 64)
    d2t, t2d = build_maps(_counts(), 32)
    attach(drafter, d2t, t2d, head)
    ids = target_ids(drafter)
    g = torch.Generator().manual_seed(1)
    n, B = 6, cfg.model.block_size
    labels = ids[torch.randint(0, 32, (n, B - 1), generator=g)]
    outside_ids = (~t2d).nonzero().squeeze(-1)
    labels[0, 0], labels[2, 1] = outside_ids[0], outside_ids[5]  # two labels outside the draft vocabulary
    valid = torch.ones(n, B - 1, dtype=torch.bool)
    valid[5] = False
    teacher = torch.randn(n, B - 1, 64, generator=g)
    draft = torch.randn(n, B - 1, 64, generator=g, requires_grad=True)
    draft_ids, _, outside, share = draft_targets(drafter, labels, valid, teacher, head[ids], None)
    # a label outside: the target's best token inside the draft vocabulary (speculators' CE label)
    assert int(draft_ids[0, 0]) == int((teacher[0, 0] @ head[ids].T).argmax())
    assert outside.sum() == 2 and float(share) == pytest.approx(2 / valid.sum().item())
    for name, kl_weight in (("ce_decay", 0.0), ("kl", 0.5), ("dpace", 0.3)):
        loss_cfg = compose_config(["experiment=smoke", f"loss={name}", f"loss.kl_weight={kl_weight}"]).loss
        blocks = type("Blocks", (), {"labels": labels, "label_valid": valid})()
        out = family_loss(drafter, draft, blocks, None, teacher, head, loss_cfg, B)
        ref = dflash_loss_naive(  # the same maths on the draft rows: a KL against the restricted, renormalised target
            draft, draft_ids, valid, head[ids], loss_name=name, block_size=B, decay_gamma=loss_cfg.decay_gamma,
            kl_temperature=loss_cfg.kl_temperature, kl_weight=kl_weight, streak_alpha=loss_cfg.streak_alpha,
            teacher_hidden=teacher, dpace_alpha=loss_cfg.dpace_alpha,
        )  # fmt: skip
        assert torch.allclose(out.loss, ref.loss, atol=1e-5) and torch.allclose(out.loss_kl, ref.loss_kl, atol=1e-5)
        assert not out.correct[0, 0] and not out.correct[2, 1]  # no hit where the drafter cannot say the label
        assert float(out.extra[OOV_METRIC]) == pytest.approx(2 / valid.sum().item())


def test_the_target_argmax_outside_the_vocabulary_is_never_a_hit(tiny_dir):
    drafter, cfg = _drafter(tiny_dir, 32)
    head = torch.randn(V, 64)
    d2t, t2d = build_maps(_counts(), 32)
    attach(drafter, d2t, t2d, head)
    labels = target_ids(drafter)[:3].view(1, 3)
    nxt = torch.tensor([[int((~t2d).nonzero()[0]), int(labels[0, 1]), -1]])
    _, draft_next, _, _ = draft_targets(drafter, labels, torch.ones(1, 3, dtype=torch.bool), torch.randn(1, 3, 64),
                                        head[target_ids(drafter)], nxt)  # fmt: skip
    assert draft_next.tolist() == [[-1, 1, -1]]


def test_counts_are_the_supervised_tokens_of_one_pass_and_cached(tmp_path):
    class Batches:
        def __len__(self):
            return 2

        def iterate(self):
            from types import SimpleNamespace

            for i in range(100):
                ids = torch.tensor([[1, 2, 2, i]])
                yield SimpleNamespace(input_ids=ids, loss_mask=torch.tensor([[False, True, True, True]]))

    counts = count_labels(Batches(), 8)
    assert counts.tolist() == [1, 1, 4, 0, 0, 0, 0, 0]  # rows 0 and 1 only; the first token unsupervised
    path = cache_file(tmp_path, {"files": "x"}, {"seq_len": 4}, 4)
    assert (
        path
        != cache_file(tmp_path, {"files": "y"}, {"seq_len": 4}, 4)
        != cache_file(tmp_path, {"files": "x"}, {"seq_len": 4}, 5)
    )
    calls = []
    assert cached(path, lambda: calls.append(1) or {"counts": counts})["counts"].tolist() == counts.tolist()
    cached(path, lambda: calls.append(1) or {})
    assert calls == [1]  # counted once


def test_dflash2_refuses_and_the_size_must_be_below_the_vocabulary(tiny_dir):
    from dflash.core.validation import validate

    cfg = compose_config(["experiment=smoke", "drafter=dflash2", "model.draft_vocab_size=8"])
    with pytest.raises(ConfigError, match="dflash2 needs the full vocabulary"):
        validate(cfg)
    with pytest.raises(ConfigError, match="below the target's vocabulary of 512"):
        _drafter(tiny_dir, V)


def test_dspark_with_a_draft_vocabulary_drafts_target_ids(tiny_dir):
    drafter, _ = _drafter(tiny_dir, 32, "drafter=dspark")
    assert drafter.markov_head.markov_w2.weight.shape[0] == 32  # W2 onto the draft vocabulary, as speculators'
    head = torch.randn(V, 64)
    d2t, t2d = build_maps(_counts(), 32)
    attach(drafter, d2t, t2d, head)
    target_head = torch.nn.Linear(64, V, bias=False)
    target_head.weight.data.copy_(head)
    drafts, _ = drafter.choose_drafts(torch.randn(drafter.block_size, 64), decoding_head(drafter, target_head), 5)
    assert all(bool(t2d[d]) for d in drafts)


def test_export_speculators_layout_loads_in_speculators_with_its_maps_and_zlab_refuses(tiny_dir, tmp_path):
    from speculators import SpeculatorModel

    from dflash.model.export import export_drafter, load_drafter

    drafter, _ = _drafter(tiny_dir, 64)
    head = torch.randn(V, 64)
    d2t, t2d = build_maps(_counts(), 64)
    attach(drafter, d2t, t2d, head)
    with pytest.raises(ValueError, match="z-lab's layout uses the target's LM head") as e:
        export_drafter(drafter, tmp_path / "zlab", target=str(tiny_dir), layout="zlab")
    assert "\n" not in str(e.value)
    out = export_drafter(drafter, tmp_path / "spec", target=str(tiny_dir))  # auto: speculators' layout
    theirs = SpeculatorModel.from_pretrained(str(out))
    assert theirs.config.draft_vocab_size == 64 and theirs.use_draft_vocab
    assert torch.equal(theirs.t2d, t2d) and torch.equal(theirs.d2t, d2t)
    assert torch.equal(theirs.lm_head.weight, head[target_ids(drafter)])
    back = load_drafter(out)  # and ours reads it back with its maps
    assert torch.equal(back.d2t, d2t) and torch.equal(back.lm_head.weight, drafter.lm_head.weight)


@pytest.mark.slow
def test_the_smoke_with_a_draft_vocabulary_is_lossless_exports_to_speculators_and_inits_another(
    tmp_path, cache_dir, tiny_target
):
    """The issue's done-when: `experiment=smoke model.draft_vocab_size=256` completes with eval/lossless 1.0, its
    export (speculators' layout) loads in speculators 0.9.0 with its maps, and z-lab's layout refuses it in one line;
    a resume keeps them, and model.init_from of its run starts another from the same maps."""
    import json
    import subprocess
    import sys

    from conftest import REPO, launch
    from safetensors.torch import load_file
    from speculators import SpeculatorModel

    run = tmp_path / "run"
    launch(["experiment=smoke", "model.draft_vocab_size=256", f"hydra.run.dir={run}"], cache_dir, check=True)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["eval/lossless"] == 1.0
    info = json.loads((run / "run.json").read_text())["draft_vocab"]
    assert info["size"] == 256 and 0 < info["coverage"] <= 1
    weights = load_file(str(run / "drafter" / "model.safetensors"))
    theirs = SpeculatorModel.from_pretrained(str(run / "drafter"))
    assert theirs.config.draft_vocab_size == 256 and theirs.use_draft_vocab
    assert torch.equal(theirs.t2d, weights["t2d"]) and torch.equal(theirs.d2t, weights["d2t"])
    assert int(theirs.t2d.sum()) == 256 and "draft vocabulary of 256" in (run / "drafter" / "README.md").read_text()
    cmd = [sys.executable, "-m", "dflash.export", str(run), str(tmp_path / "zlab"), "--layout", "zlab"]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=300)
    assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0
    assert "z-lab's layout uses the target's LM head" in proc.stderr
    launch([f"resume={run}", "train.max_steps=9"], cache_dir, check=True)  # the checkpoint carries the maps
    assert json.loads((run / "summary.json").read_text())["step"] == 9
    resumed = load_file(str(run / "drafter" / "model.safetensors"))
    assert torch.equal(resumed["d2t"], weights["d2t"]) and torch.equal(resumed["t2d"], weights["t2d"])
    weights = resumed
    other = tmp_path / "other"
    launch(["experiment=smoke", "model.draft_vocab_size=256", f"model.init_from={run}", "eval.num_prompts=0",
            f"hydra.run.dir={other}"], cache_dir, check=True)  # fmt: skip
    again = load_file(str(other / "drafter" / "model.safetensors"))
    assert torch.equal(again["d2t"], weights["d2t"]) and torch.equal(again["lm_head.weight"], weights["lm_head.weight"])


@pytest.mark.slow
@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_two_ranks_train_a_draft_vocabulary_like_one_rank(parallel, tmp_path, cache_dir, tiny_target):
    """2 ranks x 2 sequences = 1 rank x 4 with model.draft_vocab_size (labels outside it included): the same maps and
    weights up to round-off, the same loss and share of labels outside (ranks' shares over the global count)."""
    import json

    from conftest import launch
    from test_distributed import SMALL, torchrun
    from test_distributed import weights as run_weights

    common = [*SMALL, "train.max_steps=6", "pipeline.monitor_interval_s=1000", "model.draft_vocab_size=8"]
    one, two = tmp_path / "one", tmp_path / "two"
    launch([*common, f"hydra.run.dir={one}"], cache_dir, check=True)
    torchrun([*common, f"parallel={parallel}", "parallel.backend=gloo", f"hydra.run.dir={two}"], cache_dir, check=True)
    a, b = run_weights(one), run_weights(two)
    assert set(a) == set(b) and torch.equal(a["t2d"], b["t2d"]) and torch.equal(a["d2t"], b["d2t"])
    assert max((a[k] - b[k]).abs().max().item() for k in a if a[k].is_floating_point()) < 1e-5
    sa, sb = (json.loads((d / "summary.json").read_text()) for d in (one, two))
    assert sb["train/loss"] == pytest.approx(sa["train/loss"], rel=1e-5)
    rows = [json.loads(line) for line in (two / "metrics.jsonl").read_text().splitlines()]
    shares = [r["train/oov_labels"] for r in rows if "train/oov_labels" in r]
    ref = [json.loads(line)["train/oov_labels"] for line in (one / "metrics.jsonl").read_text().splitlines()
           if "train/oov_labels" in line]  # fmt: skip
    assert shares and shares[-1] == pytest.approx(ref[-1], rel=1e-6) and 0 < ref[-1] < 1


@pytest.mark.slow
def test_under_target_labels_the_store_s_labels_are_counted_and_all_fall_inside(tmp_path, cache_dir, tiny_target):
    """loss.labels=target with a feature store: the maps are counted from the target's argmax labels the store
    holds (not the text's supervised tokens), so a draft vocabulary as large as the distinct labels the run reads
    leaves none outside (train/oov_labels 0 at every step), which the text's counts of that size would not."""
    import json

    from conftest import launch
    from test_run import read_jsonl

    from dflash.runner.draft_vocab import TARGET
    from dflash.train.feature_store import target_label_counts

    store = tmp_path / "store"
    common = ["experiment=smoke", "features=store", "features.build_missing=true", f"features.path={store}",
              "loss.labels=target", "train.max_steps=6", "eval.num_prompts=0", "checkpoint.every_steps=0",
              "data.regenerate.enabled=false"]  # fmt: skip
    launch([*common, "model.draft_vocab_size=256", f"hydra.run.dir={tmp_path / 'first'}"], cache_dir, check=True)
    labels = target_label_counts(store, V, 6)
    distinct = int((labels > 0).sum())
    run = tmp_path / "run"
    launch([*common, f"model.draft_vocab_size={distinct}", f"hydra.run.dir={run}"], cache_dir, check=True)
    info = json.loads((run / "run.json").read_text())["draft_vocab"]
    assert info["counted"] == TARGET and info["labels_counted"] == int(labels.sum()) and info["coverage"] == 1.0
    steps = [r for r in read_jsonl(run / "metrics.jsonl") if OOV_METRIC in r]
    assert steps and all(r[OOV_METRIC] == 0.0 for r in steps), [r[OOV_METRIC] for r in steps]
    text = _stored_text_counts(store, 6)  # the old rule's counts: the text's supervised tokens of those batches
    assert float(labels[text.topk(distinct).indices].sum()) < float(labels.sum())  # would leave some outside


def _stored_text_counts(store, batches):
    import json

    from safetensors import safe_open

    counts, seen = torch.zeros(V, dtype=torch.long), 0
    for shard in json.loads((store / "index.json").read_text())["shards"]:
        with safe_open(str(store / shard["file"]), framework="pt") as f:
            for i in range(len(shard["batches"])):
                if seen < batches:
                    ids, mask = f.get_tensor(f"{i}/input_ids"), f.get_tensor(f"{i}/loss_mask").bool()
                    counts += torch.bincount(ids[mask], minlength=V)[:V]
                seen += 1
    return counts
