"""`make real`'s driver (dflash/tools/make_real.py): the phases in order, each timed in phases.json; a second run
reuses every phase; a run cut short is resumed, not started again. The phases' own work is faked here (the slow
test in test_gguf_target.py trains against the real target)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from dflash.tools import make_real


@pytest.fixture
def fake(tmp_path, monkeypatch):
    calls: list[list[str]] = []
    state = {"answers": 0}
    target = tmp_path / "cache" / "target"
    store = tmp_path / "cache" / "features"

    def ensure_target(model_cfg):
        target.mkdir(parents=True, exist_ok=True)
        (target / "config.json").write_text("{}")
        return target

    def make_data(argv):
        done_before, state["answers"] = state["answers"], 4
        return SimpleNamespace(completed=4 - done_before)

    def run(cmd):
        calls.append(cmd)
        if cmd[1:3] == ["-m", "dflash.features"]:
            if not store.exists():
                store.mkdir(parents=True)
                (store / "shard-0.safetensors").write_bytes(b"x")
            (store / ".build.lock").write_text("")  # every build opens its lock, complete store or not
        if cmd[1] == "launch.py":
            where = next(a.split("=", 1)[1] for a in cmd if a.startswith(("hydra.run.dir=", "resume=")))
            Path(where).mkdir(parents=True, exist_ok=True)
            (Path(where) / "status.json").write_text(json.dumps({"status": state.get("ends", "completed")}))

    monkeypatch.setattr(make_real.sharegpt_data, "ensure_target", ensure_target)
    monkeypatch.setattr(make_real.sharegpt_data, "make_data", make_data)
    monkeypatch.setattr(make_real, "_run", run)
    args = ["--out", str(tmp_path / "out"), f"paths.cache_dir={tmp_path / 'cache'}", f"model.target={target}"]
    run = make_real.run_dir_for(make_real.parse_args(args))
    return SimpleNamespace(calls=calls, state=state, args=args, out=tmp_path / "out", run=run)


def _phases(out):
    return json.loads((out / "phases.json").read_text())


def test_the_phases_run_in_order_and_a_second_run_reuses_them(fake, capsys):
    assert make_real.main(fake.args) == 0
    phases = _phases(fake.out)
    assert list(phases) == ["target", "data", "store", "train"]
    assert not any(p["reused"] for p in phases.values()) and all(p["seconds"] >= 0 for p in phases.values())
    assert [c[1:3] for c in fake.calls] == [
        ["-m", "dflash.features"],
        ["launch.py", f"hydra.run.dir={fake.run}"],
    ]
    assert "experiment=smollm2_sharegpt" in fake.calls[0] and fake.calls[0][0] == sys.executable

    fake.calls.clear()
    assert make_real.main(fake.args) == 0
    assert all(p["reused"] for p in _phases(fake.out).values()), _phases(fake.out)
    assert [c[1] for c in fake.calls] == ["-m"]  # the store build runs (and finds the store complete); no training
    assert capsys.readouterr().out.splitlines()[-1].startswith("make real: target ")


def test_a_run_cut_short_is_resumed(fake):
    fake.state["ends"] = "interrupted"
    make_real.main(fake.args)
    fake.calls.clear()
    fake.state["ends"] = "completed"
    make_real.main(fake.args)
    (launch,) = [c for c in fake.calls if c[1] == "launch.py"]
    assert launch[2:] == [f"resume={fake.run}"]  # its own saved config, from its last checkpoint


def test_other_overrides_train_in_their_own_run_directory(fake):
    make_real.main(fake.args)
    fake.calls.clear()
    make_real.main([*fake.args, "train.max_steps=100"])
    (launch,) = [c for c in fake.calls if c[1] == "launch.py"]  # not the first run's, reused
    assert launch[2].startswith("hydra.run.dir=") and launch[2] != f"hydra.run.dir={fake.run}"
