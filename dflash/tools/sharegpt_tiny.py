"""`python -m dflash.tools.sharegpt_tiny`: the data of `experiment=sharegpt_tiny` (`make sharegpt-tiny`).

Builds the experiment's chat target (`model=tiny_chat`, cached), takes the first exchange (first user turn and
its answer, each cut as the chat target's pretraining cuts them) of the first `--records` usable conversations
of the real ShareGPT file, and has the target answer every user turn again (`dflash.regenerate`'s hf backend,
greedy, resumable): OUT/regen.jsonl, what `python launch.py experiment=sharegpt_tiny` trains on. These records
come before the ones the chat target was pretrained on (model/tiny_chat.CHAT_FIRST_RECORD) and long before the
`sharegpt` benchmark suite's held-out conversations at the end of the file.
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

log = logging.getLogger("dflash.sharegpt_tiny")


def compose(overrides: Sequence[str]):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        return hydra_compose(config_name="config", overrides=["experiment=sharegpt_tiny", *overrides])


def prepare(out_dir: Path, records: int, source=None) -> Path:
    """OUT/prompts.jsonl: the first exchanges of the first `records` usable conversations (before the chat
    target's own records)."""
    exchanges = sharegpt_exchanges(1, records, path=source, last=CHAT_FIRST_RECORD - 1)
    path = out_dir / "prompts.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, "".join(json.dumps({"messages": c}, ensure_ascii=False) + "\n" for c in exchanges))
    return path


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m dflash.tools.sharegpt_tiny", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("outputs/sharegpt_tiny"), help="directory of regen.jsonl")
    p.add_argument("--records", type=int, default=1000, help="ShareGPT conversations to regenerate")
    p.add_argument("--max-new-tokens", type=int, default=128, help="tokens per regenerated answer")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy, as the eval decodes")
    p.add_argument("--chunk-size", type=int, default=64, help="answers generated in one batch")
    p.add_argument("--source", type=Path, default=None, help="a ShareGPT .json array (default: the package's)")
    p.add_argument("overrides", nargs="*", help="Hydra overrides of the experiment (e.g. paths.cache_dir=...)")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cfg = compose(args.overrides)
    target = ensure_target(cfg.model)
    prompts = prepare(args.out, args.records, args.source)
    backend = HFBackend(str(target), GenerationSettings(args.max_new_tokens, args.temperature), "cpu")
    outcome = regenerate_file(prompts, args.out / "regen.jsonl", backend, args.chunk_size)
    log.info("%d of %d answers regenerated -> %s", outcome.completed + outcome.done_before, outcome.total, outcome.out)
    if outcome.failed:
        log.warning("%d failed %s: see %s", outcome.failed, outcome.failed_by_reason, failures_path(outcome.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
