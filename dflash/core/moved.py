"""Old module paths of moved modules, still importable: `import dflash.rundir` (a user's script, a Hydra
`_target_: dflash.secrets.CommandLineSecrets` in a saved config, a pickle naming `dflash.lifecycle.RunFailed`) gets
the module at its new place, the same object, so classes and isinstance checks stay one. Installed by
dflash/__init__.py; docs/architecture.md's layout names the new places."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys

_RUNNER = "lifecycle run job finish sources resume disaggregated feature_build job_info preflight"
_CORE = (
    "config validation override_effects cli_flags distributed rundir secrets terminal jsonio machine disk "
    "determinism interrupts hashing repetition"
)
_BENCHMARKS = "data dist families loss options peer peer_train pipeline soak step sweep transport"
# the fourth pass: dflash/tools/ split into rooms named by their job
_TOOLS = {
    "analysis": "compare_cli compare seed_groups rank_corr learning_curve sweep run_cost store_cost",
    "recipes": "make_real sharegpt_data sharegpt_mix regenerate regen_backends",
    "offline_gpu": "gpu_device_pack:pack gpu_device_run:node_run gpu_device:limits gpu_eval:evaluate "
    "gpu_real_dry:dry_run gpu_real:cli gpu_stage:stage",
    "cli": "benchmark_cli:benchmark export features plan",
}
MOVED = {
    **{f"dflash.{m}": f"dflash.runner.{m}" for m in _RUNNER.split()},
    **{f"dflash.{m}": f"dflash.core.{m}" for m in _CORE.split()},
    "dflash.model.generate": "dflash.data.generate",
    "dflash.tools": "dflash.cli",
    "dflash.tools.bench": "dflash.benchmarks",
    **{f"dflash.tools.bench.{m}": f"dflash.benchmarks.{m}" for m in _BENCHMARKS.split()},
    **{
        f"dflash.tools.{old}": f"dflash.{room}.{new or old}"
        for room, names in _TOOLS.items()
        for old, _, new in (n.partition(":") for n in names.split())
    },
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

    def get_code(self, fullname):
        """`python -m OLD.PATH` (runpy asks the loader for the code): the new module's code, run as __main__."""
        return importlib.util.find_spec(self.new).loader.get_code(self.new)


class MovedModules(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        new = MOVED.get(fullname)
        if new is None:
            return None
        return importlib.machinery.ModuleSpec(fullname, _Alias(new))


def install() -> None:
    if not any(isinstance(f, MovedModules) for f in sys.meta_path):
        sys.meta_path.insert(0, MovedModules())  # first: a moved name under an aliased package is not loaded twice
