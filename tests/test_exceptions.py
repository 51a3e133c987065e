"""Every exception the package defines survives pickling: submitit and Hydra's JobReturn carry a job's exception
back to the launching process, which must report the job's own error, not a TypeError of its own."""

from __future__ import annotations

import importlib
import inspect
import pickle
import pkgutil

import pytest

import dflash

# classes whose constructor takes more than a message: how to make one
EXAMPLES = {
    "StageError": lambda cls: cls("drafter", ValueError("injected"), "Traceback ...\nValueError: injected\n"),
    "PhaseFailed": lambda cls: cls(["python", "-m", "dflash.features", "build"], 3),
}


def _package_exceptions() -> list[type[BaseException]]:
    found = {}
    for info in pkgutil.walk_packages(dflash.__path__, "dflash."):
        module = importlib.import_module(info.name)
        for _, obj in inspect.getmembers(module, inspect.isclass):
            if issubclass(obj, BaseException) and obj.__module__.startswith("dflash"):
                found[f"{obj.__module__}.{obj.__qualname__}"] = obj
    return [found[k] for k in sorted(found)]


EXCEPTIONS = _package_exceptions()


def test_the_package_defines_the_exceptions_this_test_knows():
    names = {cls.__name__ for cls in EXCEPTIONS}
    assert {"StageError", "RankFailed", "TransportError", "TrainingDiverged", "CheckpointCorrupt"} <= names


@pytest.mark.parametrize("cls", EXCEPTIONS, ids=lambda c: c.__name__)
def test_exception_survives_pickling(cls):
    error = EXAMPLES[cls.__name__](cls) if cls.__name__ in EXAMPLES else cls("rank 1: something failed")
    back = pickle.loads(pickle.dumps(error))
    assert type(back) is cls and str(back) == str(error)
    assert vars(back) == vars(error)  # attributes such as StageError.stage and .traceback_text travel too
