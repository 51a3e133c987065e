"""Secrets never reach a run file, a log line or W&B: values of secret-looking keys are redacted, so are the
credentials of a URL in any string (`postgresql://alice:pw@host/db` -> `postgresql://<redacted>@host/db`), and the
values of secret environment variables (WANDB_API_KEY, HF_TOKEN, ...) are scrubbed from text.

A secret given on the command line (`+logging.wandb.settings.api_key=...`) also reaches the files Hydra writes
and `sys.argv`, which W&B records as the run's command: `CommandLineSecrets`, a Hydra callback (conf/config.yaml),
warns about it once and redacts both at each job's start.
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from dflash.core.jsonio import json_safe, write_text_atomic

log = logging.getLogger(__name__)

# keys whose values are secrets wherever they appear (config, argv, overrides, environment variables)
# (not "token" or "key" after any word: max_new_tokens, mask_token_id and model.mask_token are config, not secrets;
# a whole key named token, key or auth is: `logging.wandb.key`)
# (a key may carry Hydra's +, ++ or ~ prefix: `+hf_token=...`)
_SECRET_KEY = re.compile(
    r"(api[_-]?key|secret|password|passwd|passphrase|credential|private[_-]?key|"
    r"(^[+~]*|[_.-])(hf|hf_hub|hub|huggingface|hugging_face_hub|auth|access|bearer|api|wandb|github|gh|gitlab|refresh|"
    r"session|openai|anthropic|slack|db|database)[_-]?(token|key|auth)$|"
    r"(^[+~]*|[_.-])(authorization|auth)$|(^[+~]*|\.)(token|key)$)",
    re.IGNORECASE,
)
# a URL's user and password (`scheme://user:pw@host`, `https://TOKEN@host`): up to the authority's last @
_URL_CREDENTIALS = re.compile(r"\b([a-z][a-z0-9+.-]*://)([^\s/?#@]+(?:@[^\s/?#@]+)*)@", re.IGNORECASE)
REDACTED = "<redacted>"


def redact_url_credentials(text: str) -> str:
    """`text` with every URL's credentials replaced: `postgresql://<redacted>@host/db`."""
    return _URL_CREDENTIALS.sub(rf"\1{REDACTED}@", text)


def url_credentials(text: str) -> list[str]:
    """The credentials (user:password) of the URLs in `text`."""
    return [m.group(2) for m in _URL_CREDENTIALS.finditer(text)]


def redact(obj: Any) -> Any:
    """Replace the value of any key that looks like a secret, secret-looking `key=value` strings and the
    credentials of a URL in any string."""
    if isinstance(obj, dict):
        return {
            k: (REDACTED if _SECRET_KEY.search(str(k)) and v not in (None, "") else redact(v)) for k, v in obj.items()
        }
    if isinstance(obj, list):
        return [redact(v) for v in obj]
    if isinstance(obj, str) and "=" in obj:
        key, _, _ = obj.partition("=")
        if _SECRET_KEY.search(key):
            return f"{key}={REDACTED}"
    if isinstance(obj, str):
        return redact_url_credentials(obj)
    return obj


_MIN_LEN = 8  # a shorter value is not searched for in free text: it would match unrelated text


def _secret_env_values() -> set[str]:
    return {v for k, v in os.environ.items() if _SECRET_KEY.search(k) and len(v) >= _MIN_LEN}


def scrub_text(text: str) -> str:
    """Remove the values of secret environment variables (WANDB_API_KEY, HF_TOKEN, ...) and URLs' credentials
    from text."""
    for value in _secret_env_values():
        text = text.replace(value, REDACTED)
    return redact_url_credentials(text)


def scrub(obj: Any) -> Any:
    """`redact(obj)`, and no string in it holds a URL's credentials or a secret environment variable's value:
    what a run's recorded config gets (config_resolved.yaml, W&B's config)."""
    return _scrub(obj, scrub_text)


def scrub_json(info: dict) -> dict:
    """info without the values of secret environment variables anywhere in it."""
    return json.loads(scrub_text(json.dumps(json_safe(info))))


# ----------------------------------------------------------------------------- secrets on the command line


def secret_arguments(args: Iterable[str]) -> dict[str, str]:
    """{argument: secret} of each `key=value` argument whose key looks like a secret and whose value is given
    literally (`key='${oc.env:NAME}'` is the way to pass one: not a secret itself): the value; and of each whose
    value holds a URL with credentials (`hydra.sweeper.storage=postgresql://alice:pw@host/db`): those."""
    found = {}
    for arg in args:
        key, sep, value = str(arg).partition("=")
        if sep and value and _SECRET_KEY.search(key) and not re.fullmatch(r"\$\{[^}]*\}", _unquote(value)):
            found[str(arg)] = value
        elif sep and (credentials := url_credentials(value)):
            found[str(arg)] = credentials[0]
    return found


def _unquote(value: str) -> str:
    return value[1:-1] if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"" else value


def scrub_arguments(obj: Any, args: Iterable[str]) -> Any:
    """`redact(obj)`, and no string in it holds a secret argument of `args` (as in Hydra's
    `hydra.job.override_dirname`: `a=1,+x.api_key=...`), its value (of 8 characters or more) or the value of a
    secret environment variable."""
    return _scrub(obj, _cleaner(args))


def _cleaner(args: Iterable[str]) -> Callable[[str], str]:
    """text -> text without the secret arguments of `args`, their values or secret environment values."""
    secrets = secret_arguments(args)

    def clean(text: str) -> str:
        for arg, value in secrets.items():
            text = text.replace(arg, redact(arg))
            for v in {value, _unquote(value)}:
                if len(v) >= _MIN_LEN:
                    text = text.replace(v, REDACTED)
        return scrub_text(text)

    return clean


