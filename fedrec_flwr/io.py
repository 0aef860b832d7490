"""Atomic file writes: a crash never leaves a half-written file.

Each function writes to a temporary file in the destination folder and then renames it over the target with
:func:`os.replace`, which is atomic on POSIX and Windows for files on the same file system.
"""

from __future__ import annotations

import io
import json
import os
import tempfile
from pathlib import Path
from typing import Any

import numpy as np


_UMASK = os.umask(0)
os.umask(_UMASK)


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    """Write ``data`` to ``path`` atomically, creating parent folders. Returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(tmp, 0o666 & ~_UMASK)  # mkstemp makes 0600; give the file the mode open() would
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    return path


def atomic_write_text(path: str | os.PathLike, text: str, encoding: str = "utf-8") -> Path:
    """Write ``text`` to ``path`` atomically."""
    return atomic_write_bytes(path, text.encode(encoding))


def atomic_write_json(path: str | os.PathLike, obj: Any) -> Path:
    """Write ``obj`` as indented, key-sorted JSON atomically."""
    return atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True, default=_json_default) + "\n")


def atomic_save_npz(path: str | os.PathLike, **arrays: np.ndarray) -> Path:
    """Save arrays to an uncompressed ``.npz`` file atomically (load it with ``allow_pickle=False``)."""
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    return atomic_write_bytes(path, buffer.getvalue())


NPZ_MAGIC = b"PK\x03\x04"
"""First bytes of every ``.npz`` file (a zip archive's local file header)."""


def load_npz(path: str | os.PathLike):
    """Open an ``.npz`` file with ``allow_pickle=False`` (use it as a context manager, like :func:`numpy.load`).

    Raises:
        ValueError: the file is not an ``.npz`` (zip) archive; the message says what it starts with, instead of
            NumPy's "pickled data" message for any file that is neither a zip nor a ``.npy``.
        OSError: the file cannot be opened.
    """
    with open(path, "rb") as handle:
        head = handle.read(len(NPZ_MAGIC))
    if head != NPZ_MAGIC:
        what = "an empty file" if not head else f"a file starting with {head!r}"
        raise ValueError(f"not an .npz archive: {what} (an .npz is a zip file starting with {NPZ_MAGIC!r})")
    return np.load(path, allow_pickle=False)


def _json_default(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")
