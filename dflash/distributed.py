"""The world a job runs in: rank, local rank, world size, device, backend and device mesh, from torchrun's
environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT) or SLURM's through submitit.

`parallel=single` is one process without torch.distributed. `ddp` / `fsdp` join a process group (NCCL on
CUDA, gloo on CPU) with `parallel.init_timeout_s`; after the first step collectives wait at most
`parallel.timeout_s`. Every decision that ends or skips a step is agreed by all ranks (`World.agree`), so no
rank waits forever in a collective; a rank that fails publishes its error in the process group's store, so
rank 0 can name it in status.json.
"""

from __future__ import annotations

import datetime as dt
import logging
import os
import re
import socket
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from dflash.config import ConfigError

log = logging.getLogger(__name__)

_FAILURE_KEY = "dflash/first_failure"


def launched_distributed() -> bool:
    """True in a process started by torchrun (or with its variables set by submitit)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def launch_rank() -> int:
    """This process's rank as its launcher set it (0 without one), before any process group exists."""
    return int(os.environ.get("RANK", 0))


def export_submitit_env() -> bool:
    """Inside a SLURM task started by submitit, set torchrun's variables from SLURM's (one task per GPU)."""
    if launched_distributed() or "SUBMITIT_EXECUTOR" not in os.environ:
        return False
    try:
        from submitit.helpers import TorchDistributedEnvironment
    except ImportError:
        return False
    TorchDistributedEnvironment().export(set_cuda_visible_devices=False)
    return True


def default_backend(device_type: str) -> str:
    return "nccl" if device_type == "cuda" else "gloo"


