"""`python -m dflash.bench data [key=value ...]`: preprocessing of a large chat dataset (`data=jsonl`).

It writes a synthetic chat file of `conversations` multi-turn records (user questions, assistant turns cut
from the Python standard library's sources, some starting with indentation), then, each in a fresh process:
1. the first run: render and tokenise every record into the `datasets` cache (`map(num_proc=...)`) and build
   the first batch; prints wall time, tokens/s and peak RSS (the main process, and the largest worker);
2. the second run on the same cache: the start-up time to the first batch, and its peak RSS.
With `sizes=a,b,...` it repeats both for each size, so memory growth with N shows side by side.

Options: sizes=20000,200000 turns=3 num_proc=null seq_len=2048 batch_size=8 target=<the tiny random target>.
"""

from __future__ import annotations

import json
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from dflash.benchmarks.options import parse_opts
from dflash.core.machine import peak_rss_mb

DEFAULTS = {"sizes": "20000,200000", "turns": "3", "num_proc": "null", "seq_len": "2048", "batch_size": "8"}
DEFAULTS["target"] = ""


def write_chat_file(path: Path, conversations: int, turns: int, seed: int = 0) -> int:
    """A synthetic chat JSONL; returns its bytes."""
    from dflash.data.corpus import read_text, stdlib_files

    rng = random.Random(seed)
    sources = [read_text(p) for p in stdlib_files("train", max_files=400)]
    lines = [line for text in sources for line in text.splitlines()]
    with open(path, "w") as f:
        for i in range(conversations):
            msgs = []
            for t in range(rng.randint(1, 2 * turns - 1)):
                start = rng.randrange(len(lines) - 40)
                answer = "\n".join(lines[start : start + rng.randint(3, 20)])
                msgs.append({"role": "user", "content": f"Conversation {i}, question {t}: explain this code."})
                msgs.append({"role": "assistant", "content": answer if answer.strip() else "pass"})
            f.write(json.dumps({"messages": msgs}) + "\n")
    return path.stat().st_size


def _measure(path: str, cache: str, target: str, num_proc: str, seq_len: int, batch_size: int) -> None:
    """One run, in its own process: load (or build) the data and make the first batch; print JSON."""
    t0 = time.monotonic()
    from omegaconf import OmegaConf
    from transformers import AutoTokenizer

    from dflash.core.config import DataConfig
    from dflash.data.training_data import build_training_data

    tokenizer = AutoTokenizer.from_pretrained(target)
    data = OmegaConf.structured(
        DataConfig(name="jsonl", path=path, num_proc=None if num_proc == "null" else int(num_proc))
    )
    train = OmegaConf.create({"seq_len": seq_len, "batch_size": batch_size, "seed": 0})
    td = build_training_data(data, train, tokenizer, 16, target_path=target, cache_dir=cache)
    next(td.batches.iterate())
    wall = time.monotonic() - t0
    tokens = int(td.chat.lengths.sum())
    rss = peak_rss_mb()  # not ru_maxrss: that carries this bench's own peak across exec
    child = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    print(json.dumps({"wall_s": wall, "tokens": tokens, "rss_mb": rss, "worker_rss_mb": child}))


def _run(*args) -> dict:
    code = "import sys; from dflash.benchmarks.data import _measure; _measure(*sys.argv[1:4], sys.argv[4], " + (
        "int(sys.argv[5]), int(sys.argv[6]))"
    )
    out = subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"the measured run failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _tiny_target(cache: Path) -> str:
    from omegaconf import OmegaConf

    from dflash.core.config import CONF_DIR, TinyBuildConfig
    from dflash.model.tiny import ensure_target

    spec = OmegaConf.load(Path(CONF_DIR) / "model" / "tiny_random.yaml")

    class Model:
        target, build = str(cache / "tiny-random-qwen3-v1"), TinyBuildConfig(**OmegaConf.to_container(spec.build))

    ensure_target(Model)
    return Model.target


def bench(args: list[str]) -> None:
    opts = parse_opts(args, DEFAULTS)
    sizes = [int(s) for s in opts["sizes"].split(",")]
    print(f"data=jsonl preprocessing, sizes {sizes}, up to {2 * int(opts['turns']) - 1} turn pairs per record")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        target = opts["target"] or _tiny_target(tmp)
        rows = []
        for n in sizes:
            path = tmp / f"chat-{n}.jsonl"
            size = write_chat_file(path, n, int(opts["turns"]))
            cache = tmp / f"cache-{n}"
            run = (str(path), str(cache), target, opts["num_proc"], int(opts["seq_len"]), int(opts["batch_size"]))
            first, second = _run(*run), _run(*run)
            rows.append((n, size, first, second))
            print(
                f"{n:>8} conversations ({size / 2**20:.0f} MB, {first['tokens'] / 1e6:.1f}M tokens): "
                f"first run {first['wall_s']:.1f} s ({first['tokens'] / first['wall_s'] / 1e3:.0f} ktok/s), "
                f"peak RSS {first['rss_mb']:.0f} MB (largest worker {first['worker_rss_mb']:.0f} MB); "
                f"second run from the cache {second['wall_s']:.1f} s, peak RSS {second['rss_mb']:.0f} MB",
                flush=True,
            )
        if len(rows) > 1:
            (n0, _, a, _), (n1, _, b, _) = rows[0], rows[-1]
            print(
                f"x{n1 / n0:.0f} conversations: first-run peak RSS x{b['rss_mb'] / a['rss_mb']:.2f}, "
                f"time x{b['wall_s'] / a['wall_s']:.1f}"
            )
