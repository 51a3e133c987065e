"""`python -m dflash.compare`: compare runs by their output directories (code: `dflash.analysis.compare_cli`)."""

from dflash.analysis.compare_cli import main

if __name__ == "__main__":
    raise SystemExit(main())
