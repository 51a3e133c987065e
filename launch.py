"""Entry point: `python launch.py [group=option ...] [key=value ...]`, `-m` for sweeps; under torchrun every
rank runs it (`torchrun --nproc-per-node=N launch.py parallel=ddp ...`). The original pipeline's
`--wandb-project`, `--wandb-run-name` and `--no-wandb` are aliases of Hydra keys (dflash/cli_flags.py). See
README.md."""

import atexit
import json
import os
import sys
import time
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from dflash.cli_flags import FlagError, translate_wandb_flags
from dflash.config import ConfigError, register_configs
from dflash.preflight import LaunchRefused, check_launch
from dflash.rundir import CONFIG_FILE

register_configs()


def _record_for_torchrun(message: str) -> None:
    """torchrun ends with a summary of the first rank that failed: give it this rank's one-line message (its
    error file), so the cause is the last thing printed, not a line among hundreds."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if path:
        info = {"py_callstack": message, "timestamp": str(int(time.time()))}
        Path(path).write_text(json.dumps({"message": {"message": message, "extraInfo": info}}))


def _refuse(message: str):
    """A configuration or environment error: one `error:` line naming the fix, exit status 1."""
    _record_for_torchrun(f"error: {message}")
    sys.exit(f"error: {message}")


def _route_resume(argv: list[str]) -> list[str]:
    """`resume=RUN_DIR` continues that run in its own directory: point Hydra's run dir there and keep this
    invocation's Hydra files apart from the original ones."""
    for i, arg in enumerate(argv[1:], start=1):
        if arg.startswith(("resume=", "+resume=")):
            run_dir = arg.split("=", 1)[1]
            if not run_dir:
                return argv
            run_dir = str(Path(run_dir).expanduser())  # Hydra would make a literal "~" directory
            if not (Path(run_dir) / CONFIG_FILE).is_file():
                # before Hydra runs: it would create the mistyped directory
                _refuse(f"resume={run_dir}: not a run directory (no config_resolved.yaml there)")
            argv = [*argv[:i], f"resume={run_dir}", *argv[i + 1 :]]
            if not any(a.startswith("hydra.run.dir=") for a in argv):
                argv = argv + [f"hydra.run.dir={run_dir}", "hydra.output_subdir=.hydra/resume"]
            return argv
    return argv


def _translate_flags(argv: list[str]) -> list[str]:
    """The original pipeline's W&B flags (--wandb-project, --wandb-run-name, --no-wandb) as Hydra overrides; a
    contradiction is refused before Hydra makes a run directory (and on every torchrun rank before it joins)."""
    try:
        return translate_wandb_flags(argv)
    except FlagError as e:
        _refuse(str(e))


def _preflight(argv: list[str]) -> list[str]:
    """Bad values, missing data, an unreachable target, no cluster: refused before Hydra makes a run directory
    (dflash/preflight.py); HYDRA_FULL_ERROR=1 shows the traceback."""
    try:
        check_launch(argv, Path(__file__).parent / "conf")
    except LaunchRefused as e:
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        _refuse(str(e))
    return argv


@hydra.main(config_path="conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> float | None:
    from dflash import interrupts
    from dflash.disk import disk_error
    from dflash.lifecycle import RunInterrupted
    from dflash.lifecycle import main as run_main

    try:
        return run_main(cfg)
    except RunInterrupted as e:  # a clean stop: one line, no traceback; the exit code says which signal
        print(f"interrupted: {e} (status.json says what was not done; resume=RUN_DIR continues)", file=sys.stderr)
        raise SystemExit(128 + (interrupts.received or 15)) from None
    except Exception as e:
        full = os.environ.get("HYDRA_FULL_ERROR") == "1"
        disk = disk_error(e)  # a full disk (or quota, read-only, I/O error): one line; HYDRA_FULL_ERROR=1 for more
        # a bad value, a refused resume: the message names the fix (a sweep's job raises: its sweeper records it)
        if isinstance(e, ConfigError) and not full and HydraConfig.get().mode == RunMode.RUN:
            _refuse(str(e))
        if disk is None or full:
            _record_for_torchrun(f"{type(e).__name__}: {e}")
            raise
        _refuse(f"{disk} (status.json records it; free space, then resume=RUN_DIR continues)")


if __name__ == "__main__":
    from dflash.distributed import agree_on_launch, shutdown

    atexit.register(shutdown)  # torchrun: leave the process group once, after every job of a multirun
    argv = _preflight(_route_resume(_translate_flags(sys.argv)))
    sys.argv = agree_on_launch(argv, Path(__file__).parent / "conf")
    main()
