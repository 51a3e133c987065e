"""The machine a run ran on, as run.json records it: a trained result is a figure of its machine (another CPU
kind rounds floats differently, and the embedded target's pretraining amplifies that)."""

from __future__ import annotations

import os
import platform
from pathlib import Path


def cpu_model() -> str:
    """The CPU's model name (another CPU kind rounds floats differently, which can move a trained result)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


# the CPU's vector extensions that change which kernels torch runs (and so float round-off): two machines with
# the same model name can differ here (a hypervisor may hide avx512 or amx)
_VECTOR_FLAGS = ("avx", "avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "avx_vnni", "amx_tile", "amx_bf16")


def cpu_features() -> dict:
    """The CPU's vector extensions (from /proc/cpuinfo) and the kernel set torch picked for it (`AVX2`,
    `AVX512`, ...): what tells apart machines whose trained results differ by round-off."""
    import torch

    flags: set[str] = set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    except OSError:
        pass
    return {
        "vector_extensions": [f for f in _VECTOR_FLAGS if f in flags],
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
    }


def device_info() -> dict:
    import torch

    info = {
        "cpu": cpu_model(),
        **cpu_features(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.cuda.is_available(),
    }
    if torch.cuda.is_available():
        info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return info
