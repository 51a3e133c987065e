"""`python -m dflash.regenerate IN OUT ...`: a chat dataset's assistant turns rewritten by the target (code:
`dflash.tools.regenerate`)."""

from dflash.tools.regenerate import main

if __name__ == "__main__":
    raise SystemExit(main())
