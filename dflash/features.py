"""`python -m dflash.features build [--dry-run] [OVERRIDES]`: build a feature store (code: `dflash.cli.features`)."""

from dflash.cli.features import main

if __name__ == "__main__":
    raise SystemExit(main())