def init_process_group(backend: str = "auto", timeout_s: float = 300.0) -> None:
    """Join the process group of this torchrun/submitit job (once per process; jobs of a multirun reuse it).
    The CUDA device is chosen from LOCAL_RANK before the group exists, as NCCL wants."""
    if dist.is_initialized():
        return
    export_submitit_env()
    if not launched_distributed():
        # ddp/fsdp without a launcher: a world of one, so the same code path (and checkpoint format) runs
        store = tempfile.mkdtemp(prefix="dflash-pg-")
        os.environ.update({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"})
        init_method = f"file://{store}/store"
    else:
        init_method = "env://"
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    if backend == "auto":
        backend = default_backend("cuda" if cuda else "cpu")
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3")  # a dead peer ends NCCL waits, not hangs them
    dist.init_process_group(
        backend=backend,
        init_method=init_method,
        timeout=dt.timedelta(seconds=timeout_s),
        rank=int(os.environ["RANK"]),
        world_size=int(os.environ["WORLD_SIZE"]),
    )
    log.info("joined the process group: rank %d of %d (%s)", dist.get_rank(), dist.get_world_size(), backend)


@dataclass
class World:
    """This process's place in the job. `mode` is the `parallel` group's name."""

    mode: str = "single"
    rank: int = 0
    local_rank: int = 0
    size: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    backend: str | None = None
    hosts: list[str] = field(default_factory=lambda: [socket.gethostname()])
    mesh: object = None  # torch DeviceMesh over all ranks (ddp/fsdp)
    # parallel.target_ranks=K: the last K processes only run the target ("target" role); `size` and `group`
    # are the drafter ranks' (0..size-1, the same global ranks), so rank 0 still writes the run
    role: str = "drafter"
    target_ranks: int = 0
    group: object = None  # the drafter ranks' process group (None: all processes)

    @property
    def distributed(self) -> bool:
        return self.mode != "single"

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def is_target(self) -> bool:
        return self.role == "target"

    def target_rank_of(self, drafter_rank: int) -> int:
        """The global rank of the target process that feeds `drafter_rank` (target_ranks > 0)."""
        return self.size + drafter_rank % self.target_ranks

    def drafters_of(self, target_rank: int) -> list[int]:
        """The drafter ranks a target process feeds."""
        return [d for d in range(self.size) if self.target_rank_of(d) == target_rank]

    def describe(self) -> dict:
        """What run.json records about the world."""
        return {
            "mode": self.mode,
            "size": self.size,
            "backend": self.backend,
            "device": str(self.device),
            "nodes": len(set(self.hosts)),
            "hosts": sorted(set(self.hosts)),
            "target_ranks": self.target_ranks,
        }

    # -- collectives every rank reaches in the same order ------------------------------------------------

    def all_reduce(self, values: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """Sum (or max) of a small tensor over all ranks; returns it on the caller's device."""
        if not self.distributed or self.size == 1:
            return values
        out = values.detach().to(self.device, torch.float64 if self.device.type == "cpu" else torch.float32)
        dist.all_reduce(out, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX, group=self.group)
        return out.to(values.device, values.dtype)

    def agree(self, flag: bool) -> bool:
        """True on every rank when it is True on any rank (stop requests)."""
        return bool(self.all_reduce(torch.tensor([float(flag)]), "max").item() > 0)

    def broadcast_object(self, obj):
        if not self.distributed or self.size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def broadcast_to_all(self, obj):
        """From rank 0 to every process, target ranks included."""
        if not self.distributed or dist.get_world_size() == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def barrier(self) -> None:
        if self.distributed and self.size > 1:
            dist.barrier(group=self.group)

    def barrier_all(self) -> None:
        """Every process, target ranks included (no side leaves while the other still uses a link)."""
        if self.distributed and dist.get_world_size() > 1:
            dist.barrier()

    def set_timeout(self, seconds: float) -> None:
        """The collective timeout from now on (torchtitan shortens it after the first step; ours allows for
        rank 0's evals)."""
        if self.distributed and self.size > 1:
            from torch.distributed.distributed_c10d import _get_default_group, _set_pg_timeout

            _set_pg_timeout(dt.timedelta(seconds=seconds), _get_default_group())
            if self.group is not None:
                _set_pg_timeout(dt.timedelta(seconds=seconds), self.group)

    def main_first(self, build):
        """`build()` on rank 0 first (e.g. the one writer of a cache), then on every other process (target ranks
        too); a failure on rank 0 is raised everywhere instead of leaving the others waiting (they wait up to
        the current collective timeout)."""
        if not self.distributed or dist.get_world_size() == 1:
            return build()
        if self.is_main:
            try:
                result = build()
            except Exception as e:
                self.broadcast_to_all(f"{type(e).__name__}: {e}")
                raise
            self.broadcast_to_all(None)
            return result
        failure = self.broadcast_to_all(None)
        if failure:
            raise RuntimeError(f"rank 0 failed first: {failure}")
        return build()

    # -- failures ------------------------------------------------------------------------------------------

    def report_failure(self, message: str) -> None:
        """Publish this rank's failure (the first one wins) before the process exits."""
        if not (self.distributed and self.size > 1 and dist.is_initialized()):
            return
        try:
            store = dist.distributed_c10d._get_default_store()
            store.compare_set(_FAILURE_KEY, "", f"rank {self.rank}: {message}")
        except Exception as e:  # noqa: BLE001 - the store may be gone already; the exit code still tells
            log.warning("could not publish the failure of rank %d: %s", self.rank, e)

    def first_failure(self) -> str | None:
        """The failure another rank published, if any (read without blocking)."""
        if not (self.distributed and self.size > 1 and dist.is_initialized()):
            return None
        try:
            store = dist.distributed_c10d._get_default_store()
            if store.check([_FAILURE_KEY]):
                value = store.get(_FAILURE_KEY).decode()
                return value or None
        except Exception:  # noqa: BLE001
            return None
        return None


def init_world(parallel_cfg, device_name: str = "auto") -> World:
    """The World of this process for `parallel.name`; joins (or reuses) the process group for ddp/fsdp."""
    if parallel_cfg.name == "single":
        if launched_distributed() and int(os.environ["WORLD_SIZE"]) > 1:
            raise ConfigError(
                f"parallel=single in a job of {os.environ['WORLD_SIZE']} processes (torchrun): add parallel=ddp or "
                "parallel=fsdp, or start one process"
            )
        return World()
    init_process_group(parallel_cfg.backend, parallel_cfg.init_timeout_s)
    rank, size = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if device_name == "cpu" or not torch.cuda.is_available():
        device = torch.device("cpu")
    else:
        device = torch.device("cuda", local_rank)
    from torch.distributed.device_mesh import init_device_mesh

    hosts: list = [None] * size
    dist.all_gather_object(hosts, socket.gethostname())
    k = getattr(parallel_cfg, "target_ranks", 0) or 0
    if k:
        if size - k < 1:
            raise ConfigError(f"parallel.target_ranks={k} leaves no drafter rank in a job of {size} processes")
        drafters = size - k
        group = dist.new_group(list(range(drafters)))  # every process takes part in making it
        role = "target" if rank >= drafters else "drafter"
        return World(
            parallel_cfg.name, rank, local_rank, drafters, device, dist.get_backend(), hosts, None, role, k, group
        )
    mesh = init_device_mesh(device.type, (size,), mesh_dim_names=("dp",))
    return World(parallel_cfg.name, rank, local_rank, size, device, dist.get_backend(), hosts, mesh)


def shutdown() -> None:
    """Leave the process group (at process exit: jobs of one multirun share it)."""
    if dist.is_initialized():
        dist.destroy_process_group()


def agree_on_launch(argv: list[str], config_file: Path) -> list[str]:
    """Before Hydra starts: every rank of a torchrun job must write to rank 0's run directory, but Hydra's
    `${now:...}` differs per process. So under torchrun the run and sweep directories are passed explicitly,
    their `${now:FMT}` replaced by rank 0's start time (broadcast); ranks > 0 also write no .hydra/ of their own
    and log warnings to `launch.rank<r>.log`. (Hydra's submitit launcher needs none of this: its tasks share
    the launching process's resolved directories.)"""
    if not (launched_distributed() and int(os.environ["WORLD_SIZE"]) > 1):
        return argv
    import datetime

    from omegaconf import OmegaConf

    timeout_s = float(os.environ.get("DFLASH_INIT_TIMEOUT_S", 300))
    init_process_group(os.environ.get("DFLASH_BACKEND", "auto"), timeout_s)
    box = [datetime.datetime.now()]
    dist.broadcast_object_list(box, src=0)
    start = box[0]
    hydra_cfg = OmegaConf.to_container(OmegaConf.load(config_file), resolve=False).get("hydra", {})
    argv = list(argv)
    for key in ("run", "sweep"):
        given = [a for a in argv if a.startswith(f"hydra.{key}.dir=")]
        pattern = given[-1].split("=", 1)[1] if given else hydra_cfg.get(key, {}).get("dir")
        if pattern:
            fixed = re.sub(r"\$\{now:([^}]*)\}", lambda m: start.strftime(m.group(1)), pattern)
            argv = [a for a in argv if not a.startswith(f"hydra.{key}.dir=")] + [f"hydra.{key}.dir={fixed}"]
    rank = dist.get_rank()
    if rank > 0:
        argv = [a for a in argv if not a.startswith("hydra.output_subdir=")]
        argv += [
            "hydra.output_subdir=null",
            f"hydra.job_logging.handlers.file.filename=${{hydra.runtime.output_dir}}/launch.rank{rank}.log",
            "hydra.job_logging.root.level=WARNING",
        ]
    return argv
