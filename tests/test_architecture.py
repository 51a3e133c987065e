"""The layering of docs/architecture.md, checked on the source: imports go down, no cycles, small modules."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "dflash"
# the `python -m dflash.<name>` doors: a few lines each that hand over to the package that does the work
ENTRY_POINTS = {
    "dflash.compare",
    "dflash.evaluate",
    "dflash.export",
    "dflash.bench",
    "dflash.benchmark",
    "dflash.report",
    "dflash.regenerate",
    "dflash.features",
    "dflash.plan",
}
PACKAGES = {
    *("core", "data", "model", "train", "tracking", "evaluation", "runner"),
    *("cli", "analysis", "recipes", "benchmarks", "offline_gpu"),  # the fourth pass: tools/ split by job
}

# floor of each module prefix (lower number = lower floor); a module may import its own floor or below
LAYERS = {
    "dflash.core": 0,  # the ground floor: used by everything, imports nothing of ours above it
    "dflash.data": 1,  # token documents, batches, and the target's continuations as data (generate.py)
    "dflash.model": 2,  # what is trained and shipped; tiny.py and tiny_chat.py train on data's corpora
    "dflash.train": 3,
    "dflash.tracking": 4,
    "dflash.evaluation": 5,
    # the runner: the job and the process around it, in the order a job calls them
    "dflash.runner": 6,
    "dflash.runner.resume": 6,
    "dflash.runner.job_info": 6,
    "dflash.runner.sources": 7,
    "dflash.runner.draft_vocab": 7,
    "dflash.runner.feature_build": 7,
    "dflash.runner.disaggregated": 7,
    "dflash.runner.job": 8,
    "dflash.runner.finish": 8,
    "dflash.runner.run": 8,
    "dflash.runner.lifecycle": 9,
    "dflash.runner.preflight": 9,  # launch.py's checks before Hydra runs: composes, validates, looks at data and target
    "dflash.runner.entry": 10,  # what launch.py calls: the argv before Hydra, the job's exits after it
    # the rooms above the program: nothing below imports them
    "dflash.cli": 11,  # the thin CLIs (benchmark, export, features, plan)
    "dflash.analysis": 11,  # runs compared by their directories: compare, seeds, curves, sweeps' summary, cost
    "dflash.recipes": 12,  # make real and its data, regeneration (uses analysis' run cost)
    "dflash.benchmarks": 12,  # python -m dflash.bench (sweep uses cli.features)
    "dflash.offline_gpu": 13,  # the real target on a GPU node without network (uses recipes and benchmarks)
}


def _module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in PACKAGE.rglob("*.py")}


def _imports(path: Path) -> set[str]:
    """Every dflash module this file imports, at module level or inside functions."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("dflash"):
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)  # `from dflash.core import rundir`
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("dflash"))
    return found


def _layer(module: str) -> int | None:
    best = None
    for prefix, layer in LAYERS.items():
        if (module == prefix or module.startswith(prefix + ".")) and (best is None or len(prefix) > len(best[0])):
            best = (prefix, layer)
    return None if best is None else best[1]


def test_every_module_has_a_layer():
    unplaced = [m for m in _modules() if m not in ENTRY_POINTS and m != "dflash" and _layer(m) is None]
    assert not unplaced, f"modules outside the documented layers: {unplaced}"


def test_imports_go_down():
    modules = _modules()
    upward = []
    for name, path in modules.items():
        if name in ENTRY_POINTS or name == "dflash":
            continue
        for imported in _imports(path):
            if imported not in modules:
                continue  # a name imported from a module, already counted by its module
            if _layer(imported) is not None and _layer(imported) > _layer(name):
                upward.append(f"{name} -> {imported}")
    assert not upward, "imports that go up a layer:\n" + "\n".join(sorted(upward))


def test_no_import_cycle():
    modules = _modules()
    graph = {name: {i for i in _imports(path) if i in modules and i != name} for name, path in modules.items()}
    state: dict[str, int] = {}  # 1 = on the stack, 2 = done

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for nxt in graph[node]:
            if state.get(nxt) == 1:
                cycle = stack[stack.index(nxt) :] + [nxt]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = 2

    for name in graph:
        if name not in state:
            visit(name, [name])


def test_modules_stay_small():
    big = {m: len(p.read_text().splitlines()) for m, p in _modules().items()}
    big = {m: n for m, n in big.items() if n > 450}
    assert not big, f"modules over 450 lines (split them by job): {big}"


def test_code_cites_only_files_in_the_repository():
    cited = [
        str(p.relative_to(REPO))
        for p in [*PACKAGE.rglob("*.py"), *(REPO / "tests").rglob("*.py")]
        if "DESIGN.md" in p.read_text()
    ]
    assert cited == [str(Path(__file__).relative_to(REPO))], cited
    assert (REPO / "docs" / "architecture.md").is_file()


def test_cited_source_paths_exist():
    """Docstrings, comments and docs name `dflash/...py` files that are really there."""
    import re

    texts = [
        *PACKAGE.rglob("*.py"),
        *(REPO / "tests").rglob("*.py"),
        REPO / "README.md",
        *(REPO / "docs").glob("*.md"),
        *(REPO / "conf").rglob("*.yaml"),
    ]
    missing = {
        f"{p.relative_to(REPO)}: {m}"
        for p in texts
        for m in re.findall(r"\bdflash/[\w/]+\.py\b", p.read_text())
        if not (REPO / m).exists()
    }
    assert not missing, sorted(missing)


