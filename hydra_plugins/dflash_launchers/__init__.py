"""Hydra's submitit launchers, aware of ranks: `hydra/launcher=local_ddp` / `slurm_ddp` start one task per rank,
and a task other than rank 0 gets the same Hydra overrides as a torchrun rank > 0 (no .hydra/ of its own, its
warnings in launch.rank<r>.log) before Hydra writes anything. Hydra instantiates launchers only from the
`hydra_plugins` package, hence this home; the rank logic lives in dflash.core.distributed."""

from __future__ import annotations

try:
    from hydra_plugins.hydra_submitit_launcher.submitit_launcher import LocalLauncher, SlurmLauncher
except ImportError:  # hydra-submitit-launcher not installed (the `slurm` extra): nothing to extend, no warning
    LocalLauncher = SlurmLauncher = None


class _RankAware:
    def __call__(self, sweep_overrides, job_dir_key, job_num, job_id, singleton_state):
        import submitit

        from dflash.core.distributed import rank_hydra_overrides  # torch: imported in the task, not at plugin discovery

        rank = submitit.JobEnvironment().global_rank
        return super().__call__(
            [*sweep_overrides, *rank_hydra_overrides(rank)], job_dir_key, job_num, job_id, singleton_state
        )


if LocalLauncher is not None:

    class LocalDDPLauncher(_RankAware, LocalLauncher):
        """submitit's local executor: tasks_per_node processes on this machine (the SLURM code path, testable)."""

    class SlurmDDPLauncher(_RankAware, SlurmLauncher):
        """submitit's SLURM executor: one task per GPU."""
