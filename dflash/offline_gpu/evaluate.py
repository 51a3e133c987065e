"""`python -m dflash.offline_gpu.cli evaluate OUTDIR`: the drafter the GPU node trained, back here and evaluated
against the same target, beside make real's.

    rebuild   OUTDIR's parts checked (each, then the whole, by sha256) and unpacked into outputs/gpu_real/<id>/:
              run/ (a run directory: the drafter, metrics.jsonl, run.json, ...), data/ (the token files trained
              on), node.json; the run's config pointed at this machine (config_node.yaml keeps the node's):
              model.target the local converted target, which must have the node's GGUF sha256 and weights
              (refused otherwise), model.device=cpu, data.path the returned data
    evaluate  on CPU, float32: the held-out prompts (make real's own when its run is here, so the figure sits beside
              its eval), by full speculative decoding (lossless checked); the suites (default humaneval, sharegpt,
              mt-bench) by full decoding of make real's subset (its eval.suite_max_samples, the same rows), and by
              replay over every prompt (eval.replay's traces, cached under paths.cache_dir), make real's drafter
              replayed beside it; eval.json, benchmarks.json, replay/ and comparison.md in the run directory
"""

from __future__ import annotations

import json
import logging
import shutil
import tarfile
from pathlib import Path

from dflash.offline_gpu.limits import FORMAT, StageError, join_parts
from dflash.offline_gpu.pack import RESULT

log = logging.getLogger("dflash.offline_gpu")

SUITES = ("humaneval", "sharegpt", "mt-bench")


def rebuild(outdir: Path, dest_root: Path) -> Path:
    """The returned tar's parts checked and unpacked: dest_root/<first 12 hex of its sha256>/ (its folder)."""
    result_file = outdir / RESULT
    if not result_file.is_file():
        raise StageError(f"{result_file} is missing: is {outdir} the folder the run step's files came back in?")
    result = json.loads(result_file.read_text())
    if result.get("format") != FORMAT:
        raise StageError(f"{result_file}: format {result.get('format')!r}, not {FORMAT!r}")
    dest, unpack = dest_root / result["sha256"][:12], dest_root / ".unpack"
    tar = join_parts(
        result["parts"], dest_root / f".{dest.name}.tar.gz", result["sha256"], outdir, f"{outdir}'s result"
    )
    shutil.rmtree(dest, ignore_errors=True)
    with tarfile.open(tar) as t:
        t.extractall(unpack, filter="data")
    (unpack / "gpu_real").replace(dest)
    shutil.rmtree(unpack, ignore_errors=True)
    tar.unlink()
    shutil.copy2(result_file, dest / RESULT)
    return dest


def local_target(node: dict, dest: Path):
    """This machine's target for the node's experiment and overrides (made if missing), refused unless it is the
    node's: the same GGUF file (build_info.json) and the same weights (their sha256)."""
    from dflash.model.gguf_target import provenance
    from dflash.model.tiny import ensure_target
    from dflash.offline_gpu.node_run import target_weights_sha256
    from dflash.recipes.sharegpt_data import compose

    overrides = [o for o in node.get("overrides", []) if not o.startswith("model.device=")]
    cfg = compose(node["experiment"], [*overrides, "model.device=cpu"])
    target = Path(ensure_target(cfg.model) or cfg.model.target).expanduser()
    made = (provenance(target) or {}).get("gguf_sha256")
    there = (
        json.loads((dest / "target_build_info.json").read_text()).get("provenance", {}).get("gguf_sha256")
        if (dest / "target_build_info.json").is_file()
        else None
    )
    if made != there:
        raise StageError(
            f"the node's target was converted from GGUF sha256 {there}, this machine's {target} from "
            f"{made}: evaluate against the same target"
        )
    ours, theirs = target_weights_sha256(target), node.get("target_weights_sha256")
    if theirs and ours != theirs:
        raise StageError(
            f"{target}'s weights (sha256 {ours[:12]}...) are not the node's ({theirs[:12]}...): the two "
            "conversions differ; evaluate against the node's"
        )
    return cfg, target


def localize(dest: Path) -> tuple[Path, object]:
    """run/config_resolved.yaml pointed at this machine's target, CPU and the returned data (the node's kept)."""
    from omegaconf import OmegaConf

    run = dest / "run"
    cfg_local, target = local_target(json.loads((dest / "node.json").read_text()), dest)
    kept = run / "config_node.yaml"
    if not kept.is_file():
        shutil.copy2(run / "config_resolved.yaml", kept)
    cfg = OmegaConf.load(kept)
    cfg.model.target, cfg.model.device, cfg.paths.cache_dir = str(target), "cpu", str(cfg_local.paths.cache_dir)
    cfg.data.path = str(dest / "data")
    OmegaConf.save(cfg, run / "config_resolved.yaml")
    return run, cfg


def find_make_real_run(root: Path = Path("outputs/smollm2_sharegpt")) -> Path | None:
    """make real's newest completed run (its OUT/run-<key>), if any."""
    runs = [p.parent for p in root.glob("run-*/status.json") if '"completed"' in p.read_text()]
    return max(runs, key=lambda p: p.stat().st_mtime) if runs else None


def _suite_runs(model, drafter, tokenizer, out: Path, cfg, args, trace_cache=None, samples=None) -> dict:
    from dflash.evaluation.benchmark import run_benchmarks

    return run_benchmarks(
        model,
        drafter,
        tokenizer,
        out,
        suites=list(args.suites),
        max_samples=samples,
        max_new_tokens=args.max_new_tokens,
        ngram=cfg.eval.prompt_lookup_ngram,
        seed=cfg.eval.seed,
        cache_dir=cfg.paths.cache_dir,
        info={"drafter": str(out), "target": str(cfg.model.target)},
        trace_cache=trace_cache,
    )


