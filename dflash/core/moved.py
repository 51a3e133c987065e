"""Old module paths of moved modules, still importable: `import dflash.rundir` (a user's script, a Hydra
`_target_: dflash.secrets.CommandLineSecrets` in a saved config, a pickle naming `dflash.lifecycle.RunFailed`) gets
the module at its new place, the same object, so classes and isinstance checks stay one. Installed by
dflash/__init__.py; docs/architecture.md's layout names the new places."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys

_RUNNER = "lifecycle run job finish sources resume disaggregated feature_build job_info preflight"
_CORE = (
    "config validation override_effects cli_flags distributed rundir secrets terminal jsonio machine disk "
    "determinism interrupts hashing repetition"
)
MOVED = {
    **{f"dflash.{m}": f"dflash.runner.{m}" for m in _RUNNER.split()},
    **{f"dflash.{m}": f"dflash.core.{m}" for m in _CORE.split()},
    "dflash.model.generate": "dflash.data.generate",
}


class _Alias(importlib.abc.Loader):
    def __init__(self, new: str):
        self.new = new

    def create_module(self, spec):
        module = importlib.import_module(self.new)
        self.spec = module.__spec__
        return module

    def exec_module(self, module):
        module.__spec__ = self.spec  # the import system gave the module the alias's spec: put its own back


class MovedModules(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        new = MOVED.get(fullname)
        if new is None:
            return None
        return importlib.machinery.ModuleSpec(fullname, _Alias(new))


def install() -> None:
    if not any(isinstance(f, MovedModules) for f in sys.meta_path):
        sys.meta_path.append(MovedModules())
