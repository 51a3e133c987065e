"""`python -m dflash.bench sweep [key=value ...]`: what a feature store saves a sweep, measured in one run.

For each pipeline mode it runs the same `jobs`-job Hydra multirun (`launch.py -m loss.kl_temperature=1,2,4,...`)
twice on a random target of the embedded default's shape (hidden 256, 6 layers, built once, not counted):

  online   the multirun as it is: every job runs the target over the same batches
  store    `python -m dflash.features build` once, then the multirun with `features=store` (the build counted)

and reports each one's wall time and compute: CPU seconds (user + sys) of every process it started, from
`getrusage(RUSAGE_CHILDREN)` around each subprocess (a process's threads and its children included).

In the same run it times the stages on the same config and batches, in this process with the runs' torch threads:
the target pass, the drafter step, the store's write (cast, safetensors file, sha256) and read (sha256 check,
mapping, the items), each summed over `steps` batches, once before the sweeps and once after (a shared machine
drifts by ~10% over a long bench; the table is their mean and a line shows both). Their sum is the sweep's limit:

  limit = one target pass + store write + jobs x (drafter steps + store read)

Where the store sweep's CPU went comes from the jobs' own summaries: each job counts its drafter steps' and its
reader's CPU seconds (`perf/drafter_cpu_s`, `perf/source_cpu_s`) and its whole job's (`perf/job_cpu_s`); the rest
of the multirun process is its start-up, imports and Hydra. So a miss is named: slower steps in the jobs than in
the probe, or costs outside the steps.

and the bench prints the store sweep's cost over that limit and checks the goal, store CPU <= (1 + goal) x limit,
as PASS or MISS. What the limit leaves out is what a job pays besides its steps: starting Python, imports,
loading the target or its heads, the data, the final checkpoint. Their share falls as `steps` grows; to see the
rest, the sweeps run again at `base_steps` steps per job, and the cost per step between the two sizes (the fixed
costs cancel) is checked against the limit's per step the same way (n/a when noise makes it negative), and the
line ends with the job length from which the whole sweep meets the goal, given those fixed costs.

Options: steps=30 jobs=4 seed=0 modes=sync,async batch_size=4 seq_len=256 num_anchors=16 block_size=8
threads=1 dtype=float32 goal=0.10 base_steps=1 (0: one size only) workdir= (empty: a temporary directory,
removed after; else kept there).
`threads` is `pipeline.threads_per_stage` of the runs (1: sync uses one core, async one per stage).
"""

from __future__ import annotations

import itertools
import json
import math
import os
import resource
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

DEFAULTS = {
    "steps": "30",
    "jobs": "4",
    "seed": "0",
    "modes": "sync,async",
    "batch_size": "4",
    "seq_len": "256",
    "num_anchors": "16",
    "block_size": "8",
    "threads": "1",
    "dtype": "float32",
    "goal": "0.10",
    "base_steps": "1",
    "workdir": "",
}
REPO = Path(__file__).resolve().parents[2]
STAGES = ("target pass", "drafter step", "store write", "store read")
SWEEP_HEADER = "| pipeline | sweep | wall s | CPU s | wall / online | CPU / online |"
ACCOUNT_HEADER = (
    "| pipeline | drafter steps | store reads | rest of the jobs | multirun process outside the jobs | store jobs |"
)


def common_overrides(opts: dict) -> list[str]:
    """The config every run of the bench shares: a tiny_random target of the embedded default's shape."""
    from dflash.benchmarks.pipeline import SHAPES

    shape = {**SHAPES["tiny"], "num_layers": SHAPES["tiny"]["num_hidden_layers"]}
    keys = ("vocab_size", "hidden_size", "num_layers", "num_attention_heads", "num_key_value_heads", "head_dim")
    build = [f"model.build.{k}={shape[k]}" for k in (*keys, "intermediate_size")]
    return [
        "model=tiny_random",
        "loss=kl_streak",  # a loss that the swept loss.kl_temperature changes (the default dpace has no KL term)
        *build,
        f"model.block_size={opts['block_size']}",
        "model.num_draft_layers=2",
        "model.target_layer_ids=[1,3]",
        "logging=jsonl",
        "logging.report=false",
        "data.regenerate.enabled=false",  # the same data in every run, nothing generated per job
        "data.max_files=40",
        "eval.num_prompts=0",  # an eval would load the whole target in the store runs too
        f"train.batch_size={opts['batch_size']}",
        f"train.seq_len={opts['seq_len']}",
        f"train.num_anchors={opts['num_anchors']}",
        f"train.max_steps={opts['steps']}",
        f"train.seed={opts['seed']}",
        f"pipeline.threads_per_stage={opts['threads']}",
        f"features.dtype={opts['dtype']}",
    ]


