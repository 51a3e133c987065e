"""How a feature store holds features in each `features.dtype`: float32 and bfloat16 as they are, fp8 as float8
e4m3fn values with one float32 scale per token and per layer, dequantised on read to the training dtype.

Why a scale per token and per layer: a layer's hidden states vary in size from token to token by orders of
magnitude (attention sinks, massive activations), and deep layers are larger than shallow ones, so one scale per
tensor would push most tokens into e4m3's subnormals. With its own scale each token's largest value maps to 448
(e4m3fn's largest), every value keeps 3 mantissa bits: an error of at most 1/16 of itself (2**-4: half a unit in
the last place), or 2**-10 scale for values below 2**-6 scale (the subnormals' half step). A scale costs 4 bytes
per token per layer beside hidden_size bytes of values.
"""

from __future__ import annotations

import torch

STORE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "fp8": torch.float8_e4m3fn}
FP8_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448
SCALE = "_scale"  # the suffix of a quantised tensor's scales in a shard


def quantise(x: torch.Tensor, groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x (..., groups * H) -> (fp8 values of the same shape, float32 scales (..., groups)): each token's `groups`
    slices of H (its layers) scaled so that their largest magnitude is FP8_MAX."""
    parts = x.float().unflatten(-1, (groups, -1))
    amax = parts.abs().amax(dim=-1, keepdim=True)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))  # an all-zero token: any scale is exact
    values = (parts / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return values.flatten(-2), scale.squeeze(-1)


def dequantise(values: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The inverse of `quantise`, in `dtype`."""
    parts = values.float().unflatten(-1, (scale.shape[-1], -1)) * scale.unsqueeze(-1)
    return parts.flatten(-2).to(dtype)


def encode(name: str, x: torch.Tensor, dtype: str, groups: int) -> dict[str, torch.Tensor]:
    """The tensors a shard holds for feature `name` (its values, and for fp8 its scales)."""
    if dtype != "fp8":
        return {name: x.to(STORE_DTYPES[dtype])}
    values, scale = quantise(x, groups)
    return {name: values, name + SCALE: scale}


def decode(get, name: str, dtype: torch.dtype | None, keys) -> torch.Tensor:
    """Feature `name` read back through `get(key)`: fp8 dequantised to `dtype` (float32 when None), the other
    dtypes cast to `dtype` when one is given (float32 to float32 is bitwise the stored value)."""
    if name + SCALE in keys:
        return dequantise(get(name), get(name + SCALE), dtype or torch.float32)
    x = get(name)
    return x if dtype is None else x.to(dtype)


def bytes_per_value(dtype: str) -> int:
    return torch.tensor([], dtype=STORE_DTYPES[dtype]).element_size()


def scale_bytes(dtype: str) -> int:
    """Bytes of scale per token and per layer (4 for fp8's float32 scale, else none)."""
    return 4 if dtype == "fp8" else 0
