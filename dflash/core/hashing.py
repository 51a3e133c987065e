"""The sha256 identities that runs, stores, checkpoints and benchmarks record: of a file's bytes, and of a set of
weights whatever file holds them."""

from __future__ import annotations

import hashlib
from pathlib import Path

PIECE = 1 << 20  # bytes read at a time: a multi-GB file is hashed in constant memory


def file_sha256(path: str | Path) -> str:
    """sha256 of the whole file."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for piece in iter(lambda: f.read(PIECE), b""):
            h.update(piece)
    return h.hexdigest()


def weights_sha256(weights) -> str:
    """sha256 over every tensor's name, dtype, shape and bytes, in name order: the same weights give the same hash
    from an export, a checkpoint or a model in memory."""
    import torch

    h = hashlib.sha256()
    for name, t in sorted(weights.items()):
        t = t.detach().to("cpu").contiguous()
        h.update(f"{name} {t.dtype} {tuple(t.shape)}\n".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()
