"""`python -m dflash.export`: export a drafter in z-lab's layout. The code lives in `dflash.tools.export`."""

from dflash.tools.export import main

if __name__ == "__main__":
    raise SystemExit(main())
