"""Running out of disk: a true status, one error line, no half-written leftovers, a check before the large
writes, and a resume that ends as if nothing had happened. The real cases run on a small tmpfs (this machine's
tests run as root); the rest patch the file system call that fails."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import launch
from test_drafter import make_drafter
from test_resume import COMMON, _Trainer, final_weights

from dflash.core.disk import MARGIN_BYTES, DiskFull, check_free, dir_bytes, disk_error
from dflash.core.rundir import StatusFile, load_run
from dflash.train.checkpoint import latest_checkpoint, save_checkpoint
from dflash.train.checkpointer import CheckpointManager


@contextlib.contextmanager
def tmpfs(path: Path, size_bytes: int):
    """A tmpfs of `size_bytes` mounted at `path` (needs root, as tests run here and in CI). Where none can be
    mounted the test fails: a skip would pass a real disk-full case unnoticed; DFLASH_SKIP_TMPFS=1 asks for one."""
    path.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_bytes}", "tmpfs", str(path)], capture_output=True)
    if done.returncode != 0:
        why = f"cannot mount a tmpfs here ({done.stderr.decode().strip()})"
        if os.environ.get("DFLASH_SKIP_TMPFS") == "1":
            pytest.skip(f"{why}; DFLASH_SKIP_TMPFS=1")
        pytest.fail(f"{why}: run the disk-full tests as root, or set DFLASH_SKIP_TMPFS=1 to skip them")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def test_without_a_tmpfs_the_real_cases_fail_unless_a_skip_is_asked_for(tmp_path, monkeypatch):
    """The tmpfs cases are the only ones that fill a real file system: a machine that cannot mount one must not
    pass them as skipped without a word."""
    refused = subprocess.CompletedProcess([], 32, b"", b"mount: only root can do that")
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: refused)

    def outcome() -> BaseException | None:  # pytest's skip and fail are BaseExceptions: caught to be compared
        try:
            with tmpfs(tmp_path / "fs", 1 << 20):
                return None
        except BaseException as e:  # noqa: BLE001
            return e

    monkeypatch.delenv("DFLASH_SKIP_TMPFS", raising=False)
    failed = outcome()
    assert isinstance(failed, pytest.fail.Exception) and "DFLASH_SKIP_TMPFS=1" in str(failed), repr(failed)
    monkeypatch.setenv("DFLASH_SKIP_TMPFS", "1")
    skipped = outcome()
    assert isinstance(skipped, pytest.skip.Exception) and "only root" in str(skipped), repr(skipped)


def fill(path: Path) -> None:
    """Take every free byte of `path`'s file system."""
    with open(path / "filler", "wb") as f, contextlib.suppress(OSError):
        while True:
            f.write(b"\0" * (1 << 16))
            f.flush()


def test_status_is_recorded_on_a_full_disk(tmp_path):
    """status.json is written `running` with a reserve; on a full file system the end still lands, in place."""
    with tmpfs(tmp_path / "fs", 1 << 20) as fs:
        status = StatusFile(fs)
        status.running()
        fill(fs)
        with pytest.raises(OSError):  # the disk is really full
            (fs / "probe").write_bytes(b"x" * 4096)
        status.finish("failed", error="OSError: [Errno 28] No space left on device", traceback="x" * 50_000)
        record = json.loads((fs / "status.json").read_text())
        assert record["status"] == "failed" and "No space left" in record["error"]
        assert "status_written_in_place" in record and "traceback" not in record  # it did not fit the reserve


def test_a_run_whose_process_is_gone_reads_as_died(tmp_path):
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    StatusFile(tmp_path).running(pid=gone.pid)
    assert load_run(tmp_path).status == "died"
    StatusFile(tmp_path).running()  # this process: alive
    assert load_run(tmp_path).status == "running"


def test_disk_errors_are_found_behind_the_stage_error_and_pickle():
    from dflash.train.pipeline import StageError

    full = OSError(errno.ENOSPC, "No space left on device")
    try:
        try:
            raise full
        except OSError as e:
            raise StageError("drafter", e, "tb") from e
    except StageError as wrapped:
        assert disk_error(wrapped) is full
    assert disk_error(RuntimeError("no")) is None
    back = pickle.loads(pickle.dumps(DiskFull(errno.ENOSPC, "not enough disk")))
    assert isinstance(back, DiskFull) and back.errno == errno.ENOSPC


