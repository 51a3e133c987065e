"""The targets drafters are trained for now (#55), as tiny random models built from transformers' own config
classes: Qwen3.5/3.6 hybrids (Gated DeltaNet + gated full attention) also as the vision-language checkpoints they
ship as, their MoE, Qwen3-Next, Gemma 4 (sliding + global, per-layer inputs), GPT-OSS (sliding, sinks, MoE), Llama.

Each: loaded as its language model alone (the vision tower never built); speculative decoding equal to the target's
own greedy decoding token for token, with drafts accepted to every length (the cache rolled back over full,
sliding and linear-attention layers); and the whole job (train from a feature store, lossless eval, export that
reloads) through launch.py as a user runs it."""

from __future__ import annotations

import json
import random
import shutil

import pytest
import torch
from conftest import launch

from dflash.core.config import ARCHITECTURES, TinyBuildConfig
from dflash.evaluation.decoding import verify_generate
from dflash.model.architectures import describe
from dflash.model.target import TargetModel, load_target_config
from dflash.model.tiny_architectures import SLIDING_WINDOW, tiny_model

HYBRID = [a for a in ARCHITECTURES if a != "qwen3"]  # qwen3 is every other test's target


def _build(arch: str, tokenizer_dir, out) -> None:
    """A random target of `arch` with the tiny tokenizer, as model=tiny_random builds it."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    b = TinyBuildConfig(kind="tiny_random", architecture=arch, vocab_size=512, hidden_size=64, num_layers=4,
                        num_attention_heads=2, num_key_value_heads=1, head_dim=32, intermediate_size=128)  # fmt: skip
    torch.manual_seed(0)
    tiny_model(b, len(tok), tok).save_pretrained(out)
    tok.save_pretrained(out)


@pytest.fixture(scope="module")
def targets(tiny_dir, cache_dir):
    """Every architecture's folder, where model=tiny_random model.build.architecture=ARCH finds it."""
    made = {}
    for arch in HYBRID:
        out = cache_dir / f"tiny-random-{arch}-v1"
        if not out.exists():
            _build(arch, tiny_dir, out)
        made[arch] = out
    return made


class Oracle:
    """Drafts the target's own greedy continuation with some tokens spoiled at random, so that verification
    accepts every count from 0 to B-1 drafts and rolls the cache back by every count."""

    needs_features = False
    layer_ids: list[int] = []

    def __init__(self, reference: list[int], prompt_len: int, seed: int):
        self.reference, self.prompt_len, self.rng = reference, prompt_len, random.Random(seed)

    def propose(self, seq, new_features, num_draft):
        at = len(seq) - self.prompt_len
        drafts = (self.reference[at : at + num_draft] + [0] * num_draft)[:num_draft]
        spoil = self.rng.randrange(num_draft + 1)  # the first wrong draft (num_draft: none)
        return [d if i < spoil else (d + 1) % 500 for i, d in enumerate(drafts)]


