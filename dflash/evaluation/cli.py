"""`python -m dflash.evaluate RUN_DIR_OR_DRAFTER_DIR`: evaluate an exported drafter against its target.

For a run directory the settings and the prompts come from the run itself (its eval.json records the prompts'
token ids), so the command reproduces the run's own final evaluation; flags override them.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from dflash.core.config import DTYPE_NAMES, DataConfig, EvalConfig
from dflash.core.rundir import CONFIG_FILE, RunDir, write_eval_json
from dflash.data.prompts import read_prompts_file
from dflash.evaluation.decoding import module_dtype
from dflash.evaluation.evaluator import choose_prompts, evaluate, untrained_like
from dflash.model.drafter import DFlashDraftModel

log = logging.getLogger(__name__)


@dataclass
class _Inputs:
    drafter_dir: Path
    target: str
    run_cfg: Any = None  # the run's resolved config (DictConfig); None for a bare drafter directory
    run_eval: dict | None = None  # the run's eval.json: its prompts and the settings they were evaluated with
    replay: bool = False  # evaluating the recorded prompts: their recorded settings are the defaults


def _resolve_run_target(run: RunDir, target: str) -> str:
    """A run's model.target may be relative to the directory it was launched from (recorded in run.json)."""
    looks_local = target.startswith((".", "/", "~")) or target.count("/") > 1
    if Path(target).expanduser().exists() or not looks_local:
        return target  # exists, or a hub name
    cwd = run.read_run_info().get("cwd")
    if cwd and (Path(cwd) / target).exists():
        return str(Path(cwd) / target)
    return target


def _resolve_inputs(path: str, target_arg: str | None) -> _Inputs:
    p = Path(path).expanduser()
    run = RunDir(p)
    if run.config_file.is_file():
        cfg = OmegaConf.load(run.config_file)
        if not (run.drafter / "config.json").is_file():
            raise FileNotFoundError(
                f"{p} is a run directory without an exported drafter ({run.drafter}/config.json); did the run finish?"
            )
        target = target_arg or _resolve_run_target(run, str(cfg.model.target))
        return _Inputs(run.drafter, target, cfg, run.read_eval())
    if (p / "config.json").is_file():
        config = json.loads((p / "config.json").read_text())
        # z-lab's layout: our dflash_target; speculators' (drafter=dspark): the verifier it names
        verifier = (config.get("speculators_config") or {}).get("verifier", {}).get("name_or_path")
        target = target_arg or config.get("dflash_target") or verifier
        if not target:
            raise ValueError(f"{p}/config.json has no dflash_target field: pass --target PATH_OR_HUB_NAME")
        return _Inputs(p, str(target))
    raise FileNotFoundError(f"{path}: neither a run directory ({CONFIG_FILE}) nor a drafter directory (config.json)")


def _setting(cli_value, run_cfg, key: str, default, recorded: dict | None = None, recorded_key: str | None = None):
    """CLI flag, else the setting eval.json recorded (replaying its prompts), else the run's eval.<key>, else
    the default."""
    if cli_value is not None:
        return cli_value
    if recorded and recorded.get(recorded_key or key) is not None:
        return recorded[recorded_key or key]
    if run_cfg is not None and run_cfg.get("eval") is not None and run_cfg.eval.get(key) is not None:
        return run_cfg.eval[key]
    return default


def _seed(args, inputs: _Inputs) -> int:
    """--seed, else the seed the run's eval used (eval.json), else its eval.seed (train.seed in runs older than
    eval.seed), else 0: it chooses the prompts and seeds sampling."""
    if args.seed is not None:
        return args.seed
    if inputs.replay and (inputs.run_eval or {}).get("seed") is not None:
        return int(inputs.run_eval["seed"])
    if inputs.run_cfg is None:
        return 0
    eval_seed = OmegaConf.select(inputs.run_cfg, "eval.seed", default=None)
    return int(eval_seed if eval_seed is not None else OmegaConf.select(inputs.run_cfg, "train.seed", default=0))


def _init_seed(args, inputs: _Inputs) -> int:
    """The seed the run initialised its drafter with (train.seed): the untrained baseline's; a bare drafter's
    is unknown, so --seed or 0."""
    seed = OmegaConf.select(inputs.run_cfg, "train.seed", default=None) if inputs.run_cfg is not None else None
    return int(seed) if seed is not None else (args.seed or 0)


