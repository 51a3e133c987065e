"""`python -m dflash.export SOURCE OUT [--dtype bfloat16]`: export a checkpoint, a run's latest checkpoint or a
drafter directory in z-lab's layout (dflash.model.export), ready for z-lab's loader, SGLang and vLLM; a draft
vocabulary (model.draft_vocab_size), DSpark and DFlash2 in vLLM speculators' layout (`--layout`)."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from dflash.core.config import DTYPE_NAMES
from dflash.core.rundir import CONFIG_FILE
from dflash.model.export import LAYOUTS, export_drafter
from dflash.model.model_card import write_model_card
from dflash.model.rendering import trained_rendering
from dflash.model.target import DTYPES
from dflash.train.checkpointer import load_drafter_from_source


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m dflash.export", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "source", help="a checkpoint dir (checkpoints/step_N), a run dir (latest checkpoint), or a drafter dir"
    )
    p.add_argument("out", help="output directory")
    p.add_argument("--dtype", choices=DTYPE_NAMES, default=None)
    p.add_argument(
        "--layout",
        choices=LAYOUTS,
        default="auto",
        help="auto (default): z-lab's for a DFlash over the target's vocabulary, speculators' for DSpark, DFlash2 "
        "and a draft vocabulary (model.draft_vocab_size), which z-lab's layout refuses",
    )
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        drafter, target = load_drafter_from_source(Path(args.source))
    except (FileNotFoundError, ValueError) as e:  # a wrong path or a checkpoint that does not fit: the user's to fix
        print(f"error: {e}", file=sys.stderr)
        return 2
    dtype = DTYPES[args.dtype] if args.dtype else None
    rendering = trained_rendering(args.source)  # the chat rendering it was trained on, recorded with it
    try:
        out = export_drafter(
            drafter, Path(args.out), dtype=dtype, target=target, rendering=rendering, layout=args.layout
        )
    except ValueError as e:  # z-lab's layout for a drafter it cannot hold: one line
        print(f"error: {e}", file=sys.stderr)
        return 2
    run_dir = _run_dir_of(Path(args.source))
    if run_dir is not None:  # the run's evidence goes with its drafter
        print(f"model card: {write_model_card(run_dir, out)}")
    print(f"exported drafter to {out}")
    return 0


def _run_dir_of(source: Path) -> Path | None:
    """The run directory a source belongs to: itself, or the run of a checkpoint (RUN/checkpoints/step_N)."""
    for candidate in (source, source.parent.parent):
        if (candidate / CONFIG_FILE).is_file():
            return candidate
    return None


if __name__ == "__main__":
    sys.exit(main())
