"""make real's target on a GPU node without network access (python -m dflash.offline_gpu.cli): the token files and
data=tokens, the target file cut into a piece a step and rebuilt (a changed or missing piece refused by name), the
transfer's limits as options (pieces, returned files, the budget; a bad value refused in one line), the pack that
comes back, and every step dry-run on CPU with the tiny random target."""

from __future__ import annotations

import json

import numpy as np
import pytest
from omegaconf import OmegaConf
from safetensors import safe_open

from dflash.core.hashing import file_sha256
from dflash.data.prompts import heldout_prompts
from dflash.data.tokens import load_token_data, read_tokens, token_files, write_tokens
from dflash.data.training_data import build_training_data
from dflash.offline_gpu.limits import MIB, Limits, StageError, join_parts, split_file


def _records(n: int, vocab: int = 1000):
    rng = np.random.default_rng(0)
    out = []
    for i in range(n):
        prompt, answer = rng.integers(3, vocab, 6 + i % 5).tolist(), rng.integers(3, vocab, 4 + i % 3).tolist()
        out.append((prompt + answer, [(len(prompt), len(prompt) + len(answer))]))
    return out


def test_token_files_round_trip_as_uint16_and_train_as_rows(tmp_path):
    recs = _records(40)
    path = write_tokens(tmp_path / "data" / "a.npz", recs, {"answers": "original"})
    back = read_tokens(path)
    assert back.ids.dtype == np.uint16 and len(back) == 40 and back.meta["answers"] == "original"
    assert back.record(3).tolist() == recs[3][0] and back.answer_start(3) == recs[3][1][0][0]
    assert back.mask(3).sum() == recs[3][1][0][1] - recs[3][1][0][0]
    write_tokens(tmp_path / "data" / "b.npz", _records(2, vocab=70_000), {})  # past uint16: uint32
    assert read_tokens(tmp_path / "data" / "b.npz").ids.dtype == np.uint32
    assert [p.name for p in token_files(tmp_path / "data")] == ["a.npz", "b.npz"]

    data_cfg = OmegaConf.create({"name": "tokens", "path": str(path), "holdout_fraction": 0.1, "pad_to_multiple_of": 8})
    data = load_token_data(data_cfg, seq_len=64)
    assert data.train_rows.tolist() == list(range(36)) and data.heldout_rows.tolist() == list(range(36, 40))
    train_cfg = OmegaConf.create({"seq_len": 64, "batch_size": 4, "seed": 0, "data_seed": None})

    class Tok:
        eos_token_id = 2

    batch = next(build_training_data(data_cfg, train_cfg, Tok(), block_size=4).batches.iterate())
    row = batch.input_ids[0].tolist()
    rec = next(i for i in range(36) if recs[i][0] == row[: len(recs[i][0])])  # the row is a whole record
    ids, [(a, e)] = recs[rec]
    assert batch.loss_mask[0, :a].sum() == 0 and batch.loss_mask[0, a:e].all() and batch.loss_mask[0, e:].sum() == 0
    prompts = heldout_prompts(None, data_cfg, 3, 4, seed=0)  # the held-out records, cut where their answer starts
    before_answers = [ids[a - 4 : a] for ids, [(a, _)] in recs[36:]]
    assert len(prompts) == 3 and all(p in before_answers for p in prompts)


def test_data_tokens_needs_a_path(tiny_target):
    from conftest import compose_config

    from dflash.core.config import ConfigError
    from dflash.core.validation import validate

    cfg = compose_config(["data=tokens", f"model.target={tiny_target}"])
    cfg.data.path = None
    with pytest.raises(ConfigError, match="data=tokens needs data.path"):
        validate(cfg)


def test_the_target_file_splits_into_a_piece_a_step_and_a_changed_or_missing_piece_is_refused_by_name(tmp_path):
    src = tmp_path / "target.whl"
    src.write_bytes(bytes(range(256)) * 400)
    dests = [tmp_path / f"step{k}" / f"t.part{k}" for k in (1, 2, 3)]
    parts = split_file(src, [40_000, 30_000, None], dests)
    assert [p["bytes"] for p in parts] == [40_000, 30_000, 32_400]
    whole = file_sha256(src)
    rebuilt = join_parts(parts, tmp_path / "out" / "t.whl", whole)
    assert rebuilt.read_bytes() == src.read_bytes()

    dests[2].write_bytes(b"x" + dests[2].read_bytes()[1:])
    with pytest.raises(StageError, match="part 3 of the target file .* is not the part written"):
        join_parts(parts, tmp_path / "out" / "again.whl", whole)
    dests[1].unlink()
    with pytest.raises(StageError, match="part 2 .* is missing: step 2 left it on the node: run the steps from step 2"):
        join_parts(parts, tmp_path / "out" / "again.whl", whole)
    assert not (tmp_path / "out" / "again.whl").exists()