def temperatures(jobs: int) -> str:
    return ",".join(str(2**i) for i in range(jobs))


def timed(cmd: list[str], env: dict) -> tuple[float, float]:
    """(wall s, CPU s user + sys of the process and its children) of one command, which must succeed."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise SystemExit(f"failed (rc {proc.returncode}): {' '.join(cmd)}\n{proc.stderr[-4000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu


def completed_jobs(sweep_dir: Path) -> int:
    """Jobs of a multirun whose status.json says completed (a failed job must not look cheap)."""
    done = 0
    for status in sweep_dir.glob("*/status.json"):
        done += json.loads(status.read_text()).get("status") == "completed"
    return done


def job_account(sweep_dir: Path) -> dict[str, float]:
    """CPU seconds the store jobs counted themselves, summed over the jobs of a multirun (their summary.json)."""
    keys = {"drafter steps": "perf/drafter_cpu_s", "store reads": "perf/source_cpu_s", "jobs": "perf/job_cpu_s"}
    total = dict.fromkeys(keys, 0.0)
    for summary in sweep_dir.glob("*/summary.json"):
        data = json.loads(summary.read_text())
        for name, key in keys.items():
            total[name] += float(data[key])
    return total


def run_sweeps(opts: dict, work: Path, mode: str, env: dict, steps: int) -> dict:
    """The online multirun, the store build and the store multirun of one pipeline mode at `steps` steps per job:
    (wall, CPU) each, and the store jobs' own account of their CPU (`account`)."""
    jobs, tag = int(opts["jobs"]), f"{mode}_{steps}"
    common = [*common_overrides({**opts, "steps": str(steps)}), f"pipeline={mode}"]
    launch = [sys.executable, str(REPO / "launch.py"), "-m", f"loss.kl_temperature={temperatures(jobs)}"]
    store, online_dir, store_dir = work / f"store_{tag}", work / f"online_{tag}", work / f"store_{tag}_jobs"
    out = {"online": timed([*launch, *common, f"hydra.sweep.dir={online_dir}"], env)}
    features = ["features=store", f"features.path={store}"]
    out["store build"] = timed([sys.executable, "-m", "dflash.features", "build", *common, *features], env)
    out["store jobs"] = timed([*launch, *common, *features, f"hydra.sweep.dir={store_dir}"], env)
    for sweep_dir in (online_dir, store_dir):
        if completed_jobs(sweep_dir) != jobs:
            raise SystemExit(f"{sweep_dir}: {completed_jobs(sweep_dir)} of {jobs} jobs completed")
    wall, cpu = (out["store build"][i] + out["store jobs"][i] for i in (0, 1))
    out["store"] = (wall, cpu)
    out["account"] = job_account(store_dir)
    return out


@contextmanager
def clocks(costs: dict, name: str):
    """Adds this block's (wall s, CPU s of this process) to costs[name]."""
    w0, c0 = time.perf_counter(), time.process_time()
    yield
    wall, cpu = costs.get(name, (0.0, 0.0))
    costs[name] = (wall + time.perf_counter() - w0, cpu + time.process_time() - c0)