def evaluate_run(run: Path, cfg, args, make_real: Path | None) -> dict:
    """eval.json (held-out prompts, full decoding), benchmarks.json (the suites' subset, full decoding), replay/
    (every suite prompt replayed) and, with make real's run, replay_make_real/; summary.json gets their metrics."""
    import torch
    from omegaconf import OmegaConf
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dflash.core.rundir import bench_metrics, write_eval_json
    from dflash.evaluation.evaluator import choose_prompts, evaluate, trace_cache_for, untrained_like
    from dflash.model.export import load_drafter

    torch.manual_seed(0)
    drafter = load_drafter(run / "drafter").float().eval()  # trained and shipped in bf16; evaluated in float32
    model = AutoModelForCausalLM.from_pretrained(cfg.model.target, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.target)
    recorded = (
        json.loads((make_real / "eval.json").read_text()).get("prompts")
        if make_real and (make_real / "eval.json").is_file()
        else None
    )
    prompts = (
        [list(map(int, p)) for p in recorded]
        if recorded
        else choose_prompts(
            cfg.eval, cfg.data, tokenizer, cfg.eval.seed, target=cfg.model.target, cache_dir=cfg.paths.cache_dir
        )
    )
    result = evaluate(
        model,
        drafter,
        prompts,
        max_new_tokens=args.max_new_tokens,
        temperature=0.0,
        baselines=True,
        ngram=cfg.eval.prompt_lookup_ngram,
        untrained_drafter=untrained_like(drafter, cfg.train.seed),
        seed=cfg.eval.seed,
        eos_id=tokenizer.eos_token_id,
        tokenizer=tokenizer,
        sim_tau=True,
    )
    summary = json.loads((run / "summary.json").read_text()) if (run / "summary.json").is_file() else {}
    write_eval_json(
        run / "eval.json",
        result,
        step=summary.get("step"),
        block_size=drafter.block_size,
        seed=cfg.eval.seed,
        prompts=prompts,
        prompts_from=str(make_real) if recorded else "held-out data",
    )
    decoded = _suite_runs(model, drafter, tokenizer, run, cfg, args, samples=args.samples)
    replay_cfg = OmegaConf.merge(cfg, {"eval": {"max_new_tokens": args.max_new_tokens}})
    traces = trace_cache_for(replay_cfg, drafter.target_layer_ids)
    replayed = _suite_runs(model, drafter, tokenizer, run / "replay", cfg, args, traces, args.replay_samples)
    theirs = None
    if make_real is not None and (make_real / "drafter" / "config.json").is_file():
        other = load_drafter(make_real / "drafter").float().eval()
        theirs = _suite_runs(model, other, tokenizer, run / "replay_make_real", cfg, args, traces, args.replay_samples)
    summary.update({k: v for k, v in result.items() if k != "details"})
    summary.update(bench_metrics(decoded))
    (run / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    return {"eval": result, "decoded": decoded, "replayed": replayed, "make_real_replayed": theirs}


def _metric(data: dict | None, suite: str, key: str):
    r = ((data or {}).get("results") or {}).get(f"{suite}@T0")
    return (r or {}).get("metrics", {}).get(key)


def _num(x, digits: int = 3) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def comparison_table(out: dict, make_real: Path | None) -> str:
    """One row per prompt set: this drafter's tau and make real's, by full decoding (the same prompts) and by
    replay over every suite prompt, prompt lookup's, and whether decoding was lossless."""
    theirs_eval, theirs_bench = {}, None
    if make_real is not None:
        theirs_eval = (
            json.loads((make_real / "summary.json").read_text()) if (make_real / "summary.json").is_file() else {}
        )
        theirs_bench = (
            json.loads((make_real / "benchmarks.json").read_text())
            if (make_real / "benchmarks.json").is_file()
            else None
        )
    e = out["eval"]
    head = (
        "| prompts | GPU drafter tau | make real tau | prompt lookup | GPU drafter tau, replay (n) | "
        "make real tau, replay | lossless |"
    )
    rows = [head, "|---|---:|---:|---:|---:|---:|---|"]
    rows.append(
        f"| held-out ({int(e['eval/num_prompts'])}, pooled) | {_num(e['eval/tau'])} | "
        f"{_num(theirs_eval.get('eval/tau'))} | {_num(e.get('eval/tau_baseline'))} | - | - | "
        f"{e.get('eval/lossless')} |"
    )
    for suite in dict.fromkeys(r["settings"]["suite"] for r in out["decoded"]["results"].values()):
        n = _metric(out["replayed"], suite, "num_prompts")
        rows.append(
            f"| {suite} ({int(_metric(out['decoded'], suite, 'num_prompts') or 0)}, z-lab's mean) | "
            f"{_num(_metric(out['decoded'], suite, 'tau'))} | {_num(_metric(theirs_bench, suite, 'tau'))} | "
            f"{_num(_metric(out['decoded'], suite, 'tau_lookup'))} | {_num(_metric(out['replayed'], suite, 'tau'))} "
            f"({int(n or 0)}) | {_num(_metric(out['make_real_replayed'], suite, 'tau'))} | "
            f"{_metric(out['decoded'], suite, 'lossless')} |"
        )
    where = f"make real: {make_real}" if make_real else "make real: no completed run found here"
    return "\n".join(rows) + f"\n\n{where}\n"
