"""`python -m dflash.tools.sharegpt_data --experiment NAME`: the training data of a ShareGPT experiment, made
by its own target: `experiment=sharegpt_tiny` (`make sharegpt-tiny`, the embedded chat target) and
`experiment=smollm2_sharegpt` (`make real`, SmolLM2-135M-Instruct).

Makes the experiment's target (built or fetched, cached), takes the first exchange (first user turn and its
answer, each cut to 1,500 characters) of the first `--records` usable conversations of the real ShareGPT file
into OUT/prompts.jsonl (the original answers: what a drafter trained without regeneration sees), and has the
target answer every user turn again with its chat template (`dflash.regenerate`'s hf backend, batched, greedy,
resumable): OUT/regen.jsonl, what the experiment trains on. These records come before the ones the embedded chat
target was pretrained on (model/tiny_chat.CHAT_FIRST_RECORD) and long before the `sharegpt` benchmark suite's
held-out conversations at the end of the file.
"""

from __future__ import annotations

import argparse
import json
import logging
from collections.abc import Sequence
from pathlib import Path

from dflash.config import CONF_DIR, register_configs
from dflash.jsonio import write_text_atomic
from dflash.model.tiny import ensure_target
from dflash.model.tiny_chat import CHAT_FIRST_RECORD, sharegpt_exchanges
from dflash.tools.regen_backends import GenerationSettings, HFBackend
from dflash.tools.regenerate import failures_path, regenerate_file

log = logging.getLogger("dflash.sharegpt_data")


def compose(experiment: str, overrides: Sequence[str]):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        return hydra_compose(config_name="config", overrides=[f"experiment={experiment}", *overrides])


def prepare(out_dir: Path, records: int, source=None) -> Path:
    """OUT/prompts.jsonl: the first exchanges of the first `records` usable conversations (before the chat
    target's own records)."""
    exchanges = sharegpt_exchanges(1, records, path=source, last=CHAT_FIRST_RECORD - 1)
    path = out_dir / "prompts.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, "".join(json.dumps({"messages": c}, ensure_ascii=False) + "\n" for c in exchanges))
    return path


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m dflash.tools.sharegpt_data", description=__doc__.split("\n\n")[0])
    p.add_argument("--experiment", default="sharegpt_tiny", help="sharegpt_tiny or smollm2_sharegpt")
    p.add_argument("--out", type=Path, default=None, help="directory of regen.jsonl (default: outputs/EXPERIMENT)")
    p.add_argument("--records", type=int, default=1000, help="ShareGPT conversations to regenerate")
    p.add_argument("--max-new-tokens", type=int, default=128, help="tokens per regenerated answer")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy, as the eval decodes")
    p.add_argument("--chunk-size", type=int, default=64, help="answers generated in one batch")
    p.add_argument(
        "--dtype",
        default="float32",
        help="generation dtype: float32, bfloat16, or auto (bfloat16 where the CPU is fast)",
    )
    p.add_argument("--source", type=Path, default=None, help="a ShareGPT .json array (default: the package's)")
    p.add_argument("overrides", nargs="*", help="Hydra overrides of the experiment (e.g. paths.cache_dir=...)")
    return p.parse_args(argv)


def make_data(argv: Sequence[str] | None = None):
    """The experiment's target (made if missing), OUT/prompts.jsonl and OUT/regen.jsonl; the regeneration's
    Outcome."""
    args = parse_args(argv)
    cfg = compose(args.experiment, args.overrides)
    args.out = args.out or Path("outputs") / args.experiment
    target = ensure_target(cfg.model) or cfg.model.target
    prompts = prepare(args.out, args.records, args.source)
    backend = HFBackend(str(target), GenerationSettings(args.max_new_tokens, args.temperature), "cpu", args.dtype)
    outcome = regenerate_file(prompts, args.out / "regen.jsonl", backend, args.chunk_size)
    log.info("%d of %d answers regenerated -> %s", outcome.completed + outcome.done_before, outcome.total, outcome.out)
    if outcome.failed:
        log.warning("%d failed %s: see %s", outcome.failed, outcome.failed_by_reason, failures_path(outcome.out))
    return outcome


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    make_data(argv)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