def test_train_reads_as_a_short_sequence():
    tree = ast.parse((PACKAGE / "runner" / "run.py").read_text())
    train = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "train")
    assert train.end_lineno - train.lineno + 1 <= 90


def test_top_level_holds_only_packages_and_doors():
    """dflash/ reads as a table of contents: the packages, and the doors that hand over in a few lines."""
    files = {p.stem for p in PACKAGE.glob("*.py")} - {"__init__"}
    dirs = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").is_file()}
    assert dirs == PACKAGES, f"top-level packages: {sorted(dirs)}; the documented ones: {sorted(PACKAGES)}"
    assert {f"dflash.{f}" for f in files} == ENTRY_POINTS, f"a top-level module that is not a door: {sorted(files)}"
    for name in files:
        text = (PACKAGE / f"{name}.py").read_text()
        assert len(text.splitlines()) <= 10 and "raise SystemExit(main())" in text, f"dflash/{name}.py does work"


def test_launch_imports_only_the_runner():
    ours = {m for m in _imports(REPO / "launch.py") if m != "dflash"}
    assert ours and all(m.startswith("dflash.runner.") for m in ours), sorted(ours)


def test_moved_modules_still_import_from_their_old_paths():
    """A user's script, a saved Hydra config's `_target_` and a pickle name modules by their old paths."""
    import importlib
    import pickle

    from hydra.utils import get_class

    import dflash.core.rundir
    import dflash.runner.lifecycle

    assert importlib.import_module("dflash.rundir") is dflash.core.rundir
    assert dflash.core.rundir.__spec__.name == "dflash.core.rundir"  # the module keeps its own identity
    assert get_class("dflash.secrets.CommandLineSecrets").__module__ == "dflash.core.secrets"
    old = pickle.dumps(dflash.runner.lifecycle.RunInterrupted("stopped"), protocol=0).replace(  # names by text
        b"dflash.runner.lifecycle", b"dflash.lifecycle"
    )
    assert b"dflash.lifecycle" in old
    back = pickle.loads(old)
    assert type(back) is dflash.runner.lifecycle.RunInterrupted and str(back) == "stopped"
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("dflash.no_such_module")


def test_no_room_holds_more_than_a_fifth_of_the_package():
    """The fourth pass: a folder of dflash/ is a room with a job, not a hallway (tools/ held 30%)."""
    sizes = {d.name: sum(len(p.read_text().splitlines()) for p in d.rglob("*.py")) for d in PACKAGE.iterdir()}
    total = sum(len(p.read_text().splitlines()) for p in PACKAGE.rglob("*.py"))
    big = {name: f"{n / total:.0%}" for name, n in sizes.items() if n > total * 0.21}
    assert not big, f"rooms over a fifth of dflash/'s {total} lines: {big}"


def test_the_old_tools_paths_import_and_run():
    """dflash.tools.* moved into rooms (cli, analysis, recipes, benchmarks, offline_gpu): a script's import, a saved
    Hydra `_target_` and `python -m dflash.tools.NAME` reach the module at its new place, loaded once."""
    import importlib
    import subprocess
    import sys

    from hydra.utils import get_class

    import dflash.benchmarks.step
    import dflash.recipes.make_real

    assert importlib.import_module("dflash.tools.make_real") is dflash.recipes.make_real
    assert importlib.import_module("dflash.tools.bench.step") is dflash.benchmarks.step
    assert get_class("dflash.tools.sweep.SweepSummaryCallback").__module__ == "dflash.analysis.sweep"
    out = subprocess.run(
        [sys.executable, "-m", "dflash.tools.make_real", "--help"], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0 and "--max-turn-chars" in out.stdout, out.stderr[-2000:]


def floors_and_arrows() -> str:
    """The import graph by floor: each floor's modules, and the count of imports from one package to another."""
    modules = _modules()
    lines, arrows = [], {}
    for floor in sorted(set(LAYERS.values())):
        names = sorted(p for p, f in LAYERS.items() if f == floor)
        lines.append(f"floor {floor:2d}: {', '.join(n.removeprefix('dflash.') for n in names)}")
    for name, path in modules.items():
        if name in ENTRY_POINTS or name == "dflash":
            continue
        src = name.split(".")[1]
        for imported in _imports(path):
            if imported in modules and imported != "dflash" and imported.split(".")[1] != src:
                key = (src, imported.split(".")[1])
                arrows[key] = arrows.get(key, 0) + 1
    lines.append("arrows (imports between packages):")
    lines += [f"  {a} -> {b}: {n}" for (a, b), n in sorted(arrows.items())]
    top = sorted(p.name for p in PACKAGE.iterdir() if p.suffix == ".py" or (p / "__init__.py").is_file())
    lines.append(f"top level of dflash/ ({len(top)}): {', '.join(top)}")
    return "\n".join(lines)


if __name__ == "__main__":  # python tests/test_architecture.py: the floors and arrows of docs/architecture.md
    print(floors_and_arrows())
