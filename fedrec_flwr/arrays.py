"""Fast conversion between ``numpy`` arrays and Flower's :class:`flwr.app.Array` (the ``.npy`` payload).

Flower's own ``Array(ndarray)`` writes the payload with ``np.save`` and ``Array.numpy()`` reads it with ``np.load``,
which parses the header with ``ast.literal_eval``: tens of microseconds per array (about 0.5 ms to read one, measured
on the 2-core machine), paid for every private record a node reads and writes (a user's embeddings, FedRecGEL's Adam
moments) and every shared array of a message. Here the header of a C-ordered array is built once per
``(dtype, shape)`` and the values are read with ``np.frombuffer`` using the ``dtype`` and ``shape`` the ``Array``
carries. The bytes are exactly those ``np.save`` writes (``tests/test_arrays.py``), so either side may be Flower's.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from io import BytesIO

import numpy as np
from flwr.app import Array, ArrayRecord

NUMPY_STYPE = "numpy.ndarray"
"""``Array.stype`` of a ``.npy`` payload (``flwr.common.constant.SType.NUMPY``)."""


@functools.lru_cache(maxsize=4096)
def _header_for(dtype: np.dtype, shape: tuple[int, ...]) -> bytes:
    """The ``.npy`` header ``np.save`` writes for a C-ordered array of ``dtype`` and ``shape`` (format 1.0); the most
    recent 4,096 kept (shapes vary with the number of rows a user touched)."""
    buffer = BytesIO()
    np.lib.format.write_array_header_1_0(
        buffer, {"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False, "shape": shape}
    )
    return buffer.getvalue()


def _header(array: np.ndarray) -> bytes:
    return _header_for(array.dtype, array.shape)


@functools.lru_cache(maxsize=256)
def _dtype_name(dtype: np.dtype) -> str:
    """``str(dtype)``, as ``Array.dtype`` records it (cached: numpy builds the string on every call)."""
    return str(dtype)


@functools.lru_cache(maxsize=256)
def _parsed_dtype(name: str) -> np.dtype | None:
    """``np.dtype(name)``, or ``None`` for a name NumPy does not parse (a structured dtype's ``str()``)."""
    try:
        return np.dtype(name)
    except TypeError:
        return None


def encode_array(value: np.ndarray) -> Array:
    """``Array(value)`` (Flower's ``.npy`` payload, byte for byte), without ``np.save``.

    Falls back to ``Array(value)`` for object arrays and for shapes whose header does not fit the 1.0 format.
    """
    value = np.asarray(value)
    if value.dtype.hasobject:
        return Array(value)
    if not value.flags.c_contiguous:
        value = value.copy(order="C")
    try:
        header = _header(value)
    except ValueError:  # header too long for format 1.0: np.save writes 2.0
        return Array(value)
    # one copy of the values (``header + value.tobytes()`` made two); a C-contiguous array's buffer is its C order
    return Array(
        dtype=_dtype_name(value.dtype),
        shape=tuple(int(n) for n in value.shape),
        stype=NUMPY_STYPE,
        data=b"".join((header, value.reshape(-1).view(np.uint8))),
    )


def decode_array(array: Array, copy: bool = True) -> np.ndarray:
    """``array.numpy()``, faster: a C-ordered ``.npy`` payload is read with ``np.frombuffer`` using the ``dtype`` and
    ``shape`` the ``Array`` carries, instead of parsing its header. Anything else falls back to ``array.numpy()``.

    Args:
        copy: return a writable copy, as ``array.numpy()`` does (default); ``False`` returns a read-only view of the
            payload (for callers that only read it, e.g. to stack many users' records).
    """
    if array.stype == NUMPY_STYPE:
        dtype = _parsed_dtype(array.dtype)
        if dtype is None:  # a structured dtype's str() is not a dtype string: Flower's own reader parses the header
            return array.numpy()
        data = array.data
        offset = len(data) - math.prod(array.shape) * dtype.itemsize  # the header's length
        if (
            not dtype.hasobject
            and offset > 0
            and data.startswith(b"\x93NUMPY")
            and data.find(b"'fortran_order': False", 0, offset) >= 0
        ):
            value = np.frombuffer(data, dtype=dtype, offset=offset).reshape(array.shape)
            return value.copy() if copy else value
    return array.numpy()


def encode_record(arrays: Mapping[str, np.ndarray]) -> ArrayRecord:
    """An :class:`~flwr.app.ArrayRecord` of ``arrays`` (:func:`encode_array` each)."""
    return ArrayRecord({key: encode_array(value) for key, value in arrays.items()})


def decode_record(record: ArrayRecord, copy: bool = True) -> dict[str, np.ndarray]:
    """The arrays of ``record`` by key (:func:`decode_array` each)."""
    return {key: decode_array(array, copy) for key, array in record.items()}
