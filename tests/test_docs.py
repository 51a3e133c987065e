"""The docs against the code: the metric names a run logs are the ones docs/architecture.md lists, every relative
link of README.md and docs/*.md leads to a file (and heading) that exists, and the README stays a front page."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from conftest import REPO, launch

README_MAX_LINES = 260
ARCHITECTURE = REPO / "docs" / "architecture.md"
# a backticked metric name: `group/name` (with <k> or <a|b> placeholders) or a top-level field of a record
TOP_LEVEL = "step|tokens|time_s|wall_time_s|status|stop_reason|precision|precision_requested"
METRIC = re.compile(rf"`((?:[a-z]+/[A-Za-z0-9_<>|]+)|{TOP_LEVEL})`")
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")


def doc_files() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), REPO / "CHANGELOG.md"]


def metrics_section(text: str) -> str:
    start = text.index("## Metric names")
    end = text.find("\n## ", start + 1)
    return text[start : end if end > 0 else len(text)]


def documented_patterns(section: str) -> list[re.Pattern]:
    """The names of the section as regexes: `<k>` is a number, `<a|b>` one of the alternatives, `<word>` a name."""

    def placeholder(m: re.Match) -> str:
        inner = m.group(1)
        if inner == "k":
            return r"\d+"
        if "|" in inner:
            return "(?:" + "|".join(re.escape(x) for x in inner.split("|")) + ")"
        return r"[A-Za-z0-9_]+"

    patterns = []
    for name in METRIC.findall(section):
        parts = re.split(r"(<[^>]+>)", name)
        rx = "".join(placeholder(re.match(r"<([^>]+)>", p)) if p.startswith("<") else re.escape(p) for p in parts)
        patterns.append(re.compile(rx + r"\Z"))
    return patterns


def undocumented(keys: set[str], patterns: list[re.Pattern]) -> list[str]:
    return sorted(k for k in keys if not any(p.match(k) for p in patterns))


def test_metric_names_section_parses():
    patterns = documented_patterns(metrics_section(ARCHITECTURE.read_text()))
    assert len(patterns) > 40
    known = {"train/accuracy_3", "eval/acc_pos_3", "eval/acc_hist_8", "perf/peak_rss_mb_max", "step"}
    assert undocumented(known, patterns) == []
    # renamed so that a name has one meaning: train/accuracy_<k>, eval/degenerate_target_only
    assert undocumented({"train/acc_pos_3", "perf/ktok_s_max", "eval/tau2", "eval/degenerate"}, patterns) == [
        "eval/degenerate",
        "eval/tau2",
        "perf/ktok_s_max",
        "train/acc_pos_3",
    ]


@pytest.mark.slow
def test_every_logged_metric_is_documented(tmp_path, cache_dir, tiny_target):
    """A smoke job's metrics.jsonl, summary.json and eval.json hold no key that the Metric names section lacks."""
    run_dir = tmp_path / "run"
    args = ["experiment=smoke", f"hydra.run.dir={run_dir}", "train.max_steps=6", "eval.num_prompts=2"]
    launch([*args, "eval.every_steps=3", "pipeline.monitor_interval_s=0.2"], cache_dir, check=True)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    summary = json.loads((run_dir / "summary.json").read_text())
    evaluated = json.loads((run_dir / "eval.json").read_text())["metrics"]
    keys = {k for r in records for k in r} | set(summary) | set(evaluated)
    assert any(k.startswith("train/") for k in keys) and any(k.startswith("perf/") for k in keys)
    assert "eval/tau" in keys and "eval/tau_baseline" in keys, sorted(keys)
    patterns = documented_patterns(metrics_section(ARCHITECTURE.read_text()))
    missing = undocumented(keys, patterns)
    assert not missing, f"logged but not in docs/architecture.md's '## Metric names': {missing}"


def _anchors(path: Path) -> set[str]:
    """GitHub's heading anchors of a Markdown file (lower case, punctuation dropped, spaces to hyphens)."""
    out = set()
    for line in path.read_text().splitlines():
        if m := re.match(r"#{1,6}\s+(.*)", line):
            slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
            out.add(slug)
    return out


