"""`train.deterministic=true`: the same config and seed give the same bits on any machine of one kind, whatever
its core count. PyTorch's deterministic algorithms (an error where an op has none), cuDNN autotuning off, the
cuBLAS workspace fixed, and on CPU one intra-op thread per pipeline stage (a reduction split over N threads
adds in another order than over M). What it costs is measured in the README."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch

log = logging.getLogger(__name__)


def apply(enabled: bool) -> None:
    """Switch deterministic mode on or off for this process (the next job of a multirun may differ)."""
    torch.use_deterministic_algorithms(enabled)
    if enabled:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # cuBLAS needs it before its first use
        torch.backends.cudnn.benchmark = False
        log.info("train.deterministic: deterministic algorithms, one CPU thread per pipeline stage")


def cpu_threads_per_stage(enabled: bool) -> int | None:
    """The thread count deterministic mode fixes on CPU (None: no opinion)."""
    return 1 if enabled else None


@contextmanager
def cpu_threads(enabled: bool, device: torch.device) -> Iterator[None]:
    """Run a stage outside the pipeline (the feature store's build) with the thread count deterministic mode
    gives the pipeline's stages, so its features are the bits the run's own target stage computes."""
    threads = cpu_threads_per_stage(enabled) if device.type == "cpu" else None
    if threads is None:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)
