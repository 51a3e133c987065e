"""`python -m dflash.plan [OVERRIDES] [+nproc=N] [+memory_gib=G]`: will it fit (code: `dflash.cli.plan`)."""

from dflash.cli.plan import main

if __name__ == "__main__":
    raise SystemExit(main())
