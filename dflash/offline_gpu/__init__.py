"""The real target on a GPU node without network access: a bundle staged here (the wheels, the target, the data as
token ids, in pieces of a size the transfer allows), the job run there under a wall-clock budget, its result packed
into files small enough to bring back, and evaluated here. `python -m dflash.offline_gpu.cli` (make gpu-stage)."""
