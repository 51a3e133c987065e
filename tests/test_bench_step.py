"""`python -m dflash.bench step budgets=none,K lengths=...`: train.anchor_budget's effect on a step over rows of mixed
lengths, side by side with per-row anchors (issue 39: the budget's effect on memory with mixed lengths)."""

import subprocess
import sys

from dflash.core.machine import slow_cpu_dtype

SMALL = ["hidden=64", "heads=2", "kv_heads=1", "head_dim=32", "intermediate=128", "vocab=500", "repeats=1"]


def _bench(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "dflash.bench", "step", "seq_len=64", "block_size=8", "windows=none", *SMALL, *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


def test_a_budget_caps_the_blocks_of_a_batch_of_mixed_lengths():
    out = _bench("anchors=32", "lengths=64,16,16,16", "budgets=none,24")
    assert out.returncode == 0, out.stderr[-2000:]
    rows = {line.split()[2]: line.split() for line in out.stdout.splitlines() if line.startswith("none ")}
    # per row: 32 anchors wide; a 16-token row has 15 anchor positions (a + 1 supervised), so 32 + 3 x 15 train
    assert rows["none"][5] == "77/128"
    # K = 24: one each, the other 20 shared in proportion to (31, 14, 14, 14): 8 + 3 x 3, the 3 left over to the
    # largest remainders (rows 1-3), so (9, 5, 5, 5): the tensor is 9 wide
    assert rows["24"][5] == "24/36"
    assert "budget 24 / per-row anchors (window none, none): peak memory" in out.stdout


def test_bad_budgets_and_lengths_are_refused_by_name():
    out = _bench("lengths=64,16,16", "budgets=2")
    assert out.returncode != 0 and "budgets= takes none or anchor budgets >= the batch's 3 rows" in out.stderr
    out = _bench("lengths=64,80")
    assert out.returncode != 0 and "lengths= takes 1..seq_len (64) tokens a row" in out.stderr


def test_precisions_take_turns_and_rows_say_what_ran():
    """A row is labelled by the precision that ran: where bf16-mixed falls back to fp32 (a CPU without fast bfloat16)
    its row says fp32* and no ratio compares two fp32 runs (#57: a 2.52x 'bf16-mixed / fp32' ratio that was noise)."""
    out = _bench("anchors=8", "precisions=fp32,bf16-mixed", "rounds=2", "repeats=1")
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [line.split() for line in out.stdout.splitlines() if line.startswith("none ")]
    assert all(line.count(", ") == 1 for line in out.stdout.splitlines() if line.startswith("none "))  # 2 rounds
    if slow_cpu_dtype("bfloat16"):
        assert [r[3] for r in rows] == ["fp32", "fp32*"]
        assert "bf16-mixed / fp32" not in out.stdout and "fp32*: bf16-mixed fell back to fp32" in out.stdout
    else:
        assert [r[3] for r in rows] == ["fp32", "bf16-mixed"]
        assert "bf16-mixed / fp32 (window none, none): peak memory" in out.stdout


def test_optimizers_print_their_share_of_the_step():
    """#59: each optimizer's step timed apart, with Muon's Newton-Schulz dtype (auto: float32 without fast bf16)."""
    out = _bench("anchors=8", "optims=adamw,muon,muon:bfloat16")
    assert out.returncode == 0, out.stderr[-2000:]
    rows = {line.split()[0]: line.split() for line in out.stdout.splitlines()[-3:]}
    assert rows["adamw"][1] == "-" and rows["muon:bfloat16"][1] == "bfloat16"
    assert rows["muon"][1] == ("float32" if slow_cpu_dtype("bfloat16") else "bfloat16")
    assert all(0 < float(r[2]) and r[3].endswith("%") for r in rows.values())
    out = _bench("optims=sgd")
    assert out.returncode != 0 and "optims= takes" in out.stderr


def test_a_draft_vocabulary_against_the_full_one_in_one_run():
    """#58: draft_vocab=none,N: the head over N of the tokens against the whole head, side by side, with the ratio."""
    out = _bench("anchors=8", "teachers=online", "draft_vocab=none,64")
    assert out.returncode == 0, out.stderr[-2000:]
    rows = {line.split()[4]: line.split() for line in out.stdout.splitlines() if line.startswith("none ")}
    assert set(rows) == {"500", "64"}
    assert "draft vocab 64 / full 500 (window none, online): peak memory" in out.stdout
    out = _bench("draft_vocab=none,64")  # teachers=none: nothing to replace an outside label from
    assert out.returncode != 0 and "draft_vocab=N needs teachers= other than none" in out.stderr
