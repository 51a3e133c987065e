"""The world a job runs in: rank, local rank, world size, device, backend and device mesh, from torchrun's
environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT) or SLURM's through submitit.

`parallel=single` is one process without torch.distributed. `ddp` / `fsdp` join a process group (NCCL on
CUDA, gloo on CPU). Under torchrun the group is joined in launch.py, before Hydra runs (rank 0's start time names
the run directory), with the `parallel.backend` and `parallel.init_timeout_s` of the config the command line
composes (`launch_settings`); `init_world` applies the job's own `parallel.init_timeout_s` again, so until the
first step every collective waits that long, and after it at most `parallel.timeout_s`. Every decision that ends
or skips a step is agreed by all ranks (`World.agree`), so no rank waits forever in a collective; a rank that
fails publishes its error in the process group's store, so rank 0 can name it in status.json.
"""

from __future__ import annotations

import datetime as dt
import logging
import os
import re
import socket
import tempfile
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from dflash.core.config import ConfigError

log = logging.getLogger(__name__)

_FAILURE_KEY = "dflash/first_failure"  # + "/<job>": the jobs of a torchrun multirun share one store


class RankFailed(RuntimeError):
    """Another rank failed first; this rank's own error (a collective that lost its peer) followed from it.
    The message is the first failure as that rank published it (`rank 1: ...`)."""


