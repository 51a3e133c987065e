"""train.precision: the drafter's step in float32 (`fp32`) or under bfloat16 autocast (`bf16-mixed`).

bf16-mixed keeps what Lightning's `precision="bf16-mixed"` keeps: weights, gradients and the optimizer's state in
float32 (model.dtype), the forward and the loss under `torch.autocast(dtype=bfloat16)`, so matmuls run in bfloat16
and reductions (softmax, norms' statistics, the loss's log-sum-exp) in float32. The frozen LM head, which the
chunked loss multiplies twice per chunk, is held once as a bfloat16 copy: autocast would cast the frozen float32
matrix again on every call (its cast cache keeps only trainable weights).

Where bfloat16 is slow (a CPU without AVX512-BF16 or AMX, a GPU without bf16), the step falls back to fp32 with
one warning line: a mixed step there would be several times slower than float32, not faster.
"""

from __future__ import annotations

import contextlib
import logging

import torch

from dflash.core.machine import cpu_model, slow_cpu_dtype

log = logging.getLogger(__name__)


def resolve_precision(
    precision: str, device: torch.device, cpu_flags: set[str] | None = None
) -> tuple[torch.dtype | None, str | None]:
    """(the dtype the step autocasts to, None: float32 throughout; why bf16-mixed fell back to fp32, or None).
    `cpu_flags` is for tests."""
    if precision == "fp32":
        return None, None
    if precision != "bf16-mixed":
        raise ValueError(f"train.precision={precision!r} is invalid: must be fp32 or bf16-mixed")
    if device.type == "cpu" and slow_cpu_dtype("bfloat16", cpu_flags):
        return None, (
            f"this CPU ({cpu_model()}) has no fast bfloat16 kernels (neither avx512_bf16 nor amx_bf16), where a "
            "mixed step is slower than a float32 one"
        )
    if device.type == "cuda" and not torch.cuda.is_bf16_supported():
        return None, "this GPU has no bfloat16 support"
    return torch.bfloat16, None


def autocast_dtype(precision: str, device: torch.device, cpu_flags: set[str] | None = None) -> torch.dtype | None:
    """The dtype the step autocasts to (None: float32 throughout), with one warning line on a fallback."""
    dtype, fallback = resolve_precision(precision, device, cpu_flags)
    if fallback:
        log.warning("train.precision=%s falls back to fp32: %s", precision, fallback)
    return dtype


def precision_ran(dtype: torch.dtype | None) -> str:
    """The train.precision value that names what the step runs: `bf16-mixed` or `fp32`."""
    return "fp32" if dtype is None else "bf16-mixed"


def precision_record(precision: str, device: torch.device, cpu_flags: set[str] | None = None) -> dict:
    """What run.json records as `precision`: the one requested, the one that ran, and why they differ (or None)."""
    dtype, fallback = resolve_precision(precision, device, cpu_flags)
    return {"requested": precision, "ran": precision_ran(dtype), "fallback": fallback}


def autocast(device: torch.device, dtype: torch.dtype | None):
    """The step's autocast context: bfloat16 autocast, or nothing under fp32."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def head_for_loss(lm_head_weight: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """The frozen LM head as the loss multiplies it: a detached copy in the autocast dtype, or itself."""
    if dtype is None or lm_head_weight.dtype == dtype:
        return lm_head_weight
    return lm_head_weight.detach().to(dtype)
