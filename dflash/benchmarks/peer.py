"""`python -m dflash.bench peer RUN_DIR [RUN_DIR ...] [key=value ...]`: our recipe against a peer's at equal budget.

Each RUN_DIR is one of our runs trained from a feature store (launch.py with features=store: our default recipe,
one seed each). For each, speculators 0.9.0's DFlash is trained on the same store rows in the same order, for the
same steps, from the same seed, at the same drafter shape and anchor budget, by its own model, loss and CLI defaults
(dflash/benchmarks/peer_train.py says what is held equal and what is its own). Its checkpoint is saved by its own
`save_pretrained` and read back through our converter (model/families/speculators_layout.py); then both drafters
are evaluated by the same code, our eval.replay machinery (evaluation/replay.py): tau on the run's held-out prompts
(eval.json's) and on its eval.suites at temperature 0, over the target traces the run's own eval cached. The table
gives each side's mean over the runs and the paired difference peer - ours (mean ± sample std over the seeds).

Writes OUT/<sweep>-<job>/ (the run directory's parent and own names): peer/ (its checkpoint), peer_train.jsonl (its
loss per step), ours/ and peer_bench/ (benchmarks.json of each); OUT/peer.json (every figure) and OUT/peer.md (the
table). A peer already trained with the same settings in OUT is reused (a bench of one run, then of all, trains
each peer once). The recipe of the real target's section in docs/results.md ("Our recipe against a peer's"):

    python launch.py -m experiment=smollm2_sharegpt train.max_steps=150 train.data_seed=0 train.seed=0,1,2 \
        eval.replay=true checkpoint.every_steps=0 logging=jsonl logging.report=false hydra.sweep.dir=outputs/peer_ours
    python -m dflash.bench peer outputs/peer_ours/0 outputs/peer_ours/1 outputs/peer_ours/2 out=outputs/bench_peer

Options: out=outputs/bench_peer; lr= (its --lr, which its Muon lr follows; default its CLI's 1e-3); steps=0 (the
run's train.max_steps); store= (default: the store the run trained from).
"""

from __future__ import annotations

import json
import logging
import statistics
from pathlib import Path

import torch

from dflash.benchmarks.options import parse_opts

log = logging.getLogger(__name__)

DEFAULTS = {"out": "outputs/bench_peer", "lr": "", "steps": "0", "store": ""}
HELD_OUT = "held-out"


def _store(cfg, run, layer_ids: list[int], given: str) -> Path:
    """The feature store the run trained from (its manifest checked), or `store=`."""
    from dflash.train.feature_store import check_manifest, manifest_for, store_path

    if given:
        return Path(given)
    if cfg.features.name != "store":
        raise SystemExit(f"{run.path}: trained with features={cfg.features.name}; pass store=PATH (a feature store)")
    manifest = manifest_for(cfg, layer_ids, run.read_run_info().get("data_fingerprint"))
    store = store_path(cfg, manifest)
    check_manifest(store, manifest)
    return store


def _peer(cfg, ours, target, store: Path, steps: int, lr: float | None, work: Path):
    """Speculators' DFlash trained on the run's store rows (or the one OUT already holds for these settings), read
    back as our drafter; (drafter, its per-step records)."""
    from dflash.benchmarks.peer_train import build_peer, cli_defaults, train_peer
    from dflash.model.export import load_drafter
    from dflash.train.feature_store import StoreReader

    settings = cli_defaults(lr)
    anchors = int(cfg.train.batch_size) * int(cfg.train.num_anchors)  # our run's per step, over its rows
    key = {"store": str(store), "steps": steps, "seed": int(cfg.train.seed), "anchors": anchors,
           "lr": settings.optimizer.lr, "speculators": _version()}  # fmt: skip
    marker, log_path = work / "peer_settings.json", work / "peer_train.jsonl"
    if marker.is_file() and json.loads(marker.read_text()) == key:
        log.info("peer: reusing %s (trained with these settings)", work / "peer")
        records = [json.loads(line) for line in log_path.read_text().splitlines()]
    else:
        embed = target.model.get_input_embeddings().weight
        head = target.model.get_output_embeddings().weight
        model = build_peer(ours.config, embed, head, int(cfg.train.seed), verifier=str(cfg.model.target))
        items = StoreReader(store, (0, 0), torch.device("cpu"), dtype=torch.float32)
        records = train_peer(model, items, steps, anchors, settings, log_path)
        model.save_pretrained(str(work / "peer"))  # its own checkpoint: what its Trainer writes
        marker.write_text(json.dumps(key, indent=2) + "\n")
    return load_drafter(work / "peer"), records  # through our converter


def _version() -> str:
    from importlib.metadata import version

    return version("speculators")


def evaluate_taus(cfg, target, tokenizer, drafter, prompts: list[list[int]], out_dir: Path) -> dict[str, float]:
    """tau by replay on the held-out prompts and on every eval suite (z-lab's mean), at temperature 0."""
    from dflash.evaluation.benchmark import run_benchmarks
    from dflash.evaluation.evaluator import trace_cache_for
    from dflash.evaluation.replay import replay_evaluate

    cache = trace_cache_for(cfg, drafter.target_layer_ids)  # the run's own traces
    taus = {}
    settings = dict(max_new_tokens=int(cfg.eval.max_new_tokens), block_size=int(cfg.model.block_size))
    if prompts:
        result = replay_evaluate(target.model, drafter, prompts, cache, eos_id=tokenizer.eos_token_id,
                                 baselines=False, **settings)  # fmt: skip
        taus[HELD_OUT] = float(result["eval/tau"])
    if cfg.eval.get("suites"):
        data = run_benchmarks(
            target.model, drafter, tokenizer, out_dir, suites=list(cfg.eval.suites), temperatures=[0.0],
            max_samples=cfg.eval.suite_max_samples, ngram=int(cfg.eval.prompt_lookup_ngram), seed=int(cfg.eval.seed),
            cache_dir=cfg.paths.cache_dir, lookup=False, trace_cache=cache, **settings,
        )  # fmt: skip
        taus.update({r["settings"]["suite"]: float(r["metrics"]["tau"]) for r in data["results"].values()})
    return taus


