"""Files written whole or not at all: a tuned-config table, a baseline or a report is replaced by
renaming a finished temporary file beside it, so a reader (or a run stopped part-way) sees the
old file or the new one, never half of one."""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path


def _read_umask() -> int:
    mask = os.umask(0)  # reading the umask means setting it; put straight back, once, at import
    os.umask(mask)
    return mask


_UMASK = _read_umask()


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write_bytes(path, text.encode())


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write to a temporary file beside `path`, flushed to disk, then rename (os.replace is atomic
    within a file system). The file keeps its permissions, or takes those a new file gets under
    the umask (mkstemp's own are 0600: a baseline file under review would turn private)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, stat.S_IMODE(os.stat(path).st_mode) if path.exists() else 0o666 & ~_UMASK)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def unwritable_ancestor(path: Path) -> Path | None:
    """The nearest of `path` and its parents that exists, when it is not a writable folder (so
    nothing could be created at `path`); None when it is, or when none exists."""
    nearest = next((p for p in (path, *path.parents) if p.exists()), None)
    if nearest is not None and not (nearest.is_dir() and os.access(nearest, os.W_OK | os.X_OK)):
        return nearest
    return None
