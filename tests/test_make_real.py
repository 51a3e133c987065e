"""`make real`'s driver (dflash/recipes/make_real.py): the phases in order, each timed in phases.json; a second run
reuses every phase; a run cut short is resumed, not started again. The phases' own work is faked here (the slow
test in test_gguf_target.py trains against the real target)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from dflash.recipes import make_real


@pytest.fixture
def fake(tmp_path, monkeypatch):
    calls: list[list[str]] = []
    state = {"answers": 0}
    target = tmp_path / "cache" / "target"
    store = tmp_path / "cache" / "features"

    def ensure_target(model_cfg):
        state["ensured"] = state.get("ensured", 0) + 1
        target.mkdir(parents=True, exist_ok=True)
        (target / "config.json").write_text("{}")
        return target

    def make_data(argv):
        state["data_argv"] = argv
        if "refuse" in state:
            raise state["refuse"]
        done_before, state["answers"] = state["answers"], 4
        args = make_real.sharegpt_data.parse_args(argv)
        args.out.mkdir(parents=True, exist_ok=True)
        cut = make_real.sharegpt_data.cut_suffix(args.max_turn_chars)
        path = make_real.sharegpt_data.data_path(
            args.out, args.data, args.records, args.original_records, args.mix_seed, args.regen_name, cut
        )
        if not path.exists():
            path.write_text(state.get("data", '{"messages": []}\n'))
        made = 4 - done_before
        cost = {"cpu_s": 5.0, "wall_s": 6.0, "regenerated_answers": 4, "answers_costed": 4, "estimated": False}
        said = state.get("result") or (f"made {made}" if made else "reused")
        return make_real.sharegpt_data.DataMade(path, said, None, cost)

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
            if state.get("finish"):  # what the finish of a run with one of its three suites leaves
                (Path(where) / "run.json").write_text(
                    json.dumps({"packages": {"dflash": "0.1.0"}, "git": {"sha": "0123456789abcdef", "dirty": True}})
                )
                (Path(where) / "summary.json").write_text(json.dumps({"eval/tau": 1.25}))
                bench = {"humaneval@T0": {"settings": {"suite": "humaneval"}, "metrics": {"tau": 1.5}}}
                (Path(where) / "benchmarks.json").write_text(json.dumps({"results": bench}))

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
    assert [p["result"] for p in phases.values()] == ["made", "made 4", "made", "made"]
    assert all(p["cpu_s"] >= 0 for p in phases.values())
    assert [c[1:3] for c in fake.calls] == [["-m", "dflash.features"], ["launch.py", f"hydra.run.dir={run}"]]
    assert "experiment=smollm2_sharegpt" in fake.calls[0] and fake.calls[0][0] == sys.executable

    fake.calls.clear()
    assert make_real.main(fake.args) == 0
    assert all(p["reused"] and p["result"] == "reused" for p in _phases(fake.out).values()), _phases(fake.out)
    assert [c[1] for c in fake.calls] == ["-m"]  # the store build runs (and finds the store complete); no training
    assert "make real: target 0 s, 0 CPU-s (reused), data " in capsys.readouterr().out


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
    (fake.out / "original-5000.jsonl").write_text('{"messages": [{"role": "user", "content": "more"}]}\n')
    fake.calls.clear()
    make_real.main(fake.args)
    assert _trained_in(fake.calls) != first


def test_each_phase_says_what_it_did_and_a_target_that_is_there_is_checked(fake):
    """#48: the data phase said `reused` when every remaining record failed again; the target phase said
    `reused` from config.json alone, without the check of what the folder was converted from."""
    make_real.main(fake.args)
    assert fake.state["ensured"] == 1
    fake.state["result"] = "failed 2"  # no answer made, two failed again
    make_real.main(fake.args)
    phases = _phases(fake.out)
    assert fake.state["ensured"] == 2 and phases["target"]["result"] == "reused"
    assert phases["data"]["result"] == "failed 2" and not phases["data"]["reused"]


def test_the_data_phase_gets_the_runs_device_and_dtype(fake):
    """#48: the data phase regenerated on the CPU with `--dtype auto` whatever the run's model.device and
    model.dtype; now it gets the overrides alone (sharegpt_data takes both from them), and answers of another dtype
    go to a file of their own."""
    make_real.main([*fake.args, "--data", "regenerated", "model.device=cuda", "model.dtype=bfloat16"])
    argv = fake.state["data_argv"]
    assert "--dtype" not in argv and "--device" not in argv
    assert argv[-2:] == ["model.device=cuda", "model.dtype=bfloat16"]
    assert f"data.path={fake.out / 'regen-bfloat16-128tok.jsonl'}" in _launch(fake.calls)


def test_a_run_of_other_code_trains_anew(fake, monkeypatch):
    """#48: the key hashes the package's version and the commit's code (dflash/, conf/, launch.py), not a commit
    of docs or tests alone, nor uncommitted changes."""
    code = {"dflash": "0.1.0", "git": "a" * 40, "code_tree": ["d1", "c1", "l1"], "dirty": False}
    monkeypatch.setattr(make_real, "code_version", lambda: dict(code))

    def runs_after_make_real() -> int:
        make_real.main(fake.args)
        return len(list(fake.out.glob("run-*")))

    assert runs_after_make_real() == 1
    code["dirty"] = True
    code["git"] = "b" * 40  # a commit of docs: the same code trees
    assert runs_after_make_real() == 1
    code["code_tree"] = ["d2", "c1", "l1"]
    assert runs_after_make_real() == 2
    code["dflash"] = "0.2.0"
    assert runs_after_make_real() == 3


def test_the_code_version_names_the_commit_and_its_code_trees():
    code = make_real.code_version()
    if code["git"] is None:
        pytest.skip("not a git checkout")
    assert code["dflash"] and len(code["code_tree"]) == 3


def test_the_summary_names_the_code_the_cost_and_the_suites_not_run(fake, capsys):
    fake.state["finish"] = True
    make_real.main(fake.args)
    run = _trained_in(fake.calls)
    out = capsys.readouterr().out
    assert f"{run.name}: made by dflash 0.1.0, commit 0123456789 (with uncommitted changes)" in out
    assert "suites not run: sharegpt, mt-bench (their data was not found; python -m dflash.benchmark" in out
    cost = json.loads((run / "cost.json").read_text())
    phases = _phases(fake.out)
    assert cost["cpu_s"]["data"] == 5.0 and cost["train"]["launches"] == 1  # the data's own account
    assert cost["cpu_s"]["store"] == phases["store"]["cpu_s"] and cost["store"]["builds"] == 1
    assert cost["total_cpu_s"] == round(5.0 + phases["store"]["cpu_s"] + phases["train"]["cpu_s"], 1)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["cost/cpu_s"] == cost["total_cpu_s"] and summary["cost/data_cpu_s"] == 5.0
    assert f"cost of the run: {cost['total_cpu_s']:,.0f} CPU-s (data 5, store " in out

    make_real.main(fake.args)  # every phase reused: the run's cost stays what making it cost
    again = json.loads((run / "cost.json").read_text())
    assert len(again["invocations"]) == 2 and again["train"]["launches"] == 1
    assert again["total_cpu_s"] == cost["total_cpu_s"] and again["store"]["builds"] == 1


def test_seq_len_scales_the_anchors_unless_they_are_set(fake):
    make_real.main([*fake.args, "--seq-len", "1024"])
    assert {"train.seq_len=1024", "train.num_anchors=128"} <= set(_launch(fake.calls))
    fake.calls.clear()
    make_real.main([*fake.args, "--seq-len", "512", "train.num_anchors=40"])
    launch = _launch(fake.calls)
    assert "train.seq_len=512" in launch and [a for a in launch if "num_anchors" in a] == ["train.num_anchors=40"]


def test_mix_and_original_train_on_their_own_files(fake):
    make_real.main([*fake.args, "--data", "mix", "--original-records", "8", "--records", "16"])
    argv = fake.state["data_argv"]
    assert argv[argv.index("--data") + 1] == "mix" and argv[argv.index("--original-records") + 1] == "8"
    assert f"data.path={fake.out / 'mix-regen-16+original-8-seed0.jsonl'}" in _launch(fake.calls)
    fake.calls.clear()
    make_real.main([*fake.args, "--data", "original", "--original-records", "8"])
    assert f"data.path={fake.out / 'original-8.jsonl'}" in _launch(fake.calls)


def test_turns_cut_elsewhere_train_on_their_own_files(fake):
    """--max-turn-chars reaches the data step, and its files (originals, regenerated answers, their prompts) are
    named by the cut, beside the default's; a cut below 1 is refused before anything is fetched."""
    make_real.main([*fake.args, "--original-records", "8", "--max-turn-chars", "4000"])
    argv = fake.state["data_argv"]
    assert argv[argv.index("--max-turn-chars") + 1] == "4000"
    assert f"data.path={fake.out / 'original-8-cut4000.jsonl'}" in _launch(fake.calls)
    fake.calls.clear()
    make_real.main([*fake.args, "--data", "regenerated", "--records", "8", "--max-turn-chars", "4000"])
    assert f"data.path={fake.out / 'regen-cut4000.jsonl'}" in _launch(fake.calls)
    fake.calls.clear()
    ensured = fake.state["ensured"]
    with pytest.raises(SystemExit):
        make_real.main([*fake.args, "--max-turn-chars", "0"])
    assert not fake.calls and fake.state["ensured"] == ensured  # refused before the target is fetched