def test_a_smaller_piece_makes_more_steps_each_within_it():
    from dflash.offline_gpu.stage import node_steps, piece_sizes

    target, extra = 100 * MIB, 7 * MIB  # about SmolLM2's wheel, and the data and wheels with it
    for room, steps in ((58 * MIB, 2), (30 * MIB, 4), (10 * MIB, 11)):
        sizes = piece_sizes(target, extra, room)
        assert len(sizes) == steps and sum(sizes) == target
        assert max(sizes[:-1]) <= room and sizes[-1] + extra <= room
    assert piece_sizes(1000, 5000, 58 * MIB) == [999, 1]  # two steps at least: step 1 reports the node first
    with pytest.raises(StageError, match=r"the wheels and data \(7.0 MiB\) do not fit .* raise --piece-mib"):
        piece_sizes(target, extra, 6 * MIB)
    steps = node_steps(3, 540)
    assert [s["command"] for s in steps] == ["bash scripts/gpu_real_check.sh 1", "bash scripts/gpu_real_check.sh 2",
                                             "bash scripts/gpu_real_run.sh 3"]  # fmt: skip
    assert steps[-1]["carry"][0].endswith("step3") and steps[-1]["timeout_s"] == 600


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--piece-mib", "0"], "error: --piece-mib must be at least 1, not 0"),
        (["--return-files", "2"], "error: --return-files must be at least 3, not 2: result.json, summary.txt and"),
        (["--return-file-mib", "0.5"], "error: --return-file-mib must be at least 1, not 0.5"),
        (["--budget-s", "60"], "error: --budget-s must be at least 120, not 60: the job's start, its end and the"),
        (["--piece-mib", "2"], "error: --piece-mib 2 leaves no room beside the working tree"),
    ],
)
def test_a_bad_limit_is_refused_in_one_line_before_any_work(args, message, capsys, tmp_path, monkeypatch):
    from dflash.offline_gpu import cli, stage

    monkeypatch.setattr(stage, "STAGE_DIR", tmp_path / "stage")
    assert cli.main(["stage", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith(message) and err.count("\n") == 1, err
    assert not (tmp_path / "stage").exists()


def test_a_limit_that_is_no_number_is_refused_in_one_line(capsys):
    from dflash.offline_gpu import cli

    with pytest.raises(SystemExit) as exit_:
        cli.main(["stage", "--return-file-mib", "lots"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1, err
    assert err.startswith("error: argument --return-file-mib: invalid float value: 'lots' (usage: ")


def test_the_returned_files_keep_to_their_number_and_size(tmp_path, monkeypatch):
    from dflash.offline_gpu import evaluate, pack

    work = tmp_path / "work"
    monkeypatch.setattr(pack, "WORK", work)
    (work / "data").mkdir(parents=True)
    (work / "data" / "regen.npz").write_bytes(np.random.default_rng(0).bytes(3 * MIB))  # incompressible
    info = {"phases": {}}
    result = pack.pack(tmp_path / "out", None, {"git": "x"}, info, Limits(return_files=8, return_file_mib=1))
    files = sorted((tmp_path / "out").iterdir())
    assert len(result["parts"]) == 4 and len(files) == 6 and "left_out" not in result["info"]
    assert all(f.stat().st_size <= MIB for f in files)
    back = evaluate.rebuild(tmp_path / "out", tmp_path / "real")  # the parts joined and checked by sha256
    assert (back / "data" / "regen.npz").read_bytes() == (work / "data" / "regen.npz").read_bytes()

    result = pack.pack(tmp_path / "out2", None, {}, info, Limits(return_files=4, return_file_mib=1))
    assert len(result["parts"]) == 1 and result["info"]["left_out"].startswith("data/")  # 2 parts at most: no data
    assert "left out: data/" in (tmp_path / "out2" / "summary.txt").read_text()
    (tmp_path / "out" / "result.tar.gz.02").unlink()
    with pytest.raises(StageError, match="part 3 of .*'s result .* is missing"):
        evaluate.rebuild(tmp_path / "out", tmp_path / "real")


@pytest.mark.slow
def test_every_step_dry_runs_on_cpu_with_the_tiny_target_in_pieces_smaller_than_the_default(tmp_path):
    """Stage in pieces of a few hundred KB (3 or more steps), the check steps, a changed piece refused, the run step
    with a budget of seconds, the evaluation here (~2 min)."""
    from dflash.offline_gpu.dry_run import dry_run
    from dflash.offline_gpu.stage import MARGIN_BYTES, working_tree_bytes

    piece_mib = (working_tree_bytes() + MARGIN_BYTES + 250_000) / MIB  # the tiny target's 0.8 MB in 3 or more
    out = dry_run(tmp_path, stage_args=["--piece-mib", f"{piece_mib:.3f}"])
    steps = len(out["steps"])
    assert steps >= 3 and len(out["checks"]) == steps - 1 and f"in {steps} pieces" in out["stage"]
    assert all(f"part {k} checked" in c for k, c in enumerate(out["checks"], start=1))
    assert out["refused"].returncode == 2 and f"part {steps} " in out["refused"].stderr
    result = out["result"]
    assert result["status"] == "completed", result["text"]
    assert all(p["bytes"] <= 15 << 20 for p in result["parts"]) and len(result["parts"]) <= 6
    info = result["info"]
    assert info["limits"]["budget_s"] == 240 and info["limits"]["piece_mib"] == pytest.approx(piece_mib, abs=1e-3)
    assert info["regenerate"]["answers"] > 0 and info["train"]["max_minutes"] == pytest.approx(0.05)
    assert info["throughput"]["stop_reason"] == "max_minutes" and info["throughput"]["steps"] > 0
    run = out["run"]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["stop_reason"] == "max_minutes" and "eval/tau" in summary
    with safe_open(str(next((run / "drafter").glob("*.safetensors"))), "pt") as f:  # the drafter came back in bf16
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}
    table = (run / "comparison.md").read_text()
    assert "held-out" in table and "suite.jsonl" in table
    assert (run / "replay" / "benchmarks.json").is_file() and (run / "benchmarks.json").is_file()


def test_the_run_step_again_reuses_the_data_made_from_the_same_stage_only(tmp_path):
    from argparse import Namespace

    from dflash.offline_gpu.node_run import MADE, _regen_settings, made_before

    manifest = {"data": {"sha256": "a" * 64}}
    args = Namespace(max_new_tokens=256, data="regen", regen_s=150.0, regen_batch=512)
    assert made_before(tmp_path, manifest, args) is None  # nothing made yet
    (tmp_path / MADE).write_text(json.dumps({"answers": 9, "settings": _regen_settings(manifest, args)}))
    assert made_before(tmp_path, manifest, args) == {"answers": 9, "settings": _regen_settings(manifest, args),
                                                     "reused": True}  # fmt: skip
    assert made_before(tmp_path, {"data": {"sha256": "b" * 64}}, args) is None  # another stage's exchanges
    assert made_before(tmp_path, manifest, Namespace(**{**vars(args), "max_new_tokens": 128})) is None


def test_the_batch_is_the_largest_the_plan_fits_in_the_free_memory_up_to_the_cap(tiny_target, monkeypatch):
    from argparse import Namespace

    import torch

    from dflash.offline_gpu.node_run import pick_batch
    from dflash.recipes.sharegpt_data import compose

    cfg = compose("smollm2_gpu_real", ["model=tiny_random", f"model.target={tiny_target}", "train.seq_len=4096"])
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda: (80 << 30, 80 << 30))
    assert pick_batch(cfg, tiny_target, Namespace(max_batch=64), "cuda")[0] == 64  # memory to spare: the cap
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda: (1 << 30, 80 << 30))
    batch, why = pick_batch(cfg, tiny_target, Namespace(max_batch=64), "cuda")
    assert 1 <= batch < 64 and why["predicted_peak_gib"] <= 0.85  # the largest whose predicted peak fits 85%
    assert pick_batch(cfg, tiny_target, Namespace(max_batch=64), "cpu")[0] == cfg.train.batch_size


def test_the_node_side_checks_pieces_before_any_package_a_wheel_brings():
    """A check step and `assemble` run before the staged wheels are on the path: limits imports the stdlib only."""
    import subprocess
    import sys

    code = "import sys, dflash.offline_gpu.limits; print(sorted({m.split('.')[0] for m in sys.modules}))"
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert not {"omegaconf", "hydra", "antlr4", "gguf", "accelerate", "torch", "numpy"} & set(eval(loaded))
