"""The thin command lines behind the `python -m dflash.<name>` doors that are not a room of their own: benchmark
(tau per suite), export, features (build a store), plan (will it fit)."""
