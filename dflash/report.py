"""`python -m dflash.report RUN_DIR [RUN_DIR ...]`: a picture of runs (code: `dflash.tracking.report`)."""

from dflash.tracking.report import main

if __name__ == "__main__":
    raise SystemExit(main())