def stage_costs(opts: dict, work: Path) -> dict[str, tuple[float, float]]:
    """(wall s, CPU s) of each stage summed over the run's `steps` batches, timed here with the runs' threads;
    the probe's store is written under `work` (a new directory per call)."""
    import torch

    from dflash.cli.features import compose
    from dflash.core.distributed import World
    from dflash.data.fingerprint import data_fingerprint
    from dflash.model.build import build_drafter_config, init_drafter, resolve_mask_token_id
    from dflash.model.target import DTYPES, greedy_tokens
    from dflash.runner.sources import target_and_data, target_files
    from dflash.train.feature_store import StoreReader, StoreWriter, manifest_for
    from dflash.train.trainer import DrafterTrainer, TargetForward, total_steps

    probe = work / f"probe_{len(list(work.glob('probe_*')))}"
    cfg = compose([*common_overrides(opts), "pipeline=sync", "features=store", f"features.path={probe}"])
    torch.set_num_threads(int(opts["threads"]))
    world, device = World(), torch.device("cpu")
    files = target_files(cfg, world)
    loaded = target_and_data(cfg, world, files, ["cpu"])
    batches = list(itertools.islice(loaded.data.batches.iterate(0, 0), total_steps(cfg.train)))
    mask_id = resolve_mask_token_id(cfg.model, files.tokenizer, files.config.vocab_size)
    drafter_config = build_drafter_config(files.config, cfg.model, files.layer_ids, mask_id)
    drafter = init_drafter(drafter_config, cfg.train.seed, device, DTYPES[cfg.model.dtype])
    trainer = DrafterTrainer(cfg, loaded.target, drafter, mask_id, total_steps(cfg.train))
    manifest = manifest_for(cfg, files.layer_ids, data_fingerprint(cfg.data, cfg.model.target))
    writer = StoreWriter(probe, {**manifest, "num_batches": len(batches)}, cfg.features.shard_batches)
    forward, costs, per_shard = TargetForward(loaded.target, device), {}, cfg.features.shard_batches
    items = []
    for i, batch in enumerate(batches):
        with clocks(costs, "target pass"):  # as the build: the features and the target's argmax
            items.append(forward(batch))
            argmax = greedy_tokens(items[-1].last_hidden, loaded.target.lm_head.weight)
        with clocks(costs, "store write"):
            writer.add(batch, items[-1].target_hidden, items[-1].last_hidden, argmax)
            if (i + 1) % per_shard == 0 or i + 1 == len(batches):  # as the build commits its shards
                writer.commit(i // per_shard)
    with clocks(costs, "store write"):
        writer.close(len(batches))
    for item in items:
        with clocks(costs, "drafter step"):
            trainer.train_on(item)
    with clocks(costs, "store read"):
        read = sum(1 for _ in StoreReader(probe, (0, 0), device))
    if read != len(batches):
        raise RuntimeError(f"the probe store gave back {read} of {len(batches)} batches")
    return costs


def mean_costs(probes: list[dict]) -> dict[str, tuple[float, float]]:
    """Each stage's (wall, CPU) averaged over the probes."""
    return {name: tuple(sum(p[name][i] for p in probes) / len(probes) for i in (0, 1)) for name in probes[0]}


def probe_line(probes: list[dict], steps: int) -> str:
    per_batch = {name: " / ".join(f"{p[name][1] / steps * 1e3:.1f}" for p in probes) for name in STAGES}
    return "each probe (before / after the sweeps), CPU ms per batch: " + ", ".join(
        f"{name} {v}" for name, v in per_batch.items()
    )


def account_lines(opts: dict, stages: dict, sweeps: dict[str, dict]) -> list[str]:
    """Where each store multirun's CPU went, by the jobs' own counts, and their steps against the probe's."""
    jobs, steps = int(opts["jobs"]), int(opts["steps"])
    lines = ["where the store jobs' CPU s went (the jobs' own counts, summed over the jobs):", ACCOUNT_HEADER]
    lines.append("|---|---|---|---|---|---|")
    notes = []
    for mode, runs in sweeps.items():
        acc, total = runs["account"], runs["store jobs"][1]
        rest, outside = acc["jobs"] - acc["drafter steps"] - acc["store reads"], total - acc["jobs"]
        cells = (acc["drafter steps"], acc["store reads"], rest, outside, total)
        lines.append(f"| {mode} | " + " | ".join(f"{v:.3f}" for v in cells) + " |")
        in_jobs = acc["drafter steps"] / (jobs * steps) * 1e3
        probe = stages["drafter step"][1] / steps * 1e3
        notes.append(
            f"{mode}: a drafter step in the jobs {in_jobs:.1f} CPU ms, in the probe {probe:.1f} "
            f"({in_jobs / probe:.3f}); outside the steps and reads: {rest + outside:.1f} CPU s over {jobs} jobs"
        )
    return [*lines, *notes]


def limit(stages: dict, jobs: int) -> tuple[float, float]:
    """One target pass and the store's write, then each job's drafter steps and store read: (wall, CPU)."""
    once, per_job = ("target pass", "store write"), ("drafter step", "store read")
    return tuple(sum(stages[s][i] for s in once) + jobs * sum(stages[s][i] for s in per_job) for i in (0, 1))


def report(
    opts: dict, stages: dict, sweeps: dict[str, dict], base: dict[str, dict] | None = None, probes: list | None = None
) -> list[str]:
    """The printed tables and verdicts (a test parses them). `stages`: the probes' mean; `probes`: each probe's
    (one line). `base`: each mode's sweeps at `base_steps` steps, whose difference to `sweeps` is the cost per step
    without the fixed costs (start-up, loading, the data)."""
    jobs, steps, goal = int(opts["jobs"]), int(opts["steps"]), float(opts["goal"])
    lines = [f"stage costs over {steps} batches (this process, {opts['threads']} torch thread(s), mean of the probes):"]
    lines.append("| stage | wall s | CPU s | CPU ms per batch |")
    lines.append("|---|---|---|---|")
    for name in STAGES:
        wall, cpu = stages[name]
        lines.append(f"| {name} | {wall:.3f} | {cpu:.3f} | {cpu / steps * 1e3:.2f} |")
    if probes:
        lines.append(probe_line(probes, steps))
    t, d = stages["target pass"][1], stages["drafter step"][1]
    lines.append(f"target share of one job's stage CPU: {t / (t + d):.2f}")
    lines.append("")
    lines.append(SWEEP_HEADER)
    lines.append("|---|---|---|---|---|---|")
    verdicts = []
    for mode, runs in sweeps.items():
        rows = {**runs, "limit": limit(stages, jobs)}
        online = rows["online"]
        for name in ("online", "store build", "store jobs", "store", "limit"):
            lines.append(_row(mode, name, rows[name], online))
        for name in ("online", "store") if base and mode in base else ():  # the same sweeps at base_steps
            lines.append(_row(mode, f"{name}, {opts['base_steps']} step(s)", base[mode][name], base[mode]["online"]))
        (store_wall, store_cpu), (limit_wall, limit_cpu) = rows["store"], rows["limit"]
        ratio = store_cpu / limit_cpu
        verdict = "PASS" if ratio <= 1 + goal else "MISS"
        verdicts.append(
            f"{mode}: store sweep CPU / limit = {ratio:.3f} (goal <= {1 + goal:.2f}): {verdict}; "
            f"wall / limit = {store_wall / limit_wall:.3f}; beyond the limit: {store_cpu - limit_cpu:.1f} CPU s"
        )
        if base and mode in base:
            verdicts.append(marginal(opts, stages, runs, base[mode], mode))
    accounted = {mode: runs for mode, runs in sweeps.items() if "account" in runs}
    account = ["", *account_lines(opts, stages, accounted)] if accounted else []
    return [*lines, *account, "", *verdicts]


def _row(mode: str, name: str, cost: tuple[float, float], online: tuple[float, float]) -> str:
    wall, cpu = cost
    return f"| {mode} | {name} | {wall:.2f} | {cpu:.2f} | {wall / online[0]:.3f} | {cpu / online[1]:.3f} |"


def marginal(opts: dict, stages: dict, runs: dict, small: dict, mode: str) -> str:
    """The store sweep's CPU per step beyond `base_steps`, over the limit's per step: the fixed costs cancel."""
    jobs, steps, base = (int(opts[k]) for k in ("jobs", "steps", "base_steps"))
    goal = float(opts["goal"])
    per_step = limit(stages, jobs)[1] / steps
    online_per_step = jobs * (stages["target pass"][1] + stages["drafter step"][1]) / steps
    store_per_step = (runs["store"][1] - small["store"][1]) / (steps - base)
    ratio = store_per_step / per_step
    # a difference at or below zero is noise larger than the steps' cost (a loaded machine, too few steps)
    verdict = "n/a (below the noise: raise steps)" if ratio <= 0 else "PASS" if ratio <= 1 + goal else "MISS"
    fixed_store, fixed_online = small["store"][1] - base * per_step, small["online"][1] - base * online_per_step
    return (
        f"{mode}: per step, fixed costs removed: store sweep (CPU at {steps} - at {base} steps) / {steps - base} = "
        f"{store_per_step:.3f} CPU s, limit {per_step:.3f}: ratio {ratio:.3f} (goal <= {1 + goal:.2f}): "
        f"{verdict}; fixed costs (at {base} step(s), less its limit): "
        f"store sweep {fixed_store:.1f} CPU s, online {fixed_online:.1f}; "
        + goal_from(small["store"][1] - base * store_per_step, store_per_step, per_step, goal)
    )


def goal_from(fixed: float, store_per_step: float, limit_per_step: float, goal: float) -> str:
    """From how many steps per job the whole store sweep meets the goal: its CPU is fixed + store_per_step x s,
    its limit limit_per_step x s (the stages scale with the steps), so (fixed + b s) / (l s) <= 1 + goal from
    s = fixed / ((1 + goal) l - b) on, if the steps themselves are within the goal."""
    room = (1 + goal) * limit_per_step - store_per_step
    if room <= 0 or store_per_step <= 0:
        return "the total meets the goal at no job length (a step alone is beyond it, or below the noise)"
    return f"the total meets the goal from about {max(1, math.ceil(fixed / room))} steps per job on"


def bench(args: list[str]) -> None:
    from dflash.benchmarks.options import parse_opts

    opts = parse_opts(args, DEFAULTS)
    modes = [m for m in opts["modes"].split(",") if m]
    if not set(modes) <= {"sync", "async"} or int(opts["jobs"]) < 1 or int(opts["steps"]) < 1:
        raise SystemExit("modes is sync and/or async (comma-separated); jobs and steps are at least 1")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(opts["workdir"] or tmp).resolve()
        work.mkdir(parents=True, exist_ok=True)
        cache = work / "cache"  # the bench's own target: built here once (by stage_costs), read by every run
        env = {**os.environ, "DFLASH_CACHE_DIR": str(cache), "WANDB_MODE": "disabled", "PYTHONUNBUFFERED": "1"}
        env["OMP_NUM_THREADS"] = opts["threads"]  # the build and data too: no spinning threads on busy cores
        saved = os.environ.get("DFLASH_CACHE_DIR")
        os.environ["DFLASH_CACHE_DIR"] = str(cache)
        try:
            probes = [stage_costs(opts, work)]
            sweeps = {mode: run_sweeps(opts, work, mode, env, int(opts["steps"])) for mode in modes}
            small = int(opts["base_steps"])  # 0: no second size
            base = (
                {mode: run_sweeps(opts, work, mode, env, small) for mode in modes}
                if 0 < small < int(opts["steps"])
                else None
            )
            probes.append(stage_costs(opts, work))  # the machine's drift over the bench, averaged out
        finally:
            os.environ.pop("DFLASH_CACHE_DIR") if saved is None else os.environ.update(DFLASH_CACHE_DIR=saved)
    print(
        f"sweep bench: {opts['jobs']} jobs (loss.kl_temperature={temperatures(int(opts['jobs']))}) x {opts['steps']} "
        f"steps, random target hidden 256 x 6 layers, batch {opts['batch_size']} x {opts['seq_len']}, "
        f"{opts['num_anchors']} anchors, block {opts['block_size']}, {opts['threads']} torch thread(s) per stage, "
        f"store {opts['dtype']}, seed {opts['seed']}, {os.cpu_count()} cores"
    )
    print("\n".join(report(opts, mean_costs(probes), sweeps, base, probes)))
