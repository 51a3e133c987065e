"""Runs compared after the fact, by their output directories: `python -m dflash.compare` (compare_cli, compare), seed
groups with mean and spread, rank correlation between two metrics, the learning curve, the sweep's summary (a Hydra
callback), and what a run or a feature store cost in CPU seconds."""
