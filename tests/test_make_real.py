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
        out = Path(argv[argv.index("--out") + 1])
        out.mkdir(parents=True, exist_ok=True)
        regen = out / "regen.jsonl"
        if not regen.exists():
            regen.write_text(state.get("data", '{"messages": []}\n'))
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
    return SimpleNamespace(calls=calls, state=state, args=args, out=tmp_path / "out")


def _launch(calls):
    (launch,) = [c for c in calls if c[1] == "launch.py"]
    return launch


def _trained_in(calls) -> Path:
    return Path(_launch(calls)[2].split("=", 1)[1])


def _phases(out):
    return json.loads((out / "phases.json").read_text())


def test_the_phases_run_in_order_and_a_second_run_reuses_them(fake, capsys):
    assert make_real.main(fake.args) == 0
    run = _trained_in(fake.calls)
    assert run.parent == fake.out and run.name.startswith("run-")
    phases = _phases(fake.out)
    assert list(phases) == ["target", "data", "store", "train"]
    assert not any(p["reused"] for p in phases.values()) and all(p["seconds"] >= 0 for p in phases.values())
    assert [c[1:3] for c in fake.calls] == [["-m", "dflash.features"], ["launch.py", f"hydra.run.dir={run}"]]
    assert "experiment=smollm2_sharegpt" in fake.calls[0] and fake.calls[0][0] == sys.executable

    fake.calls.clear()
    assert make_real.main(fake.args) == 0
    assert all(p["reused"] for p in _phases(fake.out).values()), _phases(fake.out)
    assert [c[1] for c in fake.calls] == ["-m"]  # the store build runs (and finds the store complete); no training
    assert capsys.readouterr().out.splitlines()[-1].startswith("make real: target ")


def test_a_run_cut_short_is_resumed(fake):
    fake.state["ends"] = "interrupted"
    make_real.main(fake.args)
    first = _trained_in(fake.calls)
    fake.calls.clear()
    fake.state["ends"] = "completed"
    make_real.main(fake.args)
    assert _launch(fake.calls)[2:] == [f"resume={first}"]  # its own saved config, from its last checkpoint


def _trains_anew(fake, argv) -> bool:
    """A completed run first; then whether `argv` trains in a directory of its own instead of reusing it."""
    make_real.main(fake.args)
    first = _trained_in(fake.calls)
    fake.calls.clear()
    make_real.main(argv)
    launches = [c for c in fake.calls if c[1] == "launch.py"]
    return bool(launches) and _trained_in(fake.calls) != first and _launch(fake.calls)[2].startswith("hydra.run.dir=")


def test_other_overrides_train_in_their_own_run_directory(fake):
    assert _trains_anew(fake, [*fake.args, "train.max_steps=100"])


def test_logging_settings_reuse_the_run(fake):
    assert not _trains_anew(fake, [*fake.args, "logging.console=false"])


def test_another_default_trains_anew(fake, monkeypatch):
    """The run is keyed on the resolved config, not the command line: a default changed between two `make real`s
    (say `optim`) never reuses a run made under the old one."""
    compose = make_real.sharegpt_data.compose

    def other_default(experiment, overrides):
        cfg = compose(experiment, overrides)
        cfg.optim.name = "not-" + cfg.optim.name
        return cfg

    make_real.main(fake.args)
    first = _trained_in(fake.calls)
    fake.calls.clear()
    monkeypatch.setattr(make_real.sharegpt_data, "compose", other_default)
    make_real.main(fake.args)
    assert _trained_in(fake.calls) != first


def test_other_data_trains_anew(fake):
    make_real.main(fake.args)
    first = _trained_in(fake.calls)
    (fake.out / "regen.jsonl").write_text('{"messages": [{"role": "user", "content": "more"}]}\n')
    fake.calls.clear()
    make_real.main(fake.args)
    assert _trained_in(fake.calls) != first
