"""fedrec_flwr/arrays.py: the fast ``.npy`` encoder writes exactly the bytes of Flower's ``Array(ndarray)`` and the
decoder reads back what ``Array.numpy()`` does, for the dtypes and shapes the package sends and stores."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import Array

from fedrec_flwr.arrays import decode_array, decode_record, encode_array, encode_record

VALUES = [
    np.arange(12, dtype=np.float32).reshape(3, 4),
    np.array(2.0, dtype=np.float32),  # a 0-d array (FedRecGEL's Adam step count)
    np.arange(5, dtype=np.int64),
    np.zeros((0, 32), dtype=np.float32),
    np.linspace(-1, 1, 6, dtype=np.float64).reshape(2, 3).T,  # not C-ordered: written as a C-ordered copy
    np.array([True, False]),
    np.arange(6, dtype=np.float32).reshape(1, 6)[:, ::2],  # a strided view
    np.arange(4, dtype=">f4"),  # big-endian
]


@pytest.mark.parametrize("value", VALUES, ids=[f"{v.dtype}-{v.shape}-{i}" for i, v in enumerate(VALUES)])
def test_encode_array_is_flowers_array_byte_for_byte_and_decodes_back(value):
    ours, flowers = encode_array(value), Array(np.ascontiguousarray(value) if value.ndim else value)
    assert (ours.dtype, ours.shape, ours.stype, ours.data) == (
        flowers.dtype,
        flowers.shape,
        flowers.stype,
        flowers.data,
    )
    for decoded in (decode_array(ours), decode_array(flowers), decode_array(ours, copy=False)):
        assert decoded.dtype == value.dtype and decoded.shape == value.shape
        np.testing.assert_array_equal(decoded, ours.numpy())
    assert decode_array(ours).flags.writeable and not decode_array(ours, copy=False).flags.writeable


def test_decode_falls_back_for_other_payloads_and_records_round_trip():
    fortran = np.asfortranarray(np.arange(6, dtype=np.float32).reshape(2, 3))
    array = Array(fortran)  # np.save keeps the Fortran order in its header: decoded by np.load
    np.testing.assert_array_equal(decode_array(array), fortran)
    record = encode_record({"a": VALUES[0], "b": VALUES[2]})
    decoded = decode_record(record)
    assert sorted(decoded) == ["a", "b"]
    np.testing.assert_array_equal(decoded["a"], VALUES[0])
    np.testing.assert_array_equal(decoded["b"], VALUES[2])


def test_a_structured_array_round_trips_byte_for_byte():
    """Its fields go into the header; its dtype string is not one NumPy parses, so decoding uses Flower's reader."""
    value = np.array([(1, 0.5), (2, -1.0)], dtype=[("row", "<i4"), ("score", "<f8")])
    ours = encode_array(value)
    assert ours.data == Array(value).data
    np.testing.assert_array_equal(decode_array(ours), value)
