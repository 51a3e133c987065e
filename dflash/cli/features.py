"""`python -m dflash.features build [--dry-run] [OVERRIDES ...]` (or `torchrun --nproc-per-node=N -m
dflash.features build ...`: the shards shared among the ranks): the feature store of the run these Hydra
overrides describe (the same keys as launch.py: model, data, train.seq_len, train.batch_size, train.max_steps,
train.seed, features.dtype, features.path). `--dry-run` prints the bytes it will take and whether they fit."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from omegaconf import OmegaConf

from dflash.core import determinism
from dflash.core.config import ConfigError, register_configs
from dflash.core.disk import free_bytes, mib
from dflash.core.distributed import World, init_world, launched_distributed, shutdown
from dflash.core.terminal import install_logging
from dflash.core.validation import validate
from dflash.runner.feature_build import build_store, planned_bytes
from dflash.runner.sources import target_files
from dflash.train.feature_store import store_bytes_per_token

CONF = Path(__file__).resolve().parents[2] / "conf"


def compose(overrides: list[str]):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    register_configs()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return hydra_compose(config_name="config", overrides=overrides)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dflash.features", description=__doc__)
    ap.add_argument("command", choices=["build"])
    ap.add_argument("--dry-run", action="store_true", help="print the store's size for this config and stop")
    ap.add_argument("overrides", nargs="*", help="Hydra overrides, as for launch.py")
    args = ap.parse_intermixed_args(argv)
    cfg = compose(args.overrides)
    validate(cfg)
    # progress as log lines where stderr is no terminal (make real's phase, a SLURM log): a long build is not silent
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    install_logging()
    if args.dry_run:
        files = target_files(cfg, World())
        batches, needed = planned_bytes(cfg, files)
        where = Path(cfg.features.path or Path(cfg.paths.cache_dir) / "features").expanduser()
        free = free_bytes(where)
        per_token = store_bytes_per_token(files.config.hidden_size, len(files.layer_ids), cfg.features.dtype)
        print(
            f"feature store: {batches} global batches x {cfg.train.batch_size} x {cfg.train.seq_len} tokens, "
            f"{len(files.layer_ids)} layers + the last hidden state of width {files.config.hidden_size} in "
            f"{cfg.features.dtype} ({per_token} bytes/token): {needed} bytes, {mib(needed)} "
            f"({needed / 2**40:.3f} TiB); {mib(free)} free at {where}"
        )
        if needed > free:
            print("error: the store would not fit", file=sys.stderr)
            return 1
        return 0
    determinism.apply(cfg.train.deterministic)  # the run's algorithms, so the store holds the run's features
    try:
        print(build_store(cfg, build_world(cfg)))
    finally:
        shutdown()  # leave the process group (torchrun)
    return 0


def build_world(cfg) -> World:
    """Under torchrun, the build's ranks: the process group joined with `parallel.backend` (auto: NCCL on CUDA,
    gloo on CPU) and `parallel.init_timeout_s`, which bounds every wait of the build; else one process."""
    if not (launched_distributed() and int(os.environ["WORLD_SIZE"]) > 1):
        return World()
    if cfg.parallel.get("target_ranks"):
        raise ConfigError("python -m dflash.features build: parallel.target_ranks does not apply (every rank builds)")
    return init_world(OmegaConf.merge(cfg.parallel, {"name": "ddp"}), cfg.model.device)
