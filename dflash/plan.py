"""`python -m dflash.plan [OVERRIDES] [+nproc=N] [+memory_gib=G]`: will it fit (code: `dflash.tools.plan`)."""

from dflash.tools.plan import main

if __name__ == "__main__":
    raise SystemExit(main())