def test_relative_links_lead_to_files_and_headings():
    broken = []
    for doc in doc_files():
        if not doc.exists():
            continue
        text = re.sub(r"```.*?```", "", doc.read_text(), flags=re.S)  # links in code blocks are not links
        for target in LINK.findall(text):
            if re.match(r"[a-z]+:", target):  # https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            dest = (doc.parent / path).resolve() if path else doc
            if not dest.exists():
                broken.append(f"{doc.relative_to(REPO)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                broken.append(f"{doc.relative_to(REPO)}: {target} (no such heading)")
    assert not broken, broken


def test_readme_is_a_front_page():
    lines = (REPO / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; move detail to docs/"
    for doc in ("data", "multi-gpu", "evaluation", "results", "training", "troubleshooting", "architecture"):
        assert f"docs/{doc}.md" in "\n".join(lines), f"README.md does not link docs/{doc}.md"


# --- every launch.py command line the docs show composes (issue 40: the README's first real run did not) ---

FENCE = re.compile(r"^[ \t]*```[^\n]*\n(.*?)^[ \t]*```", re.S | re.M)
# a command: python (or torchrun, or torch.distributed.run) and launch.py on one logical line, also in a comment
COMMAND = re.compile(r"\b(?:python3?|torchrun|torch\.distributed\.run)\b[^#;]*?\blaunch\.py\b(.*)")
INLINE = re.compile(r"`((?:python3? |torchrun )[^`]*\blaunch\.py\b[^`]*)`")
SHELL_VAR = re.compile(r"\$\{?([A-Za-z_]\w*)\}?")
PLACEHOLDER = re.compile(r"<([a-z_]+)>")
HYDRA_FLAGS = {"-m", "--multirun"}  # and `--cfg WHAT`, `--info`: they print, the composition is the same


def _args_after_launch(line: str) -> list[str] | None:
    import shlex

    m = COMMAND.search(line)
    if m is None:
        return None
    rest = m.group(1)
    words = shlex.split(rest, comments=True)
    args = []
    for word in words:
        if word in (";", "&&", "|", "done"):
            break
        if word.endswith(";"):  # `... hydra.run.dir=x; done`
            args.append(word[:-1])
            break
        args.append(word)
    # "..." stands for the reader's other overrides, <date> for a value of theirs
    return [PLACEHOLDER.sub(r"\1", a) for a in args if a != "..."]


def _block_commands(block: str) -> list[list[str]]:
    """The launch.py argument lists of one code block: continuations joined, the block's `NAME=value` and
    `for NAME in first ...` shell variables substituted (their first value)."""
    shell_vars: dict[str, str] = {}
    commands = []
    for line in re.sub(r"\\\n\s*", " ", block).splitlines():
        text = line.strip()
        if m := re.fullmatch(r"([A-Za-z_]\w*)=(\"[^\"]*\"|'[^']*'|\S+)", text):
            shell_vars[m.group(1)] = m.group(2).strip("\"'")
        for m in re.finditer(r"\bfor (\w+) in ([^;]+);", text):
            shell_vars[m.group(1)] = m.group(2).split()[0]
        text = SHELL_VAR.sub(lambda m: shell_vars.get(m.group(1), m.group(0)), text)
        if (args := _args_after_launch(text)) is not None:
            commands.append(args)
    return commands


def documented_launch_commands() -> list[tuple[str, list[str]]]:
    """(where, arguments) of every `python launch.py ...` / `torchrun ... launch.py ...` in README.md and docs/*.md:
    code blocks (comments included: `# = python launch.py ...`) and inline code."""
    found = []
    for doc in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        text = doc.read_text()
        for block in FENCE.findall(text):
            found += [(doc.name, args) for args in _block_commands(block)]
        for span in INLINE.findall(FENCE.sub("", text)):
            found += [(doc.name, args) for args in _block_commands(span.replace("\n", " "))]
    return found


def _jobs(args: list[str]) -> list[list[str]]:
    """The overrides of the jobs a command line runs: W&B flags translated as launch.py does; under -m each value of
    each sweep composed at least once (job i takes value i of every sweep, the last repeated)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from dflash.core.cli_flags import translate_wandb_flags

    args = translate_wandb_flags(["launch.py", *args])[1:]
    kept, skip = [], False
    for a in args:
        if skip:
            skip = False
        elif a == "--cfg":
            skip = True  # its value: job, hydra or all
        elif a not in HYDRA_FLAGS and a != "--info":
            kept.append(a)
    parsed = OverridesParser.create().parse_overrides(kept)
    values = [list(o.sweep_string_iterator()) if o.is_sweep_override() else [None] for o in parsed]
    jobs = []
    for i in range(max(len(v) for v in values) if values else 1):
        job = []
        for o, vs in zip(parsed, values, strict=True):
            job.append(o.input_line if vs == [None] else f"{o.get_key_element()}={vs[min(i, len(vs) - 1)]}")
        jobs.append(job)
    return jobs


def test_documented_commands_are_found():
    """The extraction sees what a reader sees: the first real run, sweeps, torchrun lines, shell loops, comments."""
    commands = documented_launch_commands()
    assert len(commands) > 30
    flat = [" ".join(args) for _, args in commands]
    assert any("data.chat_template_kwargs={enable_thinking: false}" in c for c in flat)
    assert "-m loss=kl_streak loss.kl_temperature=1,2,4 train.seed=0,1,2" in flat
    assert any(c.startswith("parallel=fsdp model=qwen3_8b") for c in flat)  # a torchrun line
    assert any("features.dtype=bfloat16" in c and "$" not in c for c in flat)  # the store-dtype shell loop
    assert "-m experiment=ablation_loss" in flat  # `make ablation  # = python launch.py -m ...`
    assert _jobs(["-m", "a.b=1,2,3", "c=x,y"]) == [["a.b=1", "c=x"], ["a.b=2", "c=y"], ["a.b=3", "c=y"]]


def test_every_documented_launch_command_composes():
    """Each launch.py command line of README.md and docs/*.md composes with Hydra's compose API and passes
    validate() (no run): a doc's command that Hydra or the value checks refuse fails here, naming the doc."""
    from hydra import compose, initialize_config_dir

    from dflash.core.config import CONF_DIR, register_configs
    from dflash.core.validation import validate

    register_configs()
    failures = []
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        for where, args in documented_launch_commands():
            try:
                for overrides in _jobs(args):
                    validate(compose(config_name="config", overrides=overrides))
            except Exception as e:  # noqa: BLE001 - every failure is reported, with its doc
                failures.append(f"{where}: launch.py {' '.join(args)}: {type(e).__name__}: {e}")
    assert not failures, "\n".join(failures)


def _listed_groups(doc: Path) -> dict[str, set[str] | None]:
    """The doc's 'Groups (`conf/`): `group` (option, ...), ...' paragraph: each group with the options it lists
    (None where it lists none)."""
    text = doc.read_text()
    start = text.index("Groups (`conf/`)")
    paragraph = " ".join(text[start : text.index("\n\n", start)].split())
    listed = {}
    for group, options in re.findall(r"`([a-z_/]+)`(?: \(([^)]*)\))?", paragraph):
        names = {o.strip() for o in options.split(",")} if options else set()
        listed.setdefault(group, {n for n in names if re.fullmatch(r"\w+", n)} or None)
    return listed


@pytest.mark.parametrize("doc,skipped", [("README.md", {"debug", "hydra"}), ("docs/training.md", set())])
def test_config_group_lists_name_every_group_and_option(doc, skipped):
    """README's and training.md's lists of config groups against conf/: every group (README: those a user
    chooses, not debug or the hydra presets), and where options are listed, exactly conf/'s."""
    conf = REPO / "conf"
    groups = {
        str(d.relative_to(conf)): {f.stem for f in d.glob("*.yaml")}
        for d in sorted(conf.rglob("*"))
        if d.is_dir() and any(d.glob("*.yaml")) and d.relative_to(conf).parts[0] not in skipped
    }
    listed = _listed_groups(REPO / doc)
    assert sorted(set(groups) - set(listed)) == [], f"{doc} does not list these conf/ groups"
    wrong = {g: (sorted(listed[g]), sorted(opts)) for g, opts in groups.items() if listed[g] not in (None, opts)}
    assert not wrong, f"{doc}: listed options vs conf/'s: {wrong}"
