"""`python -m dflash.benchmark`: tau and speedup per benchmark suite (code: `dflash.cli.benchmark`)."""

from dflash.cli.benchmark import main

if __name__ == "__main__":
    raise SystemExit(main())
