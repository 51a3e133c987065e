"""The code of `python -m dflash.benchmark RUN_DIR_OR_DRAFTER`: tau and speedup per benchmark suite (gsm8k,
math500, humaneval, mbpp, mt-bench as z-lab's dflash/benchmark.py, sharegpt, jsonl:PATH), at each temperature;
writes benchmarks.json and benchmarks.md (code: `dflash.evaluation.benchmark`, suites: `dflash.evaluation.suites`).

Example: python -m dflash.benchmark outputs/runs/RUN --suites humaneval,sharegpt --temperature 0,1 --max-samples 20
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path

log = logging.getLogger(__name__)

DEFAULT_SUITES = "gsm8k,math500,humaneval,mbpp,mt-bench"


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m dflash.benchmark", description=__doc__.split("\n\n")[0])
    ap.add_argument("path", help="a run directory, a checkpoint directory or an exported drafter directory")
    ap.add_argument("--target", help="default: the run's model.target or the drafter config's dflash_target")
    ap.add_argument("--suites", default=DEFAULT_SUITES, help=f"comma-separated (default {DEFAULT_SUITES})")
    ap.add_argument("--temperature", default="0", help="comma-separated temperatures, e.g. 0,1")
    ap.add_argument(
        "--thinking",
        choices=("on", "off", "auto"),
        help="Qwen3 enable_thinking (default: as the run's data.chat_template_kwargs rendered, else off: z-lab's)",
    )
    ap.add_argument("--max-samples", type=int, help="rows per suite, sampled as z-lab samples (default: all)")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--block-size", type=int, help="default: the drafter's")
    ap.add_argument("--ngram", type=int, default=3, help="prompt lookup's n-gram size")
    ap.add_argument("--no-lookup", action="store_true", help="skip the prompt-lookup baseline")
    ap.add_argument("--seed", type=int, default=0, help="sampling at temperature > 0")
    ap.add_argument(
        "--cache-dir", help="local suite copies live in CACHE_DIR/bench (default: the run's paths.cache_dir)"
    )
    ap.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    ap.add_argument("--out", help="output directory (default: the run directory, else the current directory)")
    ap.add_argument(
        "--wandb",
        choices=("auto", "off"),
        default="auto",
        help="auto: a run that logged to W&B gets the results in its own W&B run (bench/table, bench/* summary)",
    )
    ap.add_argument(
        "--replay",
        action="store_true",
        help="decode benchmarks.json's recorded temperature-0 prompts again; exit 1 if any acceptance sequence differs",
    )
    ap.add_argument(
        "--traces",
        action="store_true",
        help="tau by replay over the target's greedy outputs, decoded once and cached as eval.replay caches them "
        "(a run directory: its target in its model.dtype; temperature 0; no speed); makes every prompt affordable",
    )
    return ap.parse_args(argv)


def _load(args):
    """(target model, drafter, tokenizer, target name, drafter source, run config or None)."""
    import torch
    from omegaconf import OmegaConf
    from transformers import AutoTokenizer

    from dflash.core.distributed import resolve_device
    from dflash.core.rundir import RunDir
    from dflash.evaluation.cli import _resolve_run_target
    from dflash.evaluation.decoding import module_dtype
    from dflash.model.export import check_drafter_against
    from dflash.model.families import check_block_size
    from dflash.model.target import check_target_exists, load_causal_lm
    from dflash.train.checkpointer import load_drafter_from_source

    path = Path(args.path).expanduser()
    drafter, target = load_drafter_from_source(path)
    if args.block_size:  # before the target loads: a block size the family cannot run is refused at once
        check_block_size(drafter, args.block_size)
    run = RunDir(path)
    run_cfg = OmegaConf.load(run.config_file) if run.config_file.is_file() else None
    if run_cfg is not None and target is not None:
        target = _resolve_run_target(run, str(target))
    if target is None and (path / "config.json").is_file():
        target = json.loads((path / "config.json").read_text()).get("dflash_target")
    target = args.target or target
    if not target:
        raise ValueError(f"{path}: no target recorded; pass --target PATH_OR_HUB_NAME")
    check_target_exists(str(target))
    device = resolve_device(args.device)
    if args.traces:  # refused before the target loads; the dtype the run's traces are decoded in, as its eval's
        if run_cfg is None:
            raise ValueError(f"{path}: --traces needs a run directory (its target and dtype key the traces)")
        if any(float(t) != 0.0 for t in args.temperature.split(",")):
            raise ValueError("--traces replays greedy decoding only: use --temperature 0")
        drafter = drafter.to(getattr(torch, run_cfg.model.dtype))
    drafter = drafter.to(device).eval()
    model = load_causal_lm(str(target), module_dtype(drafter)).to(device).eval()
    check_drafter_against(drafter.config, target_config=model.config)
    return model, drafter, AutoTokenizer.from_pretrained(str(target)), str(target), run_cfg


def rendering(args) -> dict:
    """run_benchmarks' `thinking` and `template_kwargs`: the chat rendering the drafter was trained on (its run's
    data.chat_template_kwargs, or its export's record) under --thinking; a --thinking that renders otherwise
    warns in one line."""
    from dflash.model.rendering import trained_rendering, warn_if_rendered_otherwise

    trained = trained_rendering(args.path)
    known = dict(trained or {})
    if args.thinking is None:
        return {"thinking": known.get("enable_thinking", False), "template_kwargs": known}
    thinking = None if args.thinking == "auto" else args.thinking == "on"
    here = {**known, "enable_thinking": thinking} if thinking is not None else known
    if trained is not None and "enable_thinking" in known:
        warn_if_rendered_otherwise(args.path, trained, here, f"--thinking {args.thinking}")
    return {"thinking": thinking, "template_kwargs": {k: v for k, v in known.items() if k != "enable_thinking"}}


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `python -m dflash.benchmark`; returns the exit status (2 for a user error)."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args = _parse_args(argv)
    from omegaconf import OmegaConf

    from dflash.evaluation.benchmark import TABLE_FILE, run_benchmarks

    try:
        model, drafter, tokenizer, target, run_cfg = _load(args)
        out = Path(args.out or (args.path if run_cfg is not None else "."))
        if args.replay:
            return _replay(model, drafter, out)
        cache_dir = args.cache_dir or (OmegaConf.select(run_cfg, "paths.cache_dir") if run_cfg is not None else None)
        traces = _trace_cache(args, run_cfg, target, drafter, cache_dir) if args.traces else None
        data = run_benchmarks(
            model,
            drafter,
            tokenizer,
            out,
            suites=[s.strip() for s in args.suites.split(",") if s.strip()],
            temperatures=[float(t) for t in args.temperature.split(",")],
            **rendering(args),
            max_samples=args.max_samples,
            max_new_tokens=args.max_new_tokens,
            block_size=args.block_size,
            ngram=args.ngram,
            seed=args.seed,
            cache_dir=cache_dir or os.environ.get("DFLASH_CACHE_DIR"),
            lookup=not args.no_lookup,
            info={"drafter": str(args.path), "target": target, "device": str(model.device)},
            trace_cache=traces,
        )
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if run_cfg is not None and args.wandb == "auto":
        _log_to_wandb(run_cfg, Path(args.path), data)
    print((out / TABLE_FILE).read_text(), end="")
    print(f"wrote {out / 'benchmarks.json'} ({len(data['results'])} results) and {out / TABLE_FILE}")
    for name, why in data["missing"].items():
        print(f"skipped {name}: {why}", file=sys.stderr)
    return 0


def _log_to_wandb(run_cfg, run_path: Path, data: dict) -> None:
    """The benchmarks into the W&B run the training run logged to (resumed by the id its latest checkpoint
    recorded): the bench/table table, the tau chart and the bench/* summary. Never fatal: W&B's own fallbacks
    (offline, not installed, unreachable) apply, and the files are written already."""
    from omegaconf import OmegaConf

    from dflash.core.rundir import bench_metrics
    from dflash.tracking import RunInfo, WandbCallback
    from dflash.train.checkpoint import latest_checkpoint, read_meta

    wandb_cfg = OmegaConf.select(run_cfg, "logging.wandb")
    if wandb_cfg is None or wandb_cfg.mode == "disabled":
        return
    ckpt = latest_checkpoint(run_path)
    meta = read_meta(ckpt) if ckpt is not None else {}
    if not meta.get("wandb_run_id"):
        log.info("W&B: the run recorded no W&B run id (no checkpoint); the benchmarks are in the files only")
        return
    callback = WandbCallback(wandb_cfg, run_path)
    config = OmegaConf.to_container(run_cfg, resolve=False)
    info = RunInfo(run_path, config, 0, run_path.name, wandb_run_id=meta["wandb_run_id"])
    callback.on_run_start(info)
    callback.on_benchmarks(int(meta.get("step", 0)), data)
    callback.on_run_end("completed", bench_metrics(data))


def _trace_cache(args, run_cfg, target: str, drafter, cache_dir):
    """eval.replay's traces of the run's target at this command's settings (shared with its training-time evals
    where they agree: the same target files, max new tokens, block size, layers and dtype)."""
    from omegaconf import OmegaConf

    from dflash.evaluation.evaluator import trace_cache_for

    settings = {"max_new_tokens": args.max_new_tokens}
    cfg = OmegaConf.merge(run_cfg, {"eval": settings, "model": {"target": target}, "paths": {"cache_dir": cache_dir}})
    if args.block_size:
        cfg.model.block_size = args.block_size
    return trace_cache_for(cfg, drafter.target_layer_ids)


def _replay(model, drafter, out: Path) -> int:
    from dflash.core.jsonio import read_json
    from dflash.evaluation.benchmark import BENCH_FILE, replay

    data = read_json(out / BENCH_FILE)
    if not data or not data.get("results"):
        raise FileNotFoundError(f"{out / BENCH_FILE}: no recorded results to replay")
    differ = 0
    for key, r in data["results"].items():
        if r["settings"]["temperature"] > 0:
            print(f"{key}: not replayed (sampled at temperature {r['settings']['temperature']:g})")
            continue
        got = replay(model, drafter, data, key)
        same = sum(g == rec["accept_lengths"] for g, rec in zip(got, r["generations"]))
        differ += len(got) - same
        print(f"{key}: {same}/{len(got)} generations give the recorded acceptance lengths")
    return 1 if differ else 0


if __name__ == "__main__":
    raise SystemExit(main())
