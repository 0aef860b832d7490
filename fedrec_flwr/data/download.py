"""Where dataset files come from: a folder the user names, or a verified download into the cache.

The licences of the real datasets forbid redistribution, so fedrec-flwr never ships them. Each one is read from

1. ``data_dir`` when given: the dataset folder itself (``.../ml-100k``) or its parent (``.../data`` holding
   ``ml-100k/``). A file there whose sha256 differs from the pinned one is accepted (users may hold other
   releases) with a logged warning; a missing file is a :class:`~fedrec_flwr.errors.DataError` naming the path.
2. otherwise ``cache_dir/raw/<name>/``, filled on first use by downloading from the official source
   (:data:`URLS`). Every file we read is checked against :data:`SHA256` before it is moved into place; a
   mismatch deletes the download and raises :class:`~fedrec_flwr.errors.DataError` naming URL, expected and got.

:data:`URLS` and :data:`SHA256` are plain module-level dicts, copied from each dataset's
:class:`~fedrec_flwr.data.datasets.DatasetSpec`, so tests (and mirrors) can override them.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
import urllib.error
import urllib.request
import zipfile
from dataclasses import dataclass
from pathlib import Path

from fedrec_flwr.data.datasets import DATASET_SPECS
from fedrec_flwr.errors import ConfigError, DataError
from fedrec_flwr.io import atomic_write_bytes

logger = logging.getLogger(__name__)

URLS: dict[str, str] = {name: spec.url for name, spec in DATASET_SPECS.items()}
"""Official download location of each dataset (:attr:`DatasetSpec.url <fedrec_flwr.data.datasets.DatasetSpec.url>`).
A ``.zip`` URL is an archive holding the files of :data:`SHA256` (found by base name anywhere in the archive); any
other URL is the single file itself."""

SHA256: dict[str, dict[str, str]] = {name: dict(spec.sha256) for name, spec in DATASET_SPECS.items()}
"""Pinned sha256 of every file each dataset's readers read
(:attr:`DatasetSpec.sha256 <fedrec_flwr.data.datasets.DatasetSpec.sha256>`), in read order."""

#: Seconds a download may stall before it fails (no hangs).
DOWNLOAD_TIMEOUT_S = 60.0
_CHUNK = 1 << 20


@dataclass(frozen=True)
class SourceFiles:
    """The located, hashed files of one dataset.

    ``paths`` maps file name to its path; ``sha256`` maps file name to the hex digest actually found;
    ``combined_sha256`` is the sha256 over ``"<name>\\0<digest>\\n"`` for the files in ``paths`` order.
    """

    name: str
    paths: dict[str, Path]
    sha256: dict[str, str]
    combined_sha256: str


def sha256_file(path: str | os.PathLike) -> str:
    """Hex sha256 of a file's bytes (read in 1 MiB chunks)."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(_CHUNK), b""):
            digest.update(chunk)
    return digest.hexdigest()


def combine_sha256(digests: dict[str, str]) -> str:
    """Order-stable sha256 over named digests (the order of ``digests`` is the order the files are read)."""
    combined = hashlib.sha256()
    for name, value in digests.items():
        combined.update(f"{name}\0{value}\n".encode())
    return combined.hexdigest()


def dataset_folder(name: str, data_dir: str | os.PathLike) -> Path:
    """The folder holding ``name``'s files: ``data_dir`` itself, or ``data_dir/<name>`` if that exists.

    Raises :class:`DataError` if ``data_dir`` does not exist.
    """
    base = Path(data_dir).expanduser()
    if not base.is_dir():
        raise DataError(f"data_dir {str(base)!r} for dataset {name!r} does not exist or is not a folder")
    first = next(iter(SHA256[name]))
    if not (base / first).exists() and (base / name).is_dir():
        return base / name
    return base


