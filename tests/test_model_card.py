"""The export's model card (drafter/README.md): HF front matter, the recipe, tau per suite beside prompt lookup's,
the machine and the serving commands, from the run directory alone; `python -m dflash.export RUN OUT` writes it."""

from __future__ import annotations

import json

import yaml

from dflash.core.jsonio import write_json
from dflash.model.model_card import model_card


def _run_dir(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    config = {
        "model": {"target": "/cache/smollm2", "base_model": "HuggingFaceTB/SmolLM2-135M-Instruct",
                  "license": "apache-2.0", "block_size": 8, "num_draft_layers": 2, "target_layer_ids": [1, 14, 27]},
        "drafter": {"name": "dflash"}, "loss": {"name": "dpace"}, "optim": {"name": "muon"},
        "schedule": {"lr": 0.003, "name": "cosine"}, "data": {"name": "jsonl", "path": "regen.jsonl"},
        "train": {"precision": "bf16-mixed", "batch_size": 4, "seq_len": 256, "num_anchors": 32, "seed": 1},
    }  # fmt: skip
    (run / "config_resolved.yaml").write_text(yaml.safe_dump(config))
    machine = {"device": {"cpu": "Intel Xeon", "cpu_count": 2}, "packages": {"torch": "2.13.0"}}
    write_json(run / "run.json", {"git": {"sha": "0123456789abcdef", "dirty": False}, **machine})
    write_json(run / "summary.json", {
        "step": 800, "tokens": 819200, "wall_time_s": 2678.0, "status": "completed", "eval/tau": 1.44,
        "eval/tau_baseline": 1.583, "eval/tau_ci95_low": 1.40, "eval/tau_ci95_high": 1.48,
        "eval/tau_minus_lookup": -0.143, "eval/tau_minus_lookup_ci95_low": -0.2,
        "eval/tau_minus_lookup_ci95_high": -0.09,
        "eval/num_prompts": 8,
    })  # fmt: skip
    metrics = {"tau": 1.545, "tau_lookup": 1.724, "num_prompts": 200, "tau_minus_lookup": -0.179}
    bench = {"settings": {"suite": "sharegpt", "temperature": 0.0}, "metrics": metrics}
    write_json(run / "benchmarks.json", {"results": {"sharegpt@T0": bench}})
    return run


def test_the_card_states_target_recipe_tau_and_serving(tmp_path):
    card = model_card(_run_dir(tmp_path))
    front = yaml.safe_load(card.split("---")[1])
    assert front["base_model"] == "HuggingFaceTB/SmolLM2-135M-Instruct" and front["license"] == "apache-2.0"
    assert front["library_name"] == "transformers" and "speculative-decoding" in front["tags"]
    assert "| held-out | 1.440 | [1.400, 1.480] | 1.583 | -0.143 [-0.200, -0.090] | 8 |" in card
    assert "| sharegpt | 1.545 |  | 1.724 | -0.179  | 200 |" in card
    assert "`train.precision=bf16-mixed`" in card and "800 steps" in card and "commit 0123456789ab" in card
    assert "Intel Xeon (2 cores)" in card
    assert "--speculative-num-draft-tokens 8" in card and '"num_speculative_tokens": 7' in card


def test_a_run_without_evals_says_so(tmp_path):
    run = _run_dir(tmp_path)
    (run / "summary.json").write_text(json.dumps({"step": 3, "status": "completed"}))
    (run / "benchmarks.json").unlink()
    assert "Not evaluated" in model_card(run)


def test_the_card_states_the_chat_rendering_it_was_trained_on(tmp_path):
    """#56: a Qwen3.6 drafter trained with thinking off must be served with thinking off."""
    run = _run_dir(tmp_path)
    assert "chats rendered with the chat template's defaults" in model_card(run)
    config = yaml.safe_load((run / "config_resolved.yaml").read_text())
    config["data"]["chat_template_kwargs"] = {"enable_thinking": False}
    (run / "config_resolved.yaml").write_text(yaml.safe_dump(config))
    assert "chats rendered with `data.chat_template_kwargs={enable_thinking: false}`" in model_card(run)


def test_the_card_states_the_draft_vocabulary_and_its_coverage(tmp_path):
    """#58: model.draft_vocab_size's size and its coverage of the training labels (run.json's draft_vocab)."""
    run = _run_dir(tmp_path)
    info = json.loads((run / "run.json").read_text())
    info["draft_vocab"] = {"size": 8192, "target_vocab_size": 49152, "coverage": 0.9731, "labels_counted": 123456,
                           "cache": "x"}  # fmt: skip
    write_json(run / "run.json", info)
    card = model_card(run)
    assert "a draft vocabulary of 8,192 of the target's 49,152 tokens" in card
    assert "covering 97.31% of the 123,456 training labels counted (the text's" in card
    assert "speculators' layout" in card
    info["draft_vocab"]["counted"] = "the target's labels in the feature store"
    write_json(run / "run.json", info)
    assert "training labels counted (the target's labels in the feature store)" in model_card(run)
    (tmp_path / "plain").mkdir()
    assert "draft vocabulary" not in model_card(_run_dir(tmp_path / "plain"))
