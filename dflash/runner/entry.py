"""What launch.py runs, around Hydra: the command line made ready before Hydra parses it (W&B flags, resume=,
the preflight checks, torchrun's agreement on one run directory), and the job's exits after it (one `error:` line
for a bad value or a full disk, 128 + signal for a clean stop)."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from dflash.core.cli_flags import FlagError, translate_wandb_flags
from dflash.core.config import ConfigError, register_configs
from dflash.core.distributed import agree_on_launch, shutdown
from dflash.core.rundir import CONFIG_FILE
from dflash.runner.preflight import LaunchRefused, check_launch

__all__ = ["prepare_argv", "register_configs", "run_job", "shutdown"]


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


def _preflight(argv: list[str], conf_dir: Path) -> list[str]:
    """Bad values, missing data, an unreachable target, no cluster: refused before Hydra makes a run directory
    (dflash/runner/preflight.py); HYDRA_FULL_ERROR=1 shows the traceback."""
    try:
        check_launch(argv, conf_dir)
    except LaunchRefused as e:
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        _refuse(str(e))
    return argv


def prepare_argv(argv: list[str], conf_dir: Path) -> list[str]:
    """The command line Hydra will parse: flags translated, resume routed, checked; under torchrun, every rank
    joins the process group and takes rank 0's run directory."""
    argv = _preflight(_route_resume(_translate_flags(argv)), conf_dir)
    return agree_on_launch(argv, conf_dir)


def run_job(cfg: DictConfig) -> float | None:
    """One Hydra job (dflash/runner/lifecycle.py), its failures turned into what a user should see."""
    from dflash.core import interrupts
    from dflash.core.disk import disk_error
    from dflash.runner.lifecycle import RunInterrupted
    from dflash.runner.lifecycle import main as run_main

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
