"""`python -m dflash.regenerate IN OUT ...`: a chat dataset's assistant turns rewritten by the target (code:
`dflash.recipes.regenerate`)."""

from dflash.recipes.regenerate import main

if __name__ == "__main__":
    raise SystemExit(main())