def _load_prompts(args, inputs: _Inputs, tokenizer) -> list[list[int]]:
    """A run's own eval prompts (token ids from its eval.json) unless flags choose others; else as a run would
    choose them (`choose_prompts`) from the run's data, or held-out stdlib text for a bare drafter."""
    chooses = (args.prompts_file, args.num_prompts, args.prompt_len)
    recorded = (inputs.run_eval or {}).get("prompts")
    if recorded and all(v is None for v in chooses):
        log.info("prompts: the %d recorded in the run's eval.json, with its settings", len(recorded))
        inputs.replay = True
        return [list(map(int, p)) for p in recorded]
    if args.prompts_file and args.num_prompts is None:  # a prompts file means its prompts, all of them
        prompts = read_prompts_file(args.prompts_file, tokenizer)
        log.info("prompts: all %d of %s (--num-prompts N takes the first N)", len(prompts), args.prompts_file)
        return prompts
    run_cfg = inputs.run_cfg
    eval_cfg = OmegaConf.structured(
        EvalConfig(
            num_prompts=int(_setting(args.num_prompts, run_cfg, "num_prompts", 8)),
            prompt_len=int(_setting(args.prompt_len, run_cfg, "prompt_len", 64)),
            prompts_file=_setting(args.prompts_file, run_cfg, "prompts_file", None),
        )
    )
    # held-out stdlib text for a bare drafter, as the embedded default trains on
    data_cfg = run_cfg.data if run_cfg is not None else DataConfig(name="stdlib")
    heldout = {}
    if run_cfg is not None:  # data=jsonl: the run's rendered records, from the cache it made
        heldout = {"target": run_cfg.model.target, "cache_dir": OmegaConf.select(run_cfg, "paths.cache_dir")}
    return choose_prompts(eval_cfg, data_cfg, tokenizer, _seed(args, inputs), **heldout)


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m dflash.evaluate",
        description="Speculative decoding of a DFlash drafter against its target: tau, "
        "acceptance histogram, prompt-lookup and untrained baselines, speedup.",
    )
    ap.add_argument("path", help="a run directory (with drafter/) or an exported drafter directory")
    ap.add_argument(
        "--target",
        help="target model path or hub name (default: the run's model.target or the drafter config's dflash_target)",
    )
    ap.add_argument("--prompts-file", help='.jsonl with {"prompt": ...} per line, or plain text one per line')
    ap.add_argument("--num-prompts", type=int, help="default: all of --prompts-file's, else the run's eval.num_prompts")
    ap.add_argument("--prompt-len", type=int, help="tokens per held-out prompt (when no prompts file)")
    ap.add_argument("--max-new-tokens", type=int)
    ap.add_argument("--temperature", type=float)
    ap.add_argument("--block-size", type=int, help="default: the drafter's block_size")
    ap.add_argument("--ngram", type=int, help="prompt-lookup n-gram size (default: the run's, else 3)")
    ap.add_argument("--no-baselines", action="store_true", help="skip prompt lookup and the untrained drafter")
    ap.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    ap.add_argument("--dtype", default="auto", choices=["auto", *DTYPE_NAMES], help="auto = the drafter's saved dtype")
    ap.add_argument("--seed", type=int, help="prompts and sampling; default: the seed the run's eval used, else 0")
    ap.add_argument("--out", default="eval.json", help="where to write the JSON result")
    return ap.parse_args(argv)


def _print_table(metrics: dict[str, Any], title: str) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    table.add_column("metric")
    table.add_column("value", justify="right")
    for k, v in metrics.items():
        if k == "details":
            continue
        table.add_row(
            k,
            "n/a"
            if v is None or (isinstance(v, float) and not math.isfinite(v))
            else f"{v:.4g}"
            if isinstance(v, float)
            else str(v),
        )
    Console().print(table)


def _run_cli(args: argparse.Namespace) -> dict[str, Any]:
    from transformers import AutoTokenizer

    from dflash.core.distributed import resolve_device
    from dflash.model.export import check_drafter_against
    from dflash.model.families import check_block_size
    from dflash.model.families.speculators_layout import is_speculators_dir, load_speculators
    from dflash.model.target import DTYPES, check_target_exists, load_causal_lm

    inputs = _resolve_inputs(args.path, args.target)
    check_target_exists(inputs.target)
    device = resolve_device(args.device)
    if is_speculators_dir(inputs.drafter_dir):  # another family's export (DSpark: speculators' layout)
        drafter = load_speculators(inputs.drafter_dir)
        drafter = drafter if args.dtype == "auto" else drafter.to(DTYPES[args.dtype])
    else:
        drafter = DFlashDraftModel.from_pretrained(
            str(inputs.drafter_dir), **({} if args.dtype == "auto" else {"dtype": DTYPES[args.dtype]})
        )
    if args.block_size:  # before the target loads: a block size the family cannot run is refused at once
        check_block_size(drafter, args.block_size)
    drafter = drafter.to(device).eval()
    dtype = module_dtype(drafter)
    target = load_causal_lm(inputs.target, dtype).to(device).eval()
    try:
        check_drafter_against(drafter.config, target_config=target.config)
    except ValueError as e:
        raise ValueError(f"target {inputs.target} does not fit drafter {inputs.drafter_dir}: {e}") from None
    tokenizer = AutoTokenizer.from_pretrained(inputs.target)
    prompts = _load_prompts(args, inputs, tokenizer)
    recorded = (inputs.run_eval or {}).get("details") if inputs.replay else None
    temperature = float(_setting(args.temperature, inputs.run_cfg, "temperature", 0.0, recorded))
    max_new_tokens = int(_setting(args.max_new_tokens, inputs.run_cfg, "max_new_tokens", 64, recorded))
    ngram = int(_setting(args.ngram, inputs.run_cfg, "prompt_lookup_ngram", 3, recorded, "ngram"))
    block_size = args.block_size or (recorded or {}).get("block_size")
    seed = _seed(args, inputs)
    baselines = not args.no_baselines and bool(_setting(None, inputs.run_cfg, "baselines", True))
    result = evaluate(
        target,
        drafter,
        prompts,
        max_new_tokens=max_new_tokens,
        block_size=block_size,
        temperature=temperature,
        baselines=baselines,
        ngram=ngram,
        untrained_drafter=untrained_like(drafter, _init_seed(args, inputs)) if baselines else None,
        seed=seed,
        eos_id=tokenizer.eos_token_id,
        tokenizer=tokenizer,
        sim_tau=True,
    )
    write_eval_json(
        args.out,
        result,
        drafter=str(inputs.drafter_dir),
        target=inputs.target,
        device=str(device),
        dtype=str(dtype).removeprefix("torch."),
        seed=seed,
        prompts=prompts,
    )
    _print_table(result, f"DFlash eval: {inputs.drafter_dir}")
    return result


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `python -m dflash.evaluate`; returns the exit status (2 for a user error)."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args = _parse_args(argv)
    try:
        _run_cli(args)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.out}")
    return 0
