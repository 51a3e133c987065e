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
METRIC = re.compile(r"`((?:[a-z]+/[A-Za-z0-9_<>|]+)|step|tokens|time_s|wall_time_s|status)`")
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
