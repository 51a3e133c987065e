"""How well teacher-forced blocks on the target's own output estimate a run's final real tau.

    python scripts/sim_tau_check.py RUN_OR_SWEEP_DIR [...]

For each run with eval.json and drafter/: the final eval's prompts and outputs (greedy, lossless: the target's
own continuation), the teacher-forced accepted length of the block at every anchor after the prompt
(`dflash.evaluation.sim_tau.block_accept_lengths`), and three estimates of eval/tau from them: the mean over
anchors (= eval/sim_tau_greedy), the harmonic mean over anchors (tokens per cycle when a region of accepted
length L is visited once every L positions), and the replay (the anchors real decoding visits: tau itself,
a check). Then Spearman's rho of each with eval/tau over the runs. Forward passes only, CPU is fine.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def estimates(target, drafter, prompts, outputs, block_size) -> dict[str, float]:
    from dflash.evaluation.sim_tau import block_accept_lengths, replay

    lengths, replayed = [], []
    for prompt, out in zip(prompts, outputs):
        sim, _ = block_accept_lengths(target, drafter, list(prompt) + list(out), len(prompt), block_size)
        lengths += sim
        replayed += replay(sim)
    return {
        "mean": sum(lengths) / len(lengths),
        "hmean": len(lengths) / sum(1.0 / x for x in lengths),
        "replay": sum(replayed) / len(replayed),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("dirs", nargs="+", type=Path)
    args = p.parse_args()
    sys.path.insert(0, str(REPO))
    import torch
    from omegaconf import OmegaConf
    from transformers import AutoModelForCausalLM

    from dflash.analysis.rank_corr import spearman
    from dflash.model.export import load_drafter

    rows = []
    for run in sorted({e.parent for d in args.dirs for e in d.rglob("eval.json")}):
        if not (run / "drafter" / "config.json").exists():
            continue
        ev = json.loads((run / "eval.json").read_text())
        cfg = OmegaConf.load(run / "config_resolved.yaml")
        target = AutoModelForCausalLM.from_pretrained(cfg.model.target).eval()
        drafter = load_drafter(run / "drafter").eval()
        outs = [p["tokens"] for p in ev["details"]["prompts"]]
        with torch.no_grad():
            est = estimates(target, drafter, ev["prompts"], outs, ev["block_size"])
        rows.append((run, cfg.loss.name, cfg.train.seed, ev["metrics"]["eval/tau"], est))
    print("| run | loss | seed | eval/tau | mean over anchors | harmonic mean | replay |")
    print("|---|---|---|---|---|---|---|")
    for run, loss, seed, tau, est in rows:
        print(f"| {run} | {loss} | {seed} | {tau:.3f} | {est['mean']:.3f} | {est['hmean']:.3f} | {est['replay']:.3f} |")
    taus = [r[3] for r in rows]
    for key in ("mean", "hmean", "replay"):
        vals = [r[4][key] for r in rows]
        rho = spearman(vals, taus)
        mae = sum(abs(v - t) for v, t in zip(vals, taus)) / len(rows) if rows else float("nan")
        print(f"{key}: Spearman rho with eval/tau {rho if rho is None else round(rho, 3)}, mean |error| {mae:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