def paired_table(rows: list[dict]) -> tuple[str, list[dict]]:
    """Markdown: per suite, each side's mean over the runs and the paired difference peer - ours (mean ± sample
    std; n = runs). Also returned as records."""
    suites = [s for s in rows[0]["ours"] if all(s in r["ours"] and s in r["peer"] for r in rows)]
    lines = ["| suite | ours | peer | peer - ours (paired) | peer ahead |", "|---|---:|---:|---:|---:|"]
    records = []
    for suite in suites:
        ours = [r["ours"][suite] for r in rows]
        peer = [r["peer"][suite] for r in rows]
        diff = [p - o for p, o in zip(peer, ours)]
        std = statistics.stdev(diff) if len(diff) > 1 else float("nan")
        ahead, mean = sum(d > 0 for d in diff), statistics.fmean
        records.append({"suite": suite, "ours": mean(ours), "peer": mean(peer), "diff": mean(diff),
                        "diff_std": std, "peer_ahead": ahead, "n": len(diff)})  # fmt: skip
        lines.append(f"| {suite} | {mean(ours):.3f} | {mean(peer):.3f} | {mean(diff):+.3f} ± {std:.3f} | "
                     f"{ahead} of {len(diff)} |")  # fmt: skip
    return "\n".join(lines) + "\n", records


def bench(args: list[str]) -> None:
    from omegaconf import OmegaConf
    from transformers import AutoTokenizer

    from dflash.core.jsonio import write_json
    from dflash.core.rundir import RunDir
    from dflash.core.terminal import install_logging
    from dflash.model.export import load_drafter
    from dflash.model.target import TargetModel
    from dflash.train.trainer import total_steps

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    install_logging()  # on a terminal, through the live display
    paths = [a for a in args if "=" not in a]
    opts = parse_opts([a for a in args if "=" in a], DEFAULTS)
    if not paths:
        raise SystemExit("usage: python -m dflash.bench peer RUN_DIR [RUN_DIR ...] [out=DIR lr=LR steps=N store=PATH]")
    out = Path(opts["out"])
    lr = float(opts["lr"]) if opts["lr"] else None
    rows, targets = [], {}
    for path in paths:
        run = RunDir(Path(path))
        if not run.config_file.is_file() or not (run.drafter / "config.json").is_file():
            raise SystemExit(f"{path}: not a finished run directory (config_resolved.yaml and drafter/ expected)")
        cfg = OmegaConf.load(run.config_file)
        ours = load_drafter(run.drafter).float().eval()
        where = str(cfg.model.target)
        if where not in targets:
            targets[where] = (TargetModel.load(where, list(ours.target_layer_ids), "float32", "cpu"),
                              AutoTokenizer.from_pretrained(where))  # fmt: skip
        target, tokenizer = targets[where]
        steps = int(opts["steps"]) or total_steps(cfg.train)
        work = out / f"{run.path.resolve().parent.name}-{run.path.name}"  # a sweep's job: its own, in any list
        work.mkdir(parents=True, exist_ok=True)
        store = _store(cfg, run, list(ours.target_layer_ids), opts["store"])
        peer, records = _peer(cfg, ours, target, store, steps, lr, work)
        prompts = [list(map(int, p)) for p in (run.read_eval() or {}).get("prompts", [])]
        sides = (("ours", ours, "ours"), ("peer", peer.float().eval(), "peer_bench"))
        taus = {side: evaluate_taus(cfg, target, tokenizer, d, prompts, work / name) for side, d, name in sides}
        row = {"run": str(path), "seed": int(cfg.train.seed), "steps": steps, "store": str(store),
               "peer_final_loss": records[-1]["loss"], **taus}  # fmt: skip
        log.info("peer bench %s (seed %d): ours %s, peer %s", path, row["seed"], row["ours"], row["peer"])
        rows.append(row)
    table, records = paired_table(rows)
    settings = cli_settings_line(lr)
    write_json(out / "peer.json", {"runs": rows, "table": records, "peer_settings": settings})
    (out / "peer.md").write_text(table)
    print(f"speculators {_version()} DFlash ({settings}) against our runs, {len(rows)} seeds, tau by replay:")
    print(table, end="")


def cli_settings_line(lr: float | None) -> str:
    """Its resolved recipe in one line (what the table's peer column was trained with)."""
    from dflash.benchmarks.peer_train import cli_defaults

    s = cli_defaults(lr)
    o, d = s.optimizer, s.dflash
    return (f"{o.optimizer} lr {o.lr:g} (Muon {o.muon_lr:g}, weight decay {o.muon_weight_decay:g}/{o.weight_decay:g}), "
            f"{s.scheduler.scheduler_type} schedule, warmup 1%, loss {s.loss.loss_fn} + {d.per_position_loss_weight} "
            f"(alpha {d.dpace_alpha:g}), clip 1.0")  # fmt: skip
