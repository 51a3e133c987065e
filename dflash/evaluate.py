"""`python -m dflash.evaluate`: evaluate a drafter against its target (code: `dflash.evaluation.cli`)."""

from dflash.evaluation.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
