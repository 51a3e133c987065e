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


def _cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


# the instructions that give a CPU fast 16-bit float matmuls: on an AMD EPYC with avx512_bf16 a 256x4096 @
# 4096x12288 matmul ran at 189 GFLOP/s in bf16 against 58 in float32; on a CPU without them the first step of a
# Qwen3-8B-shaped bf16 run had not finished after 12 minutes (issue #27)
_FAST_CPU_DTYPES = {"bfloat16": ("avx512_bf16", "amx_bf16"), "float16": ("avx512_fp16", "amx_fp16")}


def slow_cpu_dtype(dtype: str, flags: set[str] | None = None) -> str | None:
    """Why `dtype` has no fast kernels on this CPU (None: it has, or it is float32). `flags` is for tests."""
    needed = _FAST_CPU_DTYPES.get(dtype)
    if needed is None:
        return None
    flags = _cpu_flags() if flags is None else flags
    if any(f in flags for f in needed):
        return None
    return (
        f"model.dtype={dtype} on a CPU without {' or '.join(needed)} ({cpu_model()}): torch has no fast {dtype} "
        "kernels here, so a step can be many times slower than in float32; model.dtype=float32 is faster on this CPU"
    )


def cpu_features() -> dict:
    """The CPU's vector extensions (from /proc/cpuinfo) and the kernel set torch picked for it (`AVX2`,
    `AVX512`, ...): what tells apart machines whose trained results differ by round-off."""
    import torch

    flags = _cpu_flags()
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


def peak_rss_mb() -> float:
    """This process's peak resident memory so far (MiB).

    On Linux it reads VmHWM, the high-water mark of the process's own address space. getrusage's ru_maxrss is
    not that: exec keeps the larger of the old and new images' peaks, so a process started by a big parent
    (pytest, a notebook, submitit) reports the parent's peak (seen: 851 MiB for a run whose own peak was 700)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024  # kB
    except OSError:
        pass
    import resource
    import sys

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 2**10  # bytes on macOS, KiB elsewhere
