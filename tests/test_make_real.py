"""`make real`'s driver (dflash/tools/make_real.py): the phases in order, each timed in phases.json; a second run
reuses every phase; a run cut short is resumed, not started again. The phases' own work is faked here (the slow
test in test_gguf_target.py trains against the real target)."""

from __future__ import annotations

import json
import sys
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
        if cmd[1:3] == ["-m", "dflash.features"] and not store.exists():
            store.mkdir(parents=True)
            (store / "shard-0.safetensors").write_bytes(b"x")
        if cmd[1] == "launch.py":
            where = next(a.split("=", 1)[1] for a in cmd if a.startswith(("hydra.run.dir=", "resume=")))
            (tmp_path / "out" / "run").mkdir(parents=True, exist_ok=True)
            (tmp_path / "out" / "run" / "status.json").write_text(
                json.dumps({"status": state.get("ends", "completed")})
            )
            assert where == str(tmp_path / "out" / "run")

    monkeypatch.setattr(make_real.sharegpt_data, "ensure_target", ensure_target)
    monkeypatch.setattr(make_real.sharegpt_data, "make_data", make_data)
    monkeypatch.setattr(make_real, "_run", run)
    args = ["--out", str(tmp_path / "out"), f"paths.cache_dir={tmp_path / 'cache'}", f"model.target={target}"]
    return SimpleNamespace(calls=calls, state=state, args=args, out=tmp_path / "out")


def _phases(out):
    return json.loads((out / "phases.json").read_text())


def test_the_phases_run_in_order_and_a_second_run_reuses_them(fake, capsys):
    assert make_real.main(fake.args) == 0
    phases = _phases(fake.out)
    assert list(phases) == ["target", "data", "store", "train"]
    assert not any(p["reused"] for p in phases.values()) and all(p["seconds"] >= 0 for p in phases.values())
    assert [c[1:3] for c in fake.calls] == [
        ["-m", "dflash.features"],
        ["launch.py", f"hydra.run.dir={fake.out / 'run'}"],
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
    assert launch[2:] == [f"resume={fake.out / 'run'}"]  # its own saved config, from its last checkpoint
