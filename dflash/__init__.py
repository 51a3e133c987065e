"""dflash-train: a Hydra-configured framework for training DFlash block-diffusion drafters.

Packages: core (the ground floor), data, model, train, tracking, evaluation, runner (the program), tools (the CLIs);
the `python -m dflash.<name>` doors beside them. docs/architecture.md is the map."""

from dflash.core.moved import install as _install_moved_modules

__all__ = ["__version__"]
__version__ = "0.1.0"

_install_moved_modules()  # old module paths (dflash.rundir, dflash.lifecycle, ...) still import