def launched_distributed() -> bool:
    """True in a process started by torchrun (or with its variables set by submitit)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


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


@dataclass(frozen=True)
class Link:
    """The two process groups of one target -> drafter feature link (train/transport.py), one per direction
    (None: the default group, for a world of just these two processes under gloo, which needs no split)."""

    items: Any = None  # the target sends: headers, tensors, the end header
    credits: Any = None  # the drafter sends: credits, the stop credit


def link_pairs(drafters: int, target_ranks: int) -> list[tuple[int, int]]:
    """(target rank, drafter rank) of every link, in the one order every process creates them."""
    return [(drafters + d % target_ranks, d) for d in range(drafters)]


def open_links(drafters: int, target_ranks: int, rank: int, device: torch.device, timeout_s: float) -> dict:
    """parallel.target_ranks: collective over every process (dist.new_group is): the two groups of every link,
    and this process's links as {peer rank: Link}. Each link's groups then carry one message each (the target's,
    then the drafter's), so their communicators are set up before training: NCCL creates them lazily, and a
    lazily created one would block a side that posted a long-lived receive first."""
    timeout = dt.timedelta(seconds=timeout_s)
    links = {}
    for t, d in link_pairs(drafters, target_ranks):
        items, credits = dist.new_group([t, d], timeout=timeout), dist.new_group([t, d], timeout=timeout)
        if rank in (t, d):
            links[d if rank == t else t] = Link(items, credits)
    for peer, link in sorted(links.items()):  # in link order on both sides: no circular wait here either
        hello = torch.zeros(1, dtype=torch.int64, device=device)
        try:
            if rank >= drafters:  # this process is the target of the link
                dist.send(hello, peer, group=link.items)
                dist.recv(hello, peer, group=link.credits)
            else:
                dist.recv(hello, peer, group=link.items)
                dist.send(hello, peer, group=link.credits)
        except Exception as e:  # noqa: BLE001
            raise RuntimeError(f"opening the feature link between ranks {rank} and {peer}: {e}") from e
    return links


@dataclass(frozen=True)
class LaunchIdentity:
    """Who this process is, as its launcher set it, before any process group exists (joining may fail, and
    rank 0 must record that): the same code for torchrun and for submitit's tasks."""

    rank: int = 0
    size: int = 1
    role: str = "drafter"  # parallel.target_ranks=K: the last K processes are "target"

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def launch_identity(parallel_cfg=None) -> LaunchIdentity:
    """This process's rank, world size and role from torchrun's variables (a submitit task's SLURM variables
    are exported as torchrun's first)."""
    export_submitit_env()
    rank, size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    k = int(getattr(parallel_cfg, "target_ranks", 0) or 0)
    return LaunchIdentity(rank, size, "target" if k and rank >= size - k else "drafter")


def rank_hydra_overrides(rank: int) -> list[str]:
    """Hydra overrides of a process other than rank 0 (torchrun: added to argv; submitit: by our launchers):
    no .hydra/ of its own, and its warnings in `launch.rank<r>.log` instead of rank 0's launch.log."""
    if rank == 0:
        return []
    return [
        "hydra.output_subdir=null",
        f"hydra.job_logging.handlers.file.filename=${{hydra.runtime.output_dir}}/launch.rank{rank}.log",
        "hydra.job_logging.root.level=WARNING",
    ]


def resolve_device(name: str) -> torch.device:
    """`model.device` (auto | cpu | cuda | cuda:N) as a torch device; cuda without a CUDA device is a config error."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(
            f"model.device={name!r} is invalid: torch sees no CUDA device here "
            f"(torch {torch.__version__}, CUDA build: {torch.version.cuda is not None}); use auto or cpu"
        )
    return device


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
    init_timeout_s: float = 300.0  # parallel.init_timeout_s: how long main_first's other ranks wait for rank 0
    # target_ranks: this process's links, {peer rank: (items group, credits group)} (train/transport.py)
    links: dict[int, Link] = field(default_factory=dict)
    failure_key: str = _FAILURE_KEY  # rank 0's key of this job: a multirun's later job reads no earlier failure

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
            _set_timeout(seconds, self.group)

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
        try:
            failure = self.broadcast_to_all(None)
        except Exception as e:  # noqa: BLE001 - a timeout, or rank 0 gone: say which key decides how long
            raise RuntimeError(
                f"rank 0 did not finish its first build (e.g. rendering the data set into "
                f"the cache) within parallel.init_timeout_s={self.init_timeout_s:g} s, or it died; if it is still "
                f"working, raise parallel.init_timeout_s ({type(e).__name__}: {e})"
            ) from e
        if failure:
            raise RuntimeError(f"rank 0 failed first: {failure}")
        return build()

    # -- failures ------------------------------------------------------------------------------------------

    @property
    def several_processes(self) -> bool:
        """More than one process in the job (target ranks count: they fail too)."""
        return self.distributed and dist.is_initialized() and dist.get_world_size() > 1

    def report_failure(self, message: str) -> None:
        """Publish this rank's failure (the first one wins) before the process exits."""
        if not self.several_processes:
            return
        try:
            store = dist.distributed_c10d._get_default_store()
            store.compare_set(self.failure_key, "", f"rank {dist.get_rank()}: {message}")
        except Exception as e:  # noqa: BLE001 - the store may be gone already; the exit code still tells
            log.warning("could not publish the failure of rank %d: %s", self.rank, e)

    def first_failure(self) -> str | None:
        """The failure another rank published, if any (read without blocking)."""
        if not self.several_processes:
            return None
        try:
            store = dist.distributed_c10d._get_default_store()
            if store.check([self.failure_key]):
                value = store.get(self.failure_key).decode()
                return value or None
        except Exception:  # noqa: BLE001
            return None
        return None


def _set_timeout(seconds: float, group) -> None:
    """The timeout of the default group's (and `group`'s) collectives from now on."""
    from torch.distributed.distributed_c10d import _get_default_group, _set_pg_timeout

    _set_pg_timeout(dt.timedelta(seconds=seconds), _get_default_group())
    if group is not None:
        _set_pg_timeout(dt.timedelta(seconds=seconds), group)


def init_world(parallel_cfg, device_name: str = "auto") -> World:
    """The World of this process for `parallel.name`; joins (or reuses) the process group for ddp/fsdp."""
    if parallel_cfg.name == "single":
        if launched_distributed() and int(os.environ["WORLD_SIZE"]) > 1:
            raise ConfigError(
                f"parallel=single in a job of {os.environ['WORLD_SIZE']} processes (torchrun): add parallel=ddp or "
                "parallel=fsdp, or start one process"
            )
        # the job's device (model.device), so that run.json says where a single-process run trained
        return World(device=resolve_device(device_name))
    init_process_group(parallel_cfg.backend, parallel_cfg.init_timeout_s)
    joined = dist.get_backend()
    if parallel_cfg.backend != "auto" and parallel_cfg.backend != joined:
        raise ConfigError(
            f"parallel.backend={parallel_cfg.backend}, but this process joined its group with {joined} at launch "
            "(a multirun under torchrun shares one group: give parallel.backend once, not as a sweep)"
        )
    # joined at launch, maybe with another job's settings: until the first step, this job's init timeout holds
    _set_timeout(parallel_cfg.init_timeout_s, None)
    rank, size = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if device_name == "cpu" or not torch.cuda.is_available():
        device = torch.device("cpu")
    else:
        device = torch.device("cuda", local_rank)
    from torch.distributed.device_mesh import init_device_mesh

    # with the hosts, rank 0's key for this job's failure record: every job of a multirun starts with a clean one
    gathered: list = [None] * size
    dist.all_gather_object(gathered, (socket.gethostname(), f"{_FAILURE_KEY}/{uuid.uuid4().hex}"))
    hosts, failure_key = [h for h, _ in gathered], gathered[0][1]
    k = getattr(parallel_cfg, "target_ranks", 0) or 0
    if k:
        if size - k < 1:
            raise ConfigError(f"parallel.target_ranks={k} leaves no drafter rank in a job of {size} processes")
        drafters = size - k
        group = dist.new_group(list(range(drafters)))  # every process takes part in making it
        role = "target" if rank >= drafters else "drafter"
        link_timeout = max(parallel_cfg.timeout_s, parallel_cfg.init_timeout_s)  # the first item waits for the load
        links = open_links(drafters, k, rank, device if joined == "nccl" else torch.device("cpu"), link_timeout)
        return World(
            parallel_cfg.name, rank, local_rank, drafters, device, joined, hosts, None, role, k, group,
            parallel_cfg.init_timeout_s, links, failure_key,
        )  # fmt: skip
    mesh = init_device_mesh(device.type, (size,), mesh_dim_names=("dp",))
    return World(
        parallel_cfg.name, rank, local_rank, size, device, joined, hosts, mesh,
        init_timeout_s=parallel_cfg.init_timeout_s, failure_key=failure_key,
    )  # fmt: skip


def shutdown() -> None:
    """Leave the process group (at process exit: jobs of one multirun share it)."""
    if dist.is_initialized():
        dist.destroy_process_group()


def launch_settings(argv: list[str], config_dir: Path) -> tuple[str, float]:
    """`parallel.backend` and `parallel.init_timeout_s` of the job the command line describes, composed from
    the config files as Hydra will compose it (experiments included). A sweep's values are left out (one process
    group serves every job of a multirun; init_world applies each job's own timeout). A command line Hydra would
    refuse composes to the defaults here: Hydra reports it right after."""
    from hydra import compose, initialize_config_dir
    from hydra.core.override_parser.overrides_parser import OverridesParser

    defaults = ("auto", 300.0)
    try:
        overrides = OverridesParser.create().parse_overrides([a for a in argv[1:] if not a.startswith("-")])
        fixed = [o.input_line for o in overrides if not o.is_sweep_override() and not o.is_hydra_override()]
        with initialize_config_dir(config_dir=str(Path(config_dir).resolve()), version_base="1.3"):
            parallel = compose(config_name="config", overrides=fixed).parallel
    except Exception as e:  # noqa: BLE001
        log.debug("launch settings from the defaults (%s)", e)
        return defaults
    return str(parallel.get("backend", defaults[0])), float(parallel.get("init_timeout_s", defaults[1]))


def agree_on_launch(argv: list[str], config_dir: Path) -> list[str]:
    """Before Hydra starts: every rank of a torchrun job must write to rank 0's run directory, but Hydra's
    `${now:...}` differs per process. So under torchrun the run and sweep directories are passed explicitly,
    their `${now:FMT}` replaced by rank 0's start time (broadcast); ranks > 0 also write no .hydra/ of their own
    and log warnings to `launch.rank<r>.log` (`rank_hydra_overrides`). The process group is joined here, with
    the backend and init timeout the command line's config asks for (`launch_settings`). (Hydra's submitit
    launcher needs no directory agreement: its tasks share the launching process's resolved directories.)"""
    if not (launched_distributed() and int(os.environ["WORLD_SIZE"]) > 1):
        return argv
    import datetime

    from omegaconf import OmegaConf

    backend, timeout_s = launch_settings(argv, config_dir)
    init_process_group(backend, timeout_s)
    box = [datetime.datetime.now()]
    dist.broadcast_object_list(box, src=0)
    start = box[0]
    hydra_cfg = OmegaConf.to_container(OmegaConf.load(Path(config_dir) / "config.yaml"), resolve=False).get("hydra", {})
    argv = list(argv)
    for key in ("run", "sweep"):
        given = [a for a in argv if a.startswith(f"hydra.{key}.dir=")]
        pattern = given[-1].split("=", 1)[1] if given else hydra_cfg.get(key, {}).get("dir")
        if pattern:
            fixed = re.sub(r"\$\{now:([^}]*)\}", lambda m: start.strftime(m.group(1)), pattern)
            argv = [a for a in argv if not a.startswith(f"hydra.{key}.dir=")] + [f"hydra.{key}.dir={fixed}"]
    rank = dist.get_rank()
    if rank > 0:
        argv = [a for a in argv if not a.startswith("hydra.output_subdir=")] + rank_hydra_overrides(rank)
    return argv