def test_a_failed_checkpoint_write_leaves_no_partial_directory(tmp_path, monkeypatch):
    from dflash.train import checkpoint

    def no_room(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(checkpoint, "save_file", no_room)
    with pytest.raises(OSError, match="No space left"):
        save_checkpoint(tmp_path, make_drafter(), _Trainer(3).state_dict(), {}, keep_last=2)
    assert not list((tmp_path / "checkpoints").iterdir())


def test_periodic_checkpoints_are_skipped_or_stop_and_the_final_one_stops(tmp_path, monkeypatch):
    """checkpoint.on_disk_full=skip: a periodic save without room is skipped and counted; the final save (and
    any save under `stop`) raises DiskFull naming the path, the bytes needed and free; leftovers of an earlier
    process are removed when the manager starts."""
    from dflash.core import disk

    drafter = make_drafter()
    save_checkpoint(tmp_path, drafter, _Trainer(3).state_dict(), {}, keep_last=2)
    (tmp_path / "checkpoints" / "step_6.tmp").mkdir()  # half-written by a process that died
    monkeypatch.setattr(disk, "free_bytes", lambda path: MARGIN_BYTES)  # room for nothing
    cfg = type("C", (), {"enabled": True, "every_steps": 3, "keep_last": 2, "on_disk_full": "skip"})()
    manager = CheckpointManager(cfg, tmp_path, drafter, "target")
    assert not (tmp_path / "checkpoints" / "step_6.tmp").exists()
    manager.maybe_save(_Trainer(6))
    assert manager.skipped_disk_full == 1 and latest_checkpoint(tmp_path).name == "step_3"
    with pytest.raises(DiskFull, match=r"checkpoint step_7 in .*checkpoints: needs about .* MiB free"):
        manager.save_final(_Trainer(7))
    cfg.on_disk_full = "stop"
    with pytest.raises(DiskFull, match="on_disk_full=skip skips periodic checkpoints instead"):
        manager.maybe_save(_Trainer(9))
    with pytest.raises(DiskFull, match="the export"):
        check_free(tmp_path, 1, "the export")


@pytest.mark.slow
def test_a_run_on_a_disk_that_fills_up_ends_truthfully_and_resumes(tmp_path, cache_dir, tiny_target):
    """The issue's run, on a tmpfs that holds the first checkpoint and not the second: exit 1 with one `error:`
    line and no traceback, status.json `failed` naming the disk, no `*.tmp` left; with room again, the resume
    ends bitwise equal to an uninterrupted run."""
    ref = tmp_path / "ref"
    common = COMMON  # checkpoints every 4 steps of 12
    launch([*common, f"hydra.run.dir={ref}"], cache_dir, check=True)
    first = dir_bytes(ref / "checkpoints" / "step_4")
    # the run's other files (as tmpfs pages), but not the export, written at the end
    others = sum(
        -(-f.stat().st_size // 4096) * 4096
        for f in ref.rglob("*")
        if f.is_file() and not {"checkpoints", "drafter"} & set(f.parts)
    )
    size = others + MARGIN_BYTES + first * 3 // 2
    with tmpfs(tmp_path / "fs", size) as fs:
        run_dir = fs / "run"
        proc = launch([*common, f"hydra.run.dir={run_dir}"], cache_dir, env={"HYDRA_FULL_ERROR": "0"})
        assert proc.returncode == 1, proc.stderr[-3000:]
        errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
        assert len(errors) == 1 and "not enough disk for checkpoint step_8" in errors[0], proc.stderr[-3000:]
        assert "Traceback" not in proc.stderr
        status = json.loads((run_dir / "status.json").read_text())
        assert status["status"] == "failed" and "not enough disk" in status["error"]
        assert not list(run_dir.rglob("*.tmp")) and latest_checkpoint(run_dir).name == "step_4"

        subprocess.run(["mount", "-o", f"remount,size={64 << 20}", str(fs)], check=True)  # space freed
        launch([f"resume={run_dir}"], cache_dir, check=True)
        assert json.loads((run_dir / "status.json").read_text())["status"] == "completed"
        a, b = final_weights(ref), final_weights(run_dir)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_failed_export_or_store_shard_leaves_nothing_half_written(tmp_path, monkeypatch):
    """The export and a feature-store shard are written to *.tmp and renamed: a full disk mid-write removes the
    *.tmp, keeps what was there, and lists no shard that is not whole."""
    from dflash.model import export
    from dflash.train import feature_store

    def full(*args, **kwargs):
        Path(args[2] if len(args) > 2 else args[1]).mkdir(parents=True, exist_ok=True)
        raise OSError(errno.ENOSPC, "No space left on device")

    out = tmp_path / "drafter"
    out.mkdir()
    (out / "keep.txt").write_text("the previous export")
    monkeypatch.setattr(export, "_write", full)
    with pytest.raises(OSError, match="No space left"):
        export.export_drafter(make_drafter(), out)
    assert (out / "keep.txt").exists() and not (tmp_path / "drafter.tmp").exists()

    manifest = {"features.dtype": "float32", "model.target_layer_ids": [1]}
    writer = feature_store.StoreWriter(tmp_path / "store", manifest, shard_batches=1)

    def no_room(tensors, path):
        Path(path).write_bytes(b"half")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr("safetensors.torch.save_file", no_room)
    batch = type("B", (), {"input_ids": torch.zeros(1, 4, dtype=torch.long), "loss_mask": torch.ones(1, 4).bool()})
    batch.lengths, batch.data_pass, batch.index = None, 0, 0
    writer.add(batch, torch.zeros(1, 4, 8), torch.zeros(1, 4, 4))
    with pytest.raises(OSError, match="No space left"):
        writer.commit(0)
    store = tmp_path / "store"
    assert not list(store.glob("*.tmp")) and not list(store.glob("shard_*")) and writer.entries == {}


def test_regeneration_and_the_datasets_cache_check_the_disk_first(tmp_path, monkeypatch, tiny_target, tiny_tokenizer):
    """Both large writes of the data side stop before they start when the disk lacks the room, naming it."""
    from test_data import _data_cfg, _load

    from dflash.core import disk
    from dflash.recipes.regenerate import regenerate_file

    chats = tmp_path / "chats.jsonl"
    rows = [
        {"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": "a"}]} for i in range(8)
    ]
    chats.write_text("".join(json.dumps(r) + "\n" for r in rows))
    monkeypatch.setattr(disk, "free_bytes", lambda path: MARGIN_BYTES)  # room for nothing
    with pytest.raises(DiskFull, match="not enough disk for the regenerated data"):
        regenerate_file(chats, tmp_path / "out" / "regen.jsonl", backend=None, chunk_size=4)
    assert not (tmp_path / "out" / "regen.jsonl").exists()
    with pytest.raises(DiskFull, match="not enough disk for the datasets cache of data.path"):
        _load(_data_cfg(chats), tiny_tokenizer, tiny_target, tmp_path / "cache")