def test_answers_of_other_settings_stop_make_real_in_one_line(fake):
    """The old `--dtype auto` left bfloat16 answers where float32 ones are asked for now: refused, naming both."""
    from dflash.recipes.regenerate import SettingsMismatch

    fake.state["refuse"] = SettingsMismatch("regen.jsonl holds 400 answers made with other settings (dtype: ...)")
    with pytest.raises(SystemExit, match=r"^error: regen.jsonl holds 400 answers made with other settings"):
        make_real.main(fake.args)
    assert _phases(fake.out)["data"]["result"] == "failed" and not fake.calls  # no store built, nothing trained


def test_the_default_trains_on_5000_originals_labelled_by_the_target(fake):
    """#46: at equal CPU time ShareGPT's answers labelled by the target were ahead of regenerated ones, so they are
    make real's default; `--data regenerated` keeps its own default size."""
    assert (make_real.parse_args([]).data, make_real.parse_args([]).records) == ("original", 5000)
    assert make_real.parse_args(["--data", "regenerated"]).records == 1200
    assert make_real.parse_args(["--data", "original", "--records", "300"]).records == 300
    make_real.main(fake.args)
    assert fake.state["data_argv"][fake.state["data_argv"].index("--records") + 1] == "5000"
    assert f"data.path={fake.out / 'original-5000.jsonl'}" in _launch(fake.calls)
    cfg = make_real.sharegpt_data.compose(make_real.EXPERIMENT, [])
    assert (cfg.data.path, cfg.loss.labels, cfg.train.max_steps) == ("outputs/smollm2_sharegpt/original-5000.jsonl",
                                                                     "target", 2000)  # fmt: skip
