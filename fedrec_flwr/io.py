"""Atomic file writes: a crash never leaves a half-written file.

Each function writes to a temporary file in the destination folder and then renames it over the target with
:func:`os.replace`, which is atomic on POSIX and Windows for files on the same file system. A writer killed between
the two leaves its temporary file, named after the target, its host and its pid (:data:`TEMPORARY`), which
:func:`remove_dead_temporaries` removes at the next start; a write that fails raises an ``OSError`` naming the
target.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import socket
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

_UMASK = os.umask(0)
os.umask(_UMASK)

_HOST = hashlib.sha256(socket.gethostname().encode()).hexdigest()[:6]
"""Six hex digits of this host's name, in every temporary file's name (a folder may be shared by several hosts)."""

TEMPORARY = re.compile(r"\.(?P<target>.+)\.(?P<host>[0-9a-f]{6})-(?P<pid>[0-9]+)\.[A-Za-z0-9_]+\.tmp")
"""The name of an :func:`atomic_write_bytes` temporary file (matched whole): ``.<target>.<host>-<pid>.<random>.tmp``,
written by process ``pid`` on the host whose name's sha256 starts with ``host``."""

OLD_TEMPORARY = re.compile(r"\.(?P<target>.+)\.[A-Za-z0-9_]{8}\.tmp")
"""The name of a temporary file written before the writer's host and pid were part of it."""

OLD_TEMPORARY_AGE_S = 3600.0
"""How old (seconds since its last change) a temporary file without its writer's pid must be to be removed: its writer
cannot be asked whether it is alive, and no atomic write takes that long."""


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    """Write ``data`` to ``path`` atomically, creating parent folders. Returns the path.

    The data go to ``.<name>.<host>-<pid>.<random>.tmp`` (:data:`TEMPORARY`) in the same folder, which is renamed
    over ``path``; a writer killed before the rename leaves that file, which :func:`remove_dead_temporaries` removes.

    Raises:
        OSError: the folder or the file cannot be written (a full disk, no permission, a name too long); the error
            names ``path`` (``[Errno 28] No space left on device: '<path>'``), whatever step failed.
    """
    path = Path(path)
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.{_HOST}-{os.getpid()}.", suffix=".tmp", dir=path.parent)
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(tmp, 0o666 & ~_UMASK)  # mkstemp makes 0600; give the file the mode open() would
        os.replace(tmp, path)
    except BaseException as err:
        if tmp is not None:
            try:
                os.unlink(tmp)
            except OSError:
                pass
        if isinstance(err, OSError) and err.filename != str(path):
            raise OSError(err.errno, err.strerror or str(err), str(path)) from err
        raise
    return path


def remove_dead_temporaries(
    folder: str | os.PathLike, targets: Iterable[str] | None = None, *, any_writer: bool = False
) -> list[Path]:
    """Remove the temporary files that writers killed mid-write (:func:`atomic_write_bytes`) left in ``folder``.

    Only files named as :data:`TEMPORARY` (or :data:`OLD_TEMPORARY`) are touched, nothing else in the folder, and of
    those only files whose writer is dead: a process of this host that no longer exists, or (``any_writer``: the
    caller knows that nobody else writes into the folder, e.g. a run holding its results folder's lock) any writer
    but this process. A temporary file without its writer's pid is removed when it is older than
    :data:`OLD_TEMPORARY_AGE_S` (or with ``any_writer``).

    Args:
        targets: only temporary files of these file names (e.g. ``user-3.npz``); ``None``: of any name.

    Returns:
        the files removed (those a concurrent cleaner removed first are not listed).
    """
    import time

    folder = Path(folder)
    wanted = None if targets is None else set(targets)
    removed = []
    try:
        names = os.listdir(folder)
    except OSError:  # no folder (yet): nothing to clean
        return removed
    now = time.time()
    for name in names:
        if not name.endswith(".tmp"):
            continue
        match = TEMPORARY.fullmatch(name)
        old = None if match else OLD_TEMPORARY.fullmatch(name)
        found = match or old
        if found is None or (wanted is not None and found["target"] not in wanted):
            continue
        path = folder / name
        if match:
            pid = int(match["pid"])
            if pid == os.getpid() and match["host"] == _HOST:
                continue  # this process's own write in progress (another thread)
            if not any_writer and (match["host"] != _HOST or _alive(pid)):
                continue
        elif not any_writer:
            try:
                if now - path.stat().st_mtime < OLD_TEMPORARY_AGE_S:
                    continue
            except OSError:
                continue
        try:
            path.unlink()
        except FileNotFoundError:
            continue
        removed.append(path)
    return removed


def _alive(pid: int) -> bool:
    """Whether process ``pid`` exists on this host (``os.kill(pid, 0)``; a process of another user counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    except OSError:
        return True
    return True


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
