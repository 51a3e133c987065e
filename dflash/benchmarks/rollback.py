"""`python -m dflash.bench rollback`: one verify cycle of speculative decoding on each target architecture against a
full-attention Qwen3 of the same widths: the verify forward of a block and the rollback of the target's cache to
the accepted prefix (dflash/evaluation/target_cache.py: a plain crop for full attention; past recording and crop
for sliding and linear-attention layers), in the verify loop's own calls.

Each architecture is a random model built in-process (dflash/model/tiny_architectures.py) at the widths below;
`ctx` positions are prefilled once, then every cycle verifies `block` tokens and rolls all of them back (the
recording costs the same whatever is kept), so every cycle starts alike. The architectures take turns cycle by
cycle (a load that drifts on a shared machine hits them all); the median of `repeats` cycles is printed with its
ratio to qwen3's.

Options: archs=qwen3,qwen3_5,qwen3_5_moe,qwen3_next,gemma4_text,gpt_oss,llama hidden=256 layers=4 heads=4
kv_heads=2 head_dim=64 intermediate=512 vocab=4096 ctx=256 block=16 repeats=30 threads=1 device=cpu (cuda: in
bfloat16, each cycle synchronised)
"""

from __future__ import annotations

import statistics
import time

from dflash.benchmarks.options import parse_opts

DEFAULTS = {
    "archs": "qwen3,qwen3_5,qwen3_5_moe,qwen3_next,gemma4_text,gpt_oss,llama",
    "hidden": "256",
    "layers": "4",
    "heads": "4",
    "kv_heads": "2",
    "head_dim": "64",
    "intermediate": "512",
    "vocab": "4096",
    "ctx": "256",
    "block": "16",
    "repeats": "30",
    "threads": "1",
    "device": "cpu",
}


class _Tok:  # the token ids a tiny model's config names
    eos_token_id = 0
    pad_token_id = 0


def _model(arch: str, o: dict):
    import torch

    from dflash.core.config import TinyBuildConfig
    from dflash.model.architectures import attention_implementation, causal_lm_class

    b = TinyBuildConfig(kind="tiny_random", architecture=arch, hidden_size=int(o["hidden"]),
                        num_layers=int(o["layers"]), num_attention_heads=int(o["heads"]),
                        num_key_value_heads=int(o["kv_heads"]), head_dim=int(o["head_dim"]),
                        intermediate_size=int(o["intermediate"]), max_position_embeddings=4096)  # fmt: skip
    from dflash.model.tiny_architectures import tiny_model

    torch.manual_seed(0)
    model = tiny_model(b, int(o["vocab"]), _Tok())
    model.config._attn_implementation = attention_implementation(causal_lm_class(model.config))
    device = torch.device(o["device"])
    return model.to(device, torch.bfloat16 if device.type == "cuda" else torch.float32).eval()


def _cycle(model, o: dict):
    """A closure running one verify cycle against a prefilled cache: verify `block` tokens, roll them back."""
    import torch

    from dflash.evaluation.target_cache import crop_cache, new_target_cache, start_recording

    ctx, block = int(o["ctx"]), int(o["block"])
    g = torch.Generator().manual_seed(0)
    device = next(model.parameters()).device
    ids = torch.randint(1, int(o["vocab"]), (1, ctx + block), generator=g).to(device)
    cache = new_target_cache(model)
    with torch.no_grad():
        model(input_ids=ids[:, :ctx], cache=cache, use_cache=True, logits_to_keep=1)
    recording = start_recording(cache, block)

    def run() -> None:
        with torch.no_grad():
            model(input_ids=ids[:, ctx : ctx + block], cache=cache, use_cache=True)
        crop_cache(cache, ctx, recording, current=ctx + block)  # back to where the cycle started
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    return run, recording


def bench(args: list[str]) -> None:
    import torch

    o = parse_opts(args, DEFAULTS)
    torch.set_num_threads(int(o["threads"]))
    archs = [a.strip() for a in o["archs"].split(",") if a.strip()]
    if "qwen3" not in archs:
        archs.insert(0, "qwen3")  # the full-attention reference every ratio is to
    if not 0 < int(o["block"]) <= int(o["ctx"]):
        raise SystemExit("rollback bench: needs 0 < block <= ctx")
    print(
        f"rollback bench: one verify cycle (verify {o['block']} tokens, roll them back) after {o['ctx']} cached "
        f"positions; {o['layers']} layers of hidden {o['hidden']} ({o['heads']} heads x {o['head_dim']}, "
        f"{o['kv_heads']} KV heads, MLP {o['intermediate']}), vocab {o['vocab']}, on {o['device']}, "
        f"{o['threads']} thread(s), {o['repeats']} cycles each, in turns"
    )
    cycles, kinds = {}, {}
    for arch in archs:
        model = _model(arch, o)
        kinds[arch] = ", ".join(f"{n} {k}" for k, n in _kinds(model).items())
        cycles[arch] = _cycle(model, o)
        cycles[arch][0]()  # warm-up
    times: dict[str, list[float]] = {a: [] for a in archs}
    for _ in range(int(o["repeats"])):
        for arch, (run, _) in cycles.items():
            t0 = time.perf_counter()
            run()
            times[arch].append(time.perf_counter() - t0)
    ref = statistics.median(times["qwen3"])
    print(f"{'architecture':<14} {'layers':<42} {'rollback':<22} {'median ms':>10} {'x qwen3':>8}")
    for arch in archs:
        med = statistics.median(times[arch])
        how = "recording + crop" if cycles[arch][1] else "crop"
        print(f"{arch:<14} {kinds[arch]:<42} {how:<22} {med * 1e3:>10.2f} {med / ref:>8.2f}")


def _kinds(model) -> dict[str, int]:
    from dflash.model.architectures import layer_kinds

    return layer_kinds(model.config)