def locate_files(
    name: str,
    files: list[str],
    data_dir: str | os.PathLike | None,
    cache_dir: str | os.PathLike,
    *,
    download: bool = True,
) -> SourceFiles:
    """Find (and if needed download) ``files`` of dataset ``name`` and hash them.

    With ``data_dir`` the files must be there (see :func:`dataset_folder`); a sha256 differing from
    :data:`SHA256` is logged as a warning. Without it they are taken from ``cache_dir/raw/<name>/``,
    downloaded first when absent and ``download`` is true.

    Raises:
        DataError: a file is missing (message names the path), or a download fails or mismatches.
    """
    pins = SHA256[name]
    if data_dir is not None:
        folder = dataset_folder(name, data_dir)
        paths = {f: folder / f for f in files}
        for path in paths.values():
            if not path.is_file():
                raise DataError(f"dataset {name!r}: file {str(path)!r} not found (data_dir={str(data_dir)!r})")
        digests = {f: sha256_file(p) for f, p in paths.items()}
        for f, got in digests.items():
            if got != pins[f]:
                logger.warning(
                    "dataset %s: %s has sha256 %s, not the pinned %s (another release?); using it anyway",
                    name,
                    paths[f],
                    got,
                    pins[f],
                )
        return SourceFiles(name, paths, digests, combine_sha256(digests))

    folder = Path(cache_dir).expanduser() / "raw" / name
    paths = {f: folder / f for f in files}
    missing = [f for f, p in paths.items() if not p.is_file()]
    if missing:
        if not download:
            raise DataError(
                f"dataset {name!r}: {', '.join(str(paths[f]) for f in missing)} not found and download=False; "
                f"pass data_dir= pointing at a folder holding {', '.join(files)}"
            )
        download_dataset(name, cache_dir)
    digests = {}
    for f, p in paths.items():
        got = sha256_file(p)
        if got != pins[f]:
            raise DataError(
                f"dataset {name!r}: cached file {str(p)!r} has sha256 {got}, expected {pins[f]}; "
                "delete it to download it again"
            )
        digests[f] = got
    return SourceFiles(name, paths, digests, combine_sha256(digests))


def download_dataset(name: str, cache_dir: str | os.PathLike, *, url: str | None = None) -> dict[str, Path]:
    """Download dataset ``name`` into ``cache_dir/raw/<name>/`` and verify every pinned file.

    ``url`` defaults to ``URLS[name]``. The response is streamed to a temporary file inside the cache folder;
    each pinned file (the whole download, or the archive member with that base name) is checked against
    :data:`SHA256` before any is moved into place with an atomic rename. The temporary file is always deleted.

    Returns: file name -> final path.

    Raises:
        ConfigError: unknown dataset name.
        DataError: network/HTTP failure, a member missing from the archive, or a sha256 mismatch (message names
            URL, file, expected and got digests). Nothing is left in the cache in that case.
    """
    if name not in URLS or name not in SHA256:
        raise ConfigError(f"no download source for dataset {name!r}; known: {sorted(URLS)}")
    url = url or URLS[name]
    folder = Path(cache_dir).expanduser() / "raw" / name
    folder.mkdir(parents=True, exist_ok=True)
    pins = SHA256[name]
    fd, tmp_name = tempfile.mkstemp(prefix=".download.", suffix=".tmp", dir=folder)
    tmp = Path(tmp_name)
    try:
        logger.info("downloading %s from %s", name, url)
        try:
            with os.fdopen(fd, "wb") as out, urllib.request.urlopen(url, timeout=DOWNLOAD_TIMEOUT_S) as response:
                shutil.copyfileobj(response, out, _CHUNK)
        except (urllib.error.URLError, OSError, ValueError) as exc:
            raise DataError(f"dataset {name!r}: download from {url} failed: {exc}") from None
        contents = _extract(name, url, tmp, list(pins))
        for f, data in contents.items():
            got = hashlib.sha256(data).hexdigest()
            if got != pins[f]:
                raise DataError(
                    f"dataset {name!r}: checksum mismatch for {f} from {url}: expected sha256 {pins[f]}, got {got}"
                )
        return {f: atomic_write_bytes(folder / f, data) for f, data in contents.items()}
    finally:
        tmp.unlink(missing_ok=True)


def _extract(name: str, url: str, archive: Path, files: list[str]) -> dict[str, bytes]:
    """The bytes of each of ``files``: the download itself when it is not a zip, else the archive members."""
    if not url.lower().split("?")[0].endswith(".zip"):
        if len(files) != 1:
            raise DataError(f"dataset {name!r}: {url} is a single file but {len(files)} files are needed")
        return {files[0]: archive.read_bytes()}
    try:
        with zipfile.ZipFile(archive) as zf:
            by_base: dict[str, list[str]] = {}
            for member in zf.namelist():
                if not member.endswith("/") and "__MACOSX" not in member:
                    by_base.setdefault(member.rsplit("/", 1)[-1], []).append(member)
            out = {}
            for f in files:
                members = by_base.get(f, [])
                if len(members) != 1:
                    raise DataError(
                        f"dataset {name!r}: archive {url} holds {len(members)} members named {f!r} "
                        f"(expected exactly 1): {members}"
                    )
                out[f] = zf.read(members[0])
            return out
    except zipfile.BadZipFile as exc:
        raise DataError(f"dataset {name!r}: {url} is not a valid zip archive: {exc}") from None
