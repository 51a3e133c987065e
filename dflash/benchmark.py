"""`python -m dflash.benchmark`: tau and speedup per benchmark suite (code: `dflash.tools.benchmark_cli`)."""

from dflash.tools.benchmark_cli import main

if __name__ == "__main__":
    raise SystemExit(main())
