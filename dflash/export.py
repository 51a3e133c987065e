"""`python -m dflash.export`: export a drafter in z-lab's layout. The code lives in `dflash.cli.export`."""

from dflash.cli.export import main

if __name__ == "__main__":
    raise SystemExit(main())
