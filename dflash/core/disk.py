"""Running out of disk: the errors that mean it, a free-space check before the large writes (checkpoints, the
export) that stops with one line naming the path, the bytes needed and the bytes free, and the removal of
what a failed write leaves half-done."""

from __future__ import annotations

import errno
import logging
import shutil
from pathlib import Path

log = logging.getLogger(__name__)

# a write that failed for lack of room, quota, a read-only or a failing file system
DISK_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EIO}
MARGIN_BYTES = 4 << 20  # left free after a large write: status.json, metrics.jsonl and the logs still grow


class DiskFull(OSError):
    """Not enough free space for a large write, found before it started (errno ENOSPC)."""


def mib(n: float) -> str:
    return f"{n / 2**20:,.1f} MiB"


def free_bytes(path: Path) -> int:
    """Free bytes for an unprivileged writer on the file system of `path` (or of its nearest existing parent)."""
    path = Path(path)
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free


def check_free(path: Path, needed: int, what: str) -> None:
    """Raise DiskFull when `what` (about `needed` bytes) would not fit in `path`'s file system with a margin."""
    free = free_bytes(path)
    if needed + MARGIN_BYTES > free:
        raise DiskFull(
            errno.ENOSPC,
            f"not enough disk for {what} in {path}: needs about {mib(needed)} (+{mib(MARGIN_BYTES)} margin), "
            f"{mib(free)} free",
        )


def dir_bytes(path: Path) -> int:
    """Bytes of the files below `path` (0 when it does not exist)."""
    path = Path(path)
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.exists() else 0


def disk_error(error: BaseException | None) -> OSError | None:
    """The disk error behind `error` (itself, or what it was raised from or during), if there is one."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, OSError) and error.errno in DISK_ERRNOS:
            return error
        error = error.__cause__ or error.__context__
    return None


def remove_partial(path: Path, why: str = "") -> None:
    """Remove a half-written file or directory (`*.tmp`); never raises."""
    path = Path(path)
    try:
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()
        else:
            return
    except OSError as e:
        log.warning("could not remove the partial %s (%s)", path, e)
        return
    if why:
        log.warning("removed %s (%s)", path, why)