def _greedy_without_cache(model, prompt: list[int], n: int) -> list[int]:
    """The target's greedy decoding by full forwards (no cache at all): the reference."""
    seq = list(prompt)
    for _ in range(n):
        with torch.no_grad():
            seq.append(int(model(input_ids=torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(prompt) :]


@pytest.mark.parametrize("arch", HYBRID)
def test_speculative_decoding_equals_greedy_on_every_architecture(targets, arch):
    target = TargetModel.load(str(targets[arch]), [1, 2])
    model = target.model
    assert not any("visual" in n or "vision" in n for n, _ in model.named_parameters())  # the VLM's tower unbuilt
    g = torch.Generator().manual_seed(1)
    for prompt_len in (5, 2 * SLIDING_WINDOW):  # within the sliding window, and past it
        prompt = torch.randint(5, 500, (prompt_len,), generator=g).tolist()
        reference = _greedy_without_cache(model, prompt, 24)
        for block_size in (4, 8):
            oracle = Oracle(reference, prompt_len, seed=block_size)
            out = verify_generate(model, oracle, prompt, 24, block_size)
            assert out.tokens == reference, (arch, prompt_len, block_size)
            accepted = {n - 1 for n in out.accept_lengths}
            assert len(accepted) >= 3, accepted  # rolled back by several counts, the full accept included


@pytest.mark.parametrize("arch", ["qwen3_5_vl", "gemma4_vl"])
def test_a_vision_language_checkpoint_loads_its_language_model_only(targets, arch):
    from safetensors import safe_open

    path = targets[arch]
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        assert any(k.startswith("model.language_model.") for k in f.keys())
        vision = [k for k in f.keys() if "vis" in k]
    assert vision  # the checkpoint has a vision tower ...
    assert describe(load_target_config(str(path), whole=True))["vision_language"]
    config = load_target_config(str(path))  # ... and the run sees the language model's config
    assert config.num_hidden_layers == 4 and config.hidden_size == 64
    target = TargetModel.load(str(path), [1, 2])  # ... but never builds the tower
    assert not any("vis" in n for n, _ in target.model.named_parameters())


def test_a_checkpoint_missing_language_model_weights_is_refused(targets, tmp_path):
    """transformers would start missing weights at random with a log line only: the load is refused by name."""
    from safetensors.torch import load_file, save_file

    bad = tmp_path / "bad"
    shutil.copytree(targets["qwen3_5"], bad)
    tensors = load_file(str(bad / "model.safetensors"))
    dropped = next(k for k in tensors if "linear_attn" in k)
    save_file({k: v for k, v in tensors.items() if k != dropped}, str(bad / "model.safetensors"))
    with pytest.raises(ValueError, match="not in its files"):
        TargetModel.load(str(bad), [1, 2])


def test_gpt_oss_runs_eager_attention_and_the_store_records_it(targets):
    from dflash.model.target import target_attention

    assert TargetModel.load(str(targets["gpt_oss"]), [1, 2]).attn_implementation == "eager"
    assert target_attention(str(targets["gpt_oss"])) == "eager" and target_attention(str(targets["qwen3_5"])) == "sdpa"


# the whole job once a family: a `_vl` checkpoint loads the same text class as its plain text variant
WHOLE_JOB = ["qwen3_5_vl", "qwen3_5_moe_vl", "qwen3_next", "gemma4_vl", "gpt_oss", "llama"]


@pytest.mark.slow
@pytest.mark.parametrize("arch", WHOLE_JOB)
def test_the_whole_job_on_every_architecture(targets, cache_dir, tmp_path, arch):
    """As a user runs it: a feature store built, the drafter trained from it, evaluated losslessly, exported; the
    export reloads and records the target's architecture."""
    from dflash.model.export import load_drafter

    run = tmp_path / "run"
    out = launch(
        ["experiment=smoke", "model=tiny_random", f"model.build.architecture={arch}", "features=store",
         "features.build_missing=true", "train.max_steps=3", "checkpoint.every_steps=0", f"hydra.run.dir={run}"],
        cache_dir,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads((run / "status.json").read_text())["status"] == "completed"
    assert json.loads((run / "summary.json").read_text())["eval/lossless"] == 1.0
    exported = json.loads((run / "drafter" / "config.json").read_text())
    assert (
        exported["dflash_target_architecture"]["text_model_type"]
        == describe(load_target_config(str(targets[arch]), whole=True))["text_model_type"]
    )
    drafter = load_drafter(run / "drafter", target_config=load_target_config(str(targets[arch])))
    assert drafter.config.hidden_size == 64


def test_the_rollback_bench_prints_each_architecture_against_full_attention():
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "dflash.bench", "rollback", "archs=qwen3_5,gemma4_text", "hidden=64", "heads=2",
           "kv_heads=1", "head_dim=32", "intermediate=128", "vocab=512", "ctx=32", "block=8", "repeats=2"]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = {line.split()[0]: line.split() for line in out.stdout.splitlines()[2:]}
    assert rows["qwen3"][-1] == "1.00" and "crop" in rows["qwen3"]
    assert "recording" in rows["qwen3_5"] and "linear_attention," in rows["qwen3_5"]
    assert float(rows["gemma4_text"][-1]) > 0


@pytest.mark.parametrize("arch", ["qwen3_5_vl", "qwen3_5_moe", "qwen3_next", "gpt_oss", "llama"])
def test_the_plan_counts_each_architectures_parameters_by_part(targets, arch):
    """The planner's shape read from the config: its parts add up to the model's parameters (within the norms and
    biases it does not count: 3%), linear-attention layers and experts among them."""
    from dflash.model.target_shapes import target_shape

    shape = target_shape(str(targets[arch]))
    real = sum(p.numel() for p in TargetModel.load(str(targets[arch]), [1, 2]).model.parameters())
    assert shape.total_params == pytest.approx(real, rel=0.03)
    parts = shape.parts()
    assert ("linear-attention layers" in parts) == arch.startswith(("qwen3_5", "qwen3_next"))
    assert ("MoE experts" in parts) == (arch in ("qwen3_5_moe", "qwen3_next", "gpt_oss"))


def test_the_plan_of_qwen3_6_27b_lists_its_linear_attention_layers():
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "dflash.plan", "model=qwen3_6_27b"], capture_output=True, text=True,
                         timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    assert "64 layers: 48 linear-attention, 16 full-attention" in out.stdout
    assert "linear-attention layers 5.56B" in out.stdout and "(Qwen/Qwen3.6-27B, 26.9" in out.stdout


@pytest.mark.slow
def test_a_hybrid_vision_language_target_resumes_and_fine_tunes(targets, cache_dir, tmp_path):
    """resume= and model.init_from on Qwen3.6's shape (the vision-language checkpoint, linear attention): the run
    resumes from its checkpoint, a new run starts from its export, and the export carries a model card."""
    common = ["experiment=smoke", "model=tiny_random", "model.build.architecture=qwen3_5_vl", "eval.num_prompts=1"]
    first, tuned = tmp_path / "first", tmp_path / "tuned"
    out = launch([*common, "train.max_steps=2", "checkpoint.every_steps=1", f"hydra.run.dir={first}"], cache_dir)
    assert out.returncode == 0, out.stderr[-3000:]
    out = launch([f"resume={first}", "train.max_steps=4"], cache_dir)  # the run's own config and model
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads((first / "summary.json").read_text())["step"] == 4
    assert "DFlash drafter for" in (first / "drafter" / "README.md").read_text()  # its model card
    out = launch([*common, f"model.init_from={first / 'drafter'}", "train.max_steps=2", f"hydra.run.dir={tuned}"],
                 cache_dir)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads((tuned / "run.json").read_text())["init_from"]["kind"] == "drafter"
    assert json.loads((tuned / "status.json").read_text())["status"] == "completed"


def test_a_target_that_is_no_causal_lm_is_refused_in_one_line_before_any_work(tmp_path, cache_dir):
    from transformers import DistilBertConfig

    folder = tmp_path / "distilbert"  # an encoder: transformers has no causal-LM class for it
    DistilBertConfig(vocab_size=100, dim=32, n_layers=1, n_heads=2, hidden_dim=64).save_pretrained(folder)
    args = ["experiment=smoke", f"model.target={folder}", "model.build.kind=none", f"hydra.run.dir={tmp_path / 'run'}"]
    out = launch(args, cache_dir, timeout=120, env={"HYDRA_FULL_ERROR": "0"})
    assert out.returncode != 0
    assert "no causal-LM class in transformers" in out.stderr and "Traceback" not in out.stderr
    assert not (tmp_path / "run").exists()  # refused before Hydra made its directory
