"""Checks of a launch.py command line before Hydra makes a run directory: the composed config passes validate(),
`data.path` names data files, the target is a directory or a hub model that is cached or whose hub answers,
and `hydra/launcher=slurm_ddp` has a SLURM cluster to submit to. A failure is one `LaunchRefused` whose message
names the fix; launch.py prints it as one `error:` line. Hydra's printing flags (--cfg, --help, ...), a resume
(resume.py checks it before anything is written) and a multirun's swept values are left to the run."""

from __future__ import annotations

import os
import re
import shutil
import socket
import sys
from pathlib import Path
from urllib.parse import urlparse

from omegaconf.errors import InterpolationResolutionError, OmegaConfBaseException

from dflash.core.config import ConfigError

PRINT_ONLY = ("--cfg", "-c", "--help", "-h", "--hydra-help", "--info", "-i", "--shell-completion", "-sc")
MULTIRUN = ("-m", "--multirun")
HUB_TIMEOUT_S = 3.0  # a TCP connect to the hub: an unreachable hub otherwise costs ~30 s of retries, then OSError
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


class LaunchRefused(Exception):
    """A command line that cannot run here: a bad value, missing data, an unreachable target, no cluster."""


def check_launch(argv: list[str], config_dir: Path) -> None:
    """Raise LaunchRefused for what would fail in the run anyway, before Hydra writes a directory for it."""
    args = argv[1:]
    if any(a.split("=", 1)[0] in PRINT_ONLY for a in args):
        return
    _check_launcher(args)
    cfg = _compose(args, config_dir)
    if cfg is None or cfg.get("resume"):
        return
    try:
        _check_config(cfg, multirun=any(a in MULTIRUN for a in args))
    except InterpolationResolutionError as e:  # e.g. ${oc.env:DATA} with DATA unset
        raise LaunchRefused(f"{e.full_key}: {str(e).splitlines()[0]}") from None
    except OmegaConfBaseException:  # anything else Hydra's own run reports as it does
        return


def _check_config(cfg, multirun: bool) -> None:
    if not multirun:  # a sweep's jobs may differ in what validate() checks
        try:
            from dflash.core.validation import validate

            validate(cfg)
        except ConfigError as e:
            raise LaunchRefused(str(e)) from None
    if cfg.data.name == "jsonl" and cfg.data.path:
        from dflash.data.corpus import jsonl_files

        try:
            jsonl_files(str(cfg.data.path))
        except FileNotFoundError as e:
            raise LaunchRefused(f"{e} (data=jsonl reads .jsonl/.json files: a file, a directory or a glob)") from None
    if cfg.model.build.kind == "none":
        _check_target(str(cfg.model.target))


def _check_launcher(args: list[str]) -> None:
    if "hydra/launcher=slurm_ddp" in args and shutil.which("sbatch") is None:
        raise LaunchRefused(
            "hydra/launcher=slurm_ddp submits to SLURM, but there is no sbatch here: run it on the cluster's login "
            "node, or use hydra/launcher=local_ddp for the same code path on this machine"
        )


def _compose(args: list[str], config_dir: Path):
    """The config of the command line's non-swept overrides, or None where Hydra will refuse it (it reports that
    itself, in one message)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        parsed = OverridesParser.create().parse_overrides([a for a in args if not a.startswith("-")])
        fixed = [o.input_line for o in parsed if not o.is_sweep_override() and not o.is_hydra_override()]
        with initialize_config_dir(config_dir=str(Path(config_dir).resolve()), version_base="1.3"):
            return compose(config_name="config", overrides=fixed)
    except Exception:  # noqa: BLE001 - Hydra's own composition error follows, as the user's run would see it
        return None


def _check_target(target: str) -> None:
    """A local directory must exist; a hub id must be in the local cache or its hub must answer a TCP connect
    (an unreachable hub otherwise costs transformers' retries, ~30 s, then an OSError without a hint). A cached
    model with the hub unreachable loads offline (HF_HUB_OFFLINE=1 for this process and its children)."""
    from dflash.model.target import check_target_exists

    try:
        check_target_exists(target)
    except FileNotFoundError as e:
        raise LaunchRefused(f"{e} (model.target is a hub name or a local model directory)") from None
    if Path(target).expanduser().exists():
        _check_architecture(target)
        return
    if not HUB_ID.fullmatch(target):
        return
    from huggingface_hub import constants, try_to_load_from_cache

    cached = isinstance(try_to_load_from_cache(target, "config.json"), str)
    endpoint = constants.ENDPOINT
    if constants.HF_HUB_OFFLINE:
        if not cached:
            raise LaunchRefused(
                f"model.target={target}: not in the local hub cache ({constants.HF_HUB_CACHE}) and HF_HUB_OFFLINE=1: "
                f"download it first (hf download {target}), or set model.target to a local model directory"
            )
        return
    if any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return  # the hub is reached through a proxy: a direct connect says nothing
    problem = hub_unreachable(endpoint)
    if problem is None:
        return
    if cached:
        os.environ["HF_HUB_OFFLINE"] = "1"  # for child processes (torchrun's, submitit's) and this one's:
        constants.HF_HUB_OFFLINE = True  # huggingface_hub read the variable when it was imported, above
        print(f"note: the hub ({endpoint}) is unreachable ({problem}): {target} loads from its cache", file=sys.stderr)
        return
    raise LaunchRefused(
        f"model.target={target}: the hub ({endpoint}) is unreachable ({problem}) and the model is not in the local "
        f"cache: download it first (hf download {target}, where there is network), or set HF_HUB_OFFLINE=1 "
        "with model.target=/path/to/a/local/model"
    )


def _check_architecture(target: str) -> None:
    """A local target whose architecture cannot serve as one (no causal-LM class in transformers), in one line
    before any work (a folder without a config.json yet is a local build: checked when it loads)."""
    if not (Path(target).expanduser() / "config.json").is_file():
        return
    from dflash.model.architectures import causal_lm_class
    from dflash.model.target import load_target_config

    try:
        causal_lm_class(load_target_config(target, whole=True))
    except ValueError as e:
        raise LaunchRefused(str(e)) from None


def hub_unreachable(endpoint: str) -> str | None:
    """Why a TCP connection to the hub's host fails within HUB_TIMEOUT_S, or None when it opens."""
    url = urlparse(endpoint)
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        socket.create_connection((url.hostname, port), timeout=HUB_TIMEOUT_S).close()
    except OSError as e:
        return e.strerror or type(e).__name__
    return None
