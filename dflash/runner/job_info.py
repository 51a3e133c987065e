"""What Hydra knows about a job (its directory, name, sweep, overrides and group choices), read once."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

from dflash.core.secrets import redact
from dflash.tracking import default_job_name


@dataclass
class JobInfo:
    """What Hydra knows about this job: where it runs and how it was asked for."""

    run_dir: Path
    job_name: str = ""
    sweep_dir: str | None = None
    overrides: list[str] = field(default_factory=list)
    choices: dict = field(default_factory=dict)


def hydra_job_info() -> JobInfo:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    hc = HydraConfig.get()
    run_dir = Path(hc.runtime.output_dir)
    overrides = list(hc.overrides.task)
    is_multirun = hc.mode == RunMode.MULTIRUN
    own = [o for o in overrides if not o.startswith(("hydra.", "resume="))]
    if is_multirun:  # name a sweep's job by what varies: its values of the swept keys
        swept = _swept_keys()
        own = [o for o in own if o.split("=", 1)[0].lstrip("+~") in swept] or own
    job_name = default_job_name(redact(own), run_dir)  # the W&B run name: no secret from the command line
    choices = {k: v for k, v in hc.runtime.choices.items() if not k.startswith("hydra")}
    return JobInfo(run_dir, job_name, hc.sweep.dir if is_multirun else None, overrides, choices)


def _swept_keys() -> set[str]:
    """Keys the command line sweeps over (`key=a,b`, `range(...)`, `choice(...)`), read from sys.argv, plus
    those of `hydra.sweeper.params` in the config."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    keys: set[str] = set()
    for arg in sys.argv[1:]:
        if "=" not in arg or arg.startswith("-"):
            continue
        try:  # one at a time: a redacted secret (`key=<redacted>`, dflash.core.secrets) does not parse
            keys.update(o.key_or_group for o in parser.parse_overrides([arg]) if o.is_sweep_override())
        except Exception:  # noqa: BLE001 - naming is cosmetic; never fail a job over it
            pass
    params = HydraConfig.get().sweeper.get("params") or {}
    keys.update(str(k) for k in params)
    return keys
