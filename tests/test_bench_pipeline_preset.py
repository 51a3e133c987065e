"""`python -m dflash.bench pipeline model=PRESET`: the bench on a preset's saved target with its drafter settings
(it only built random Qwen3 shapes, `size=tiny|1b`), and a one-line refusal naming the fix for a missing folder."""

from __future__ import annotations

import pytest

from dflash.benchmarks.pipeline import bench

FEW_STEPS = ["steps=2", "warmup=1", "batch_size=1", "seq_len=32", "num_anchors=2", "threads=1"]


@pytest.fixture(scope="module")
def small_llama(tmp_path_factory):
    """A saved random Llama folder with smollm2_135m's layer count (its target_layer_ids reach layer 27) and a
    vocabulary that holds its mask token 16, a few thousand parameters wide."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=30,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        tie_word_embeddings=True,
        max_position_embeddings=256,
    )
    folder = tmp_path_factory.mktemp("llama30") / "target"
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_preset_runs_on_its_saved_target_with_its_drafter_settings(small_llama, dtype, capsys):
    bench(["model=smollm2_135m", f"target={small_llama}", f"dtype={dtype}", *FEW_STEPS])
    out = capsys.readouterr().out
    header = out.splitlines()[0]
    assert header.startswith(f"pipeline bench: target model=smollm2_135m at {small_llama} "), header
    # the preset's drafter: 2 layers over layers [1, 14, 27], mask token 16, block 8
    assert "(2 layers over target layers [1, 14, 27], mask token 16)" in header, header
    assert f"dtype {dtype}," in header and "block 8," in header, header
    for row in ("target stand-alone", "drafter stand-alone", "sync (1 thread)", "async (1 thread/stage)"):
        assert any(line.startswith(row) for line in out.splitlines()), (row, out)
    assert "async / sync:" in out and "async busy fractions: target " in out, out


def test_missing_preset_folder_is_one_line_naming_the_fix(tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH_CACHE_DIR", str(tmp_path))
    with pytest.raises(SystemExit) as e:
        bench(["model=smollm2_135m", *FEW_STEPS])
    msg = str(e.value.code)
    assert "\n" not in msg and str(tmp_path / "smollm2-135m-instruct-q4_1") in msg and "`make real`" in msg, msg

    with pytest.raises(SystemExit) as e:
        bench(["model=smollm2_135m", f"target={tmp_path / 'absent'}", *FEW_STEPS])
    msg = str(e.value.code)
    assert "\n" not in msg and str(tmp_path / "absent") in msg and "give target=" in msg, msg
