"""`python -m dflash.recipes.sharegpt_data --experiment NAME`: the training data of a ShareGPT experiment, made
by its own target: `experiment=sharegpt_tiny` (`make sharegpt-tiny`, the embedded chat target) and
`experiment=smollm2_sharegpt` (`make real`, SmolLM2-135M-Instruct).

Makes the experiment's target (built or fetched, cached), takes the first exchange (first user turn and its
answer, each cut to 1,500 characters; `--max-turn-chars N`: to N, in files whose names end `-cutN`) of the first
`--records` usable conversations of the real ShareGPT file into OUT/prompts.jsonl (the original answers: what a
drafter trained without regeneration sees), and has the target answer every user turn again with its chat
template (`dflash.regenerate`'s hf backend, batched, greedy, resumable; on the experiment's `model.device` in
its `model.dtype`, as the run's target computes): OUT/regen.jsonl, what the experiment trains on. These records
come before the `sharegpt` benchmark suite's held-out conversations at the end of the file
(model/tiny_chat.CHAT_LAST_RECORD), and for the embedded chat target before the ones it was pretrained on
(CHAT_FIRST_RECORD).

`--data original` trains on ShareGPT's own answers of the first `--original-records` exchanges instead (no
generation: OUT/original-N.jsonl); `--data mix` on the regenerated answers of the first `--records` exchanges and
the original answers of the `--original-records` exchanges after them, in one seeded order
(OUT/mix-....jsonl). Both files have a manifest beside them (dflash/recipes/sharegpt_mix.py).
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from dflash.core.config import CONF_DIR, register_configs
from dflash.core.jsonio import write_text_atomic
from dflash.model.tiny import ensure_target
from dflash.model.tiny_chat import (
    CHAT_FIRST_RECORD,
    CHAT_LAST_RECORD,
    MAX_TURN_CHARS,
    first_exchange,
    sharegpt_exchanges,
    sharegpt_path,
)
from dflash.recipes import sharegpt_mix
from dflash.recipes.regen_backends import GenerationSettings, HFBackend
from dflash.recipes.regenerate import Outcome, failures_path, input_identity, read_cost, regenerate_file, settings_path

DATA_CHOICES = ("regenerated", "original", "mix")

log = logging.getLogger("dflash.sharegpt_data")


def compose(experiment: str, overrides: Sequence[str]):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        return hydra_compose(config_name="config", overrides=[f"experiment={experiment}", *overrides])


def last_record(cfg) -> int:
    """The last ShareGPT record a drafter's data may take: the embedded chat target was pretrained on the records
    from CHAT_FIRST_RECORD on, so its data stops before them; any other target's before the sharegpt suite's."""
    return CHAT_FIRST_RECORD - 1 if cfg.model.name == "tiny_chat" else CHAT_LAST_RECORD


UNCUT = 10**12  # turns read whole, then cut (first_exchange) where an original answer's cut is marked


def cut_suffix(max_turn_chars: int) -> str:
    """What files made with turns cut elsewhere than MAX_TURN_CHARS add to their names (none at the default)."""
    return "" if max_turn_chars == MAX_TURN_CHARS else f"-cut{max_turn_chars}"


def exchanges(count: int, source, last: int, max_chars: int = MAX_TURN_CHARS) -> list[list[dict]]:
    """The first exchanges of the first `count` usable conversations, none past record `last` (`last_record`)."""
    try:
        return sharegpt_exchanges(1, count, path=source, last=last, max_chars=max_chars)
    except ValueError as e:  # past the records this target's data may take: one line naming the fix
        raise SystemExit(
            f"error: {e}; ask for fewer records (--records plus --original-records with --data mix)"
        ) from None


def prepare(out_dir: Path, records: int, first: list[list[dict]], suffix: str = "") -> Path:
    """OUT/prompts.jsonl (prompts-cutN.jsonl): the first `records` of the exchanges read (`exchanges`)."""
    rows = first[:records]
    path = out_dir / f"prompts{suffix}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, "".join(json.dumps({"messages": c}, ensure_ascii=False) + "\n" for c in rows))
    return path


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m dflash.recipes.sharegpt_data", description=__doc__.split("\n\n")[0])
    p.add_argument("--experiment", default="sharegpt_tiny", help="sharegpt_tiny or smollm2_sharegpt")
    p.add_argument("--out", type=Path, default=None, help="directory of regen.jsonl (default: outputs/EXPERIMENT)")
    p.add_argument("--records", type=int, default=1000, help="ShareGPT conversations to regenerate")
    p.add_argument("--data", choices=DATA_CHOICES, default="regenerated", help="which answers to train on")
    p.add_argument("--original-records", type=int, default=None, help="original answers (default: --records)")
    p.add_argument("--mix-seed", type=int, default=0, help="--data mix: the seed of the records' order")
    p.add_argument("--max-new-tokens", type=int, default=128, help="tokens per regenerated answer")
    p.add_argument("--max-turn-chars", type=int, default=MAX_TURN_CHARS,
                   help=f"a longer user turn or answer is cut at a space (default {MAX_TURN_CHARS})")  # fmt: skip
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy, as the eval decodes")
    p.add_argument("--chunk-size", type=int, default=64, help="answers generated in one batch")
    p.add_argument("--device", default=None, help="generation device (default: the experiment's model.device)")
    p.add_argument(
        "--dtype",
        default=None,
        help="generation dtype (default: the experiment's model.dtype, as its run computes): float32, bfloat16, "
        "float16, or auto (bfloat16 where the CPU is fast)",
    )
    p.add_argument("--regen-name", default=None,
                   help="the regenerated answers' file in OUT (default regen.jsonl, regen-cutN.jsonl)")  # fmt: skip
    p.add_argument("--source", type=Path, default=None, help="a ShareGPT .json array (default: the package's)")
    p.add_argument("overrides", nargs="*", help="Hydra overrides of the experiment (e.g. paths.cache_dir=...)")
    args = p.parse_args(argv)
    if args.max_turn_chars < 1:
        p.error("--max-turn-chars must be >= 1")
    args.regen_name = args.regen_name or f"regen{cut_suffix(args.max_turn_chars)}.jsonl"  # a cut's answers apart
    for name in ("records", "original_records"):
        if (getattr(args, name) or 0) < 0 or (name == "records" and args.data != "original" and args.records < 1):
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


def data_path(
    out: Path, data: str, records: int, originals: int | None, seed: int, regen_name: str, suffix: str = ""
) -> Path:
    """The file a run trains on for these choices (what make_data writes; make real's data.path); `suffix`:
    cut_suffix's, for original answers (a regenerated file's name is the caller's)."""
    regen = out / regen_name
    originals = records if originals is None else originals
    if data == "regenerated":
        return regen
    if data == "original":
        return out / sharegpt_mix.original_name(originals, suffix)
    return out / sharegpt_mix.mix_name(regen, records, originals, seed, suffix)


@dataclass
class DataMade:
    """What the data step made: the file to train on, what happened (reused, made N, failed N), the
    regeneration's Outcome (None without one) and what the file's answers cost, whenever made (data_cost)."""

    path: Path
    result: str
    outcome: Outcome | None
    cost: dict


def make_data(argv: Sequence[str] | None = None) -> DataMade:
    """The experiment's target (made if missing), OUT/prompts.jsonl and OUT/regen.jsonl (but with --data
    original), and with --data original or mix the file they train on instead."""
    args = parse_args(argv)
    cfg = compose(args.experiment, args.overrides)
    out = args.out or Path("outputs") / args.experiment
    out.mkdir(parents=True, exist_ok=True)
    originals = args.records if args.original_records is None else args.original_records
    regenerated = 0 if args.data == "original" else args.records
    first_original = regenerated if args.data == "mix" else 0
    cpu0, wall0 = time.process_time(), time.monotonic()
    wanted = max(regenerated, first_original + (originals if args.data != "regenerated" else 0))
    suffix = cut_suffix(args.max_turn_chars)
    whole = exchanges(wanted, args.source, last_record(cfg), UNCUT)  # an original answer cut says so (#57)
    rows = [first_exchange(ex, args.max_turn_chars) for ex in whole]
    read = {"cpu_s": time.process_time() - cpu0, "wall_s": time.monotonic() - wall0}
    regen, outcome = out / args.regen_name, None
    if regenerated:
        outcome = regenerate(cfg, args, prepare(out, regenerated, rows, suffix), regen)
    if args.data == "regenerated":
        return DataMade(regen, regen_result(outcome), outcome, data_cost(regen, None))
    cpu0, wall0 = time.process_time(), time.monotonic()
    part = whole[first_original : first_original + originals]
    original = sharegpt_mix.original_records(part, first_original, args.max_turn_chars)
    source = {**input_identity(args.source or sharegpt_path()), "turns_cut_at_chars": args.max_turn_chars}
    parts = [{"origin": sharegpt_mix.ORIGINAL, "conversations": {"first": first_original, "count": originals},
              "how": "ShareGPT's own answers of the conversations' first exchanges"}]  # fmt: skip
    path = data_path(out, args.data, args.records, originals, args.mix_seed, args.regen_name, suffix)
    if args.data == "original":
        records, order = original, "conversation order"
    else:
        records = sharegpt_mix.mixed(sharegpt_mix.regenerated_records(regen), original, args.mix_seed)
        order = f"random.Random({args.mix_seed}).shuffle of both parts"
        parts.insert(0, regenerated_part(regen, regenerated, outcome))
    own = {"cpu_s": round(read["cpu_s"] + time.process_time() - cpu0, 3),
           "wall_s": round(read["wall_s"] + time.monotonic() - wall0, 3)}  # fmt: skip
    manifest = {"data": args.data, "source": source, "parts": parts, "order": order, "seed": args.mix_seed,
                "cost": own}  # fmt: skip
    made = sharegpt_mix.write_records(path, records, manifest)
    log.info("%s: %d records (%s) -> %s", args.data, len(records), "written" if made else "as before", path)
    said = [regen_result(outcome) if outcome else "reused", f"{args.data} made" if made else "reused"]
    result = ", ".join(r for r in said if r != "reused") or "reused"
    return DataMade(path, result, outcome, data_cost(regen if outcome else None, path))


def regenerate(cfg, args: argparse.Namespace, prompts: Path, regen: Path) -> Outcome:
    """The target's answers to OUT/prompts.jsonl in `regen`, on the run's device in the run's dtype (unless asked
    otherwise), so that the data is the run's target's greedy output on any machine."""
    target = ensure_target(cfg.model) or cfg.model.target
    settings = GenerationSettings(args.max_new_tokens, args.temperature)
    device, dtype = args.device or cfg.model.device, args.dtype or cfg.model.dtype
    backend = HFBackend(str(target), settings, device, dtype)
    outcome = regenerate_file(prompts, regen, backend, args.chunk_size)
    log.info("%d of %d answers regenerated -> %s (%s)", outcome.completed + outcome.done_before, outcome.total,
             outcome.out, backend.dtype)  # fmt: skip
    if outcome.failed:
        log.warning("%d failed %s: see %s", outcome.failed, outcome.failed_by_reason, failures_path(outcome.out))
    return outcome


def regen_result(outcome: Outcome) -> str:
    """What the regeneration did: reused (every answer there before), made N, failed N, or both."""
    said = [
        f"made {outcome.completed}" if outcome.completed else "",
        f"failed {outcome.failed}" if outcome.failed else "",
    ]
    return ", ".join(s for s in said if s) or "reused"


def regenerated_part(regen: Path, count: int, outcome: Outcome) -> dict:
    """The mix's regenerated part, as its manifest records it: who answered how (settings.json), and the cost."""
    return {
        "origin": sharegpt_mix.REGENERATED,
        "file": str(regen),
        "conversations": {"first": 0, "count": count},
        "failed": outcome.failed,
        "how": "the target's answers to the same user turns (python -m dflash.regenerate's hf backend)",
        "settings": json.loads(settings_path(regen).read_text()),
        "cost": read_cost(regen),
    }


def data_cost(regen: Path | None, made: Path | None) -> dict:
    """What the training file's answers cost, whenever made: the regeneration's CPU and wall seconds
    (regen.jsonl.cost.json; scaled up, `estimated`, where it covers fewer answers than the file holds, None
    where it covers none) plus making an original or mixed file (its manifest's `cost`)."""
    answers = sum(1 for line in regen.read_text().splitlines() if line.strip()) if regen and regen.exists() else 0
    ledger = read_cost(regen) if regen else {"cpu_s": 0.0, "wall_s": 0.0, "answers": 0}
    own = json.loads(sharegpt_mix.manifest_path(made).read_text())["cost"] if made else {"cpu_s": 0, "wall_s": 0}
    scale = 1.0 if ledger["answers"] >= answers else answers / ledger["answers"] if ledger["answers"] else None
    cost = {"regenerated_answers": answers, "answers_costed": min(ledger["answers"], answers),
            "estimated": scale not in (None, 1.0)}  # fmt: skip
    for key in ("cpu_s", "wall_s"):
        cost[key] = None if scale is None else round(ledger[key] * scale + own[key], 3)
    return cost


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    make_data(argv)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
