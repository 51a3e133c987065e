"""The layering of docs/architecture.md, checked on the source: imports go down, no cycles, small modules."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "dflash"
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

# layer of each module prefix (lower number = lower floor); a module may import its own floor or below
LAYERS = {
    # the base: no dflash import above it
    "dflash.config": 0,
    "dflash.validation": 0,
    "dflash.jsonio": 0,
    "dflash.hashing": 0,
    "dflash.secrets": 0,
    "dflash.rundir": 0,
    "dflash.distributed": 0,
    "dflash.terminal": 0,
    "dflash.interrupts": 0,
    "dflash.determinism": 0,
    "dflash.machine": 0,
    "dflash.disk": 0,
    "dflash.repetition": 0,
    "dflash.override_effects": 0,
    "dflash.cli_flags": 0,
    "dflash.model": 1,
    "dflash.data": 2,
    "dflash.model.tiny": 2,  # builds the embedded target from the stdlib corpus: on data's floor
    "dflash.model.tiny_chat": 2,  # and the chat target's ShareGPT conversations
    "dflash.train": 3,
    "dflash.tracking": 4,
    "dflash.evaluation": 5,
    "dflash.resume": 6,
    "dflash.job_info": 6,
    "dflash.sources": 7,
    "dflash.feature_build": 7,
    "dflash.disaggregated": 7,
    "dflash.job": 8,
    "dflash.finish": 8,
    "dflash.run": 8,
    "dflash.lifecycle": 9,
    "dflash.preflight": 9,  # launch.py's checks before Hydra runs: composes, validates, looks at data and target
    "dflash.tools": 10,  # the CLIs (compare, sweep, export, regenerate, bench): nothing imports them
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
            found.update(f"{node.module}.{a.name}" for a in node.names)  # `from dflash import rundir`
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
    tree = ast.parse((PACKAGE / "run.py").read_text())
    train = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "train")
    assert train.end_lineno - train.lineno + 1 <= 90
