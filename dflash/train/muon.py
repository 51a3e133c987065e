"""torch.optim.Muon with its Newton-Schulz orthogonalisation in a dtype this machine computes fast.

torch 2.13's Muon casts every update to bfloat16 for its five Newton-Schulz iterations. On a GPU, or a CPU with
AVX512-BF16 or AMX, that is the fast path; on a CPU without them a bfloat16 matmul is emulated (a 256x1024 @
1024x256 product took 148 ms against 2.0 ms in float32 on a 2-core AMD EPYC with AVX2), and one Muon step over the
default drafter's matrices took 6.1 s against AdamW's 9 ms. So `optim.muon_ns_dtype=auto` (the default) keeps
torch's own bfloat16 path where bfloat16 is fast, so results there do not move, and runs the same iteration
(coefficients, steps, eps, the momentum and learning-rate rules) in float32 elsewhere. run.json's `optimizer` records
the dtype and why.
"""

from __future__ import annotations

import math

import torch

from dflash.core.machine import cpu_model, slow_cpu_dtype

NS_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def choose_ns_dtype(requested: str, device: torch.device, cpu_flags: set[str] | None = None) -> tuple[str, str]:
    """(dtype name, reason) for Muon's Newton-Schulz iteration. `cpu_flags` is for tests."""
    if requested != "auto":
        if requested not in NS_DTYPES:
            raise ValueError(f"optim.muon_ns_dtype={requested!r} is invalid: must be auto, bfloat16 or float32")
        return requested, f"optim.muon_ns_dtype={requested}"
    if device.type == "cuda":
        if torch.cuda.is_bf16_supported():
            return "bfloat16", "auto: this GPU computes bfloat16 (torch's own Muon path)"
        return "float32", "auto: this GPU has no bfloat16 support"
    if device.type == "cpu" and slow_cpu_dtype("bfloat16", cpu_flags):
        return "float32", f"auto: this CPU ({cpu_model()}) has neither avx512_bf16 nor amx_bf16, bfloat16 is emulated"
    if device.type == "cpu":
        return "bfloat16", "auto: this CPU has fast bfloat16 kernels (torch's own Muon path)"
    return "bfloat16", f"auto: torch's own Muon path on {device.type}"


def newton_schulz(grad: torch.Tensor, coefficients, steps: int, eps: float, dtype: torch.dtype) -> torch.Tensor:
    """torch.optim.Muon's quintic Newton-Schulz iteration (the same operations in the same order), in `dtype`."""
    a, b, c = coefficients
    x = grad.to(dtype)
    tall = grad.size(0) > grad.size(1)
    if tall:
        x = x.T
    x = x / x.norm().clamp(min=eps)  # spectral norm at most 1
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


def adjusted_lr(lr: float, adjust_lr_fn: str | None, shape: torch.Size) -> float:
    """torch.optim.Muon's learning-rate rule for a matrix of `shape`."""
    rows, cols = shape[:2]
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        return lr * math.sqrt(max(1, rows / cols))
    if adjust_lr_fn == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(rows, cols))
    return lr


class Muon(torch.optim.Muon):
    """torch.optim.Muon whose orthogonalisation runs in `ns_dtype`: bfloat16 is torch's own step, unchanged;
    float32 is the same update computed here. Its state (`momentum_buffer`) and state_dict are torch's, so
    checkpoints move between machines of either kind."""

    def __init__(self, params, *, ns_dtype: str = "bfloat16", **kwargs):
        super().__init__(params, **kwargs)
        self.ns_dtype = ns_dtype

    @torch.no_grad()
    def step(self, closure=None):
        if self.ns_dtype == "bfloat16":
            return super().step(closure)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        dtype = NS_DTYPES[self.ns_dtype]
        for group in self.param_groups:
            params, grads, bufs = [], [], []
            self._init_group(group, params, grads, bufs)
            lr, momentum = group["lr"], group["momentum"]
            for param, grad, buf in zip(params, grads, bufs):
                buf.lerp_(grad, 1 - momentum)
                update = grad.lerp(buf, momentum) if group["nesterov"] else buf
                update = newton_schulz(update, group["ns_coefficients"], group["ns_steps"], group["eps"], dtype)
                param.mul_(1 - lr * group["weight_decay"])
                param.add_(update.to(param.dtype), alpha=-adjusted_lr(lr, group["adjust_lr_fn"], param.shape))
        return loss
