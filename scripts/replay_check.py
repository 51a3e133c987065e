"""Check eval.replay against full speculative decoding on a finished run: its final eval (eval.json) and its
suites (benchmarks.json) recorded every generation's prompt token ids and accepted lengths; this replays each one
over a fresh trace of the run's target and prints how many generations and cycles agree.

    python scripts/replay_check.py RUN_DIR [--max-generations N]

Temperature-0 results only. A disagreement is float round-off between one forward over the whole sequence and
decoding's chunked, cached forwards (the `ties` column counts the positions where the two argmaxes differ).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from omegaconf import OmegaConf

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from dflash.evaluation.decoding import _eos_set  # noqa: E402
from dflash.evaluation.replay import replay_drafter, trace_prompt  # noqa: E402
from dflash.model.export import load_drafter  # noqa: E402
from dflash.model.target import TargetModel  # noqa: E402


def generations(run: Path, limit: int | None) -> list[tuple[str, list[int], list[int], int, int, object]]:
    """(where, prompt ids, decoded accept lengths, max_new_tokens, block size, eos) of every greedy generation."""
    out = []
    ev = json.loads((run / "eval.json").read_text())
    d = ev["details"]
    if d.get("temperature", 0) == 0 and not d.get("replay"):
        for i, (p, row) in enumerate(zip(ev["prompts"], d["prompts"])):
            out.append((f"eval[{i}]", p, row["accept_lengths"], d["max_new_tokens"], d["block_size"], None))
    bench = run / "benchmarks.json"
    if bench.is_file():
        for key, r in json.loads(bench.read_text())["results"].items():
            st = r["settings"]
            if st["temperature"] > 0 or st.get("replay"):
                continue
            for j, g in enumerate(r["generations"]):
                out.append((f"{key}[{j}]", g["prompt_ids"], g["accept_lengths"], st["max_new_tokens"],
                            st["block_size"], st["eos_id"]))  # fmt: skip
    return out[:limit]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run", type=Path)
    ap.add_argument("--max-generations", type=int, default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    cfg = OmegaConf.load(args.run / "config_resolved.yaml")
    drafter = load_drafter(args.run / "drafter").eval()
    target = TargetModel.load(cfg.model.target, list(drafter.target_layer_ids), cfg.model.dtype, "cpu")
    from transformers import AutoTokenizer

    tokenizer_eos = AutoTokenizer.from_pretrained(cfg.model.target).eos_token_id  # what the run's eval stopped on
    same = cycles = cycle_diff = ties = 0
    gens = generations(args.run, args.max_generations)
    decoded_all, replayed_all = [], []
    for where, prompt, decoded, max_new, block, eos in gens:
        stop = _eos_set(eos if eos is not None else tokenizer_eos)
        with torch.no_grad():
            trace = trace_prompt(target.model, prompt, max_new, block, drafter.target_layer_ids)
            replayed = replay_drafter(drafter, target.model, trace, max_new, block, stop)
        ties += trace.ties
        cycles += len(decoded)
        cycle_diff += sum(a != b for a, b in zip(decoded, replayed)) + abs(len(decoded) - len(replayed))
        same += replayed == decoded
        decoded_all += decoded
        replayed_all += replayed
        if replayed != decoded:
            print(f"{where}: decoded {decoded} vs replayed {replayed} (ties {trace.ties})")
    mean = lambda xs: sum(xs) / max(1, len(xs))  # noqa: E731
    print(f"{same} of {len(gens)} generations replay cycle for cycle; {cycle_diff} of {cycles} cycles differ; "
          f"pooled tau decoded {mean(decoded_all):.4f} vs replayed {mean(replayed_all):.4f}; ties {ties}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