def _scrub(obj: Any, clean: Callable[[str], str]) -> Any:
    """`redact`, but a string that `clean` changes keeps the rest of its text (redact would cut it after the
    first secret-looking key, e.g. the other overrides in override_dirname)."""
    if isinstance(obj, dict):
        return {
            k: (REDACTED if _SECRET_KEY.search(str(k)) and v not in (None, "") else _scrub(v, clean))
            for k, v in obj.items()
        }
    if isinstance(obj, list):
        return [_scrub(v, clean) for v in obj]
    if isinstance(obj, str):
        text = clean(obj)
        return text if text != obj else redact(obj)
    return obj


def _overrides(config: DictConfig) -> list[str]:
    """The command line's overrides as Hydra recorded them (the job's own and the hydra.* ones), as typed:
    `key=${oc.env:NAME}` is not resolved."""
    found: list[str] = []
    for key in ("task", "hydra"):
        node = OmegaConf.select(config, f"hydra.overrides.{key}", default=None)
        if node is not None:
            found += [str(o) for o in OmegaConf.to_container(node, resolve=False)]
    return found


def scrub_yaml_file(path: Path, args: Iterable[str]) -> bool:
    """Rewrite a YAML file of Hydra's (unresolved: interpolations stay) without the secrets of `args` or of
    the overrides it records itself (a sweep's `multirun.yaml`). True when it changed; absent files are left."""
    try:
        loaded = OmegaConf.load(path)
    except FileNotFoundError:
        return False
    args = [*args, *(_overrides(loaded) if isinstance(loaded, DictConfig) else [])]
    if not secret_arguments(args):  # nothing to do: the file stays as Hydra wrote it
        return False
    data = OmegaConf.to_container(loaded, resolve=False)
    clean = scrub_arguments(data, args)
    if clean == data:
        return False
    write_text_atomic(path, OmegaConf.to_yaml(OmegaConf.create(clean)))
    return True


# Hydra's launchers log each job's overrides (`#0 : a=1 +x.api_key=...`) before starting it
_LAUNCHER_LOGGERS = (
    "hydra._internal.core_plugins.basic_launcher",
    "hydra_plugins.hydra_submitit_launcher.submitit_launcher",
    "hydra_plugins.hydra_joblib_launcher._core",
)


class _RedactingFilter(logging.Filter):
    def __init__(self, args: Iterable[str]) -> None:
        super().__init__()
        self.clean = _cleaner(args)

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        clean = self.clean(message)
        if clean != message:
            record.msg, record.args = clean, ()
        return True


def _hide_in_launcher_logs(args: list[str]) -> None:
    """The launchers' log lines without the secrets of `args` (a filter on their loggers: Hydra's per-job
    logging setup replaces handlers, not loggers' filters)."""
    for name in _LAUNCHER_LOGGERS:
        logger = logging.getLogger(name)
        for old in [f for f in logger.filters if isinstance(f, _RedactingFilter)]:
            logger.removeFilter(old)
        if secret_arguments(args):
            logger.addFilter(_RedactingFilter(args))


class CommandLineSecrets(Callback):
    """Hydra callback: a secret given on the command line warns once (on rank 0) and is redacted, at each
    job's start, from what Hydra wrote for the job (`.hydra/` or `.hydra/resume/`: config.yaml, hydra.yaml,
    overrides.yaml; a multirun's `multirun.yaml`) and from `sys.argv`, so W&B records the redacted command;
    in a multirun, from the launcher's log line of each job too.

    Hydra writes those files just before `on_job_start`, so they hold the secret for that moment only. Under
    torchrun every rank runs this; ranks > 0 have no `.hydra` (hydra.output_subdir=null). Under submitit the
    job runs in the submitted process, where this hook runs too.
    """

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        self._warn(config)

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        self._warn(config)
        _hide_in_launcher_logs(_overrides(config))

    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None:
        sys.argv[:] = redact(list(sys.argv))
        args = _overrides(config)
        out_dir = OmegaConf.select(config, "hydra.runtime.output_dir", default=None)
        subdir = OmegaConf.select(config, "hydra.output_subdir", default=None)
        files = []
        if out_dir is not None and subdir is not None:
            files += [Path(out_dir) / subdir / name for name in ("config.yaml", "hydra.yaml", "overrides.yaml")]
        if str(OmegaConf.select(config, "hydra.mode", default="")).endswith("MULTIRUN"):
            files.append(Path(str(OmegaConf.select(config, "hydra.sweep.dir"))) / "multirun.yaml")
        for path in files:
            try:
                scrub_yaml_file(path, args)
            except Exception as e:  # noqa: BLE001 - Hydra would turn it into a warning that may quote the file
                log.warning(
                    "could not redact %s (%s); it may hold a secret from the command line", path, type(e).__name__
                )

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        scrub_yaml_file(Path(str(OmegaConf.select(config, "hydra.sweep.dir"))) / "multirun.yaml", _overrides(config))

    @staticmethod
    def _warn(config: DictConfig) -> None:
        keys = [arg.partition("=")[0] for arg in secret_arguments(_overrides(config))]
        if keys and os.environ.get("RANK", "0") == "0":  # torchrun: every rank runs this; one says it
            log.warning(
                "%s on the command line looks like a secret: the run's files and W&B get it redacted, but your "
                "shell history and the process list keep it. Pass it by environment variable instead: "
                "`export NAME=...` and `%s='${oc.env:NAME}'` (W&B reads WANDB_API_KEY by itself, Hugging Face "
                "HF_TOKEN)",
                ", ".join(k.lstrip("+~") for k in keys),
                keys[0],
            )
