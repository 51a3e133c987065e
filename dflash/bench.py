"""`python -m dflash.bench`: benchmarks that print side-by-side ratios. The code lives in `dflash.benchmarks`."""

from dflash.benchmarks import main

if __name__ == "__main__":
    raise SystemExit(main())
