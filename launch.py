"""Entry point: `python launch.py [group=option ...] [key=value ...]`, `-m` for sweeps; under torchrun every
rank runs it (`torchrun --nproc-per-node=N launch.py parallel=ddp ...`). The original pipeline's
`--wandb-project`, `--wandb-run-name` and `--no-wandb` are aliases of Hydra keys (dflash/core/cli_flags.py). See
README.md; the job itself is dflash/runner/ (docs/architecture.md follows it from here to the training step)."""

import atexit
import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig

from dflash.runner.entry import prepare_argv, register_configs, run_job, shutdown

CONF_DIR = Path(__file__).parent / "conf"
register_configs()


@hydra.main(config_path="conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> float | None:
    return run_job(cfg)


if __name__ == "__main__":
    atexit.register(shutdown)  # torchrun: leave the process group once, after every job of a multirun
    sys.argv = prepare_argv(sys.argv, CONF_DIR)
    main()