def test_a_long_error_keeps_its_head_and_tail_on_a_full_disk(tmp_path, monkeypatch):
    """The end written in place, with an error longer than the reserve: status.json keeps what failed (the head)
    and how it ended (the tail), the cut marked, in the reserve's own bytes (it was '...' alone)."""
    from dflash.core import rundir

    status = StatusFile(tmp_path)
    status.running()
    reserve = (tmp_path / "status.json").stat().st_size

    def no_room(*args, **kwargs):  # the atomic write needs new blocks: none left
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(rundir, "write_json", no_room)
    middle = "; ".join(f"key{i}: store {i} vs run {-i}" for i in range(2000))
    error = f"StoreMismatch: built for other settings: {middle} (the end \u2713)"
    status.finish("failed", error=error, traceback="x" * 50_000)
    assert (tmp_path / "status.json").stat().st_size == reserve
    record = json.loads((tmp_path / "status.json").read_text())
    assert record["status"] == "failed" and "traceback" not in record and "status_written_in_place" in record
    head, tail = record["error"].split(" [... ")
    assert error.startswith(head) and head.startswith("StoreMismatch: built for other settings: key0: store 0")
    cut, tail = tail.split(" characters cut ...] ")
    assert error.endswith(tail) and tail.endswith("(the end \u2713)") and len(head) + int(cut) + len(tail) == len(error)
    assert len(record["error"]) > reserve // 2  # the room is used, not given up


def test_a_full_disk_is_one_line_naming_errno_28_once(tmp_path, monkeypatch, caplog):
    """A checkpoint without room is refused as `[Errno 28] not enough disk ...` (it read `[Errno 28] [Errno 28]`),
    and the async pipeline logs no traceback for it: the run's one `error:` line says it (status.json keeps the
    traceback)."""
    import logging
    from types import SimpleNamespace

    from dflash.core import disk
    from dflash.train.pipeline import Pipeline, StageError

    monkeypatch.setattr(disk, "free_bytes", lambda path: MARGIN_BYTES)  # room for nothing
    cfg = type("C", (), {"enabled": True, "every_steps": 3, "keep_last": 2, "on_disk_full": "stop"})()
    manager = CheckpointManager(cfg, tmp_path, make_drafter(), "target")
    with pytest.raises(DiskFull) as full:
        manager.maybe_save(_Trainer(3))
    assert str(full.value).startswith("[Errno 28] not enough disk for checkpoint step_3 in ")
    assert str(full.value).count("Errno") == 1

    def drafter_fn(item) -> bool:  # the periodic checkpoint of a step, in the drafter's thread
        manager.maybe_save(_Trainer(3))
        return True

    batches = [SimpleNamespace(num_tokens=1) for _ in range(4)]
    with caplog.at_level(logging.INFO), pytest.raises(StageError, match=r"DiskFull: \[Errno 28\] not enough disk"):
        Pipeline(batches, lambda batch: batch, drafter_fn, mode="async", monitor_interval_s=60).run()
    assert "Traceback" not in caplog.text and not [r for r in caplog.records if r.levelno >= logging.ERROR]
