"""The segment arrays in binary COPY, packed by numpy instead of element by element (and read back the same way).

psycopg dumps a list into PostgreSQL's binary array format one element at a time in Python (a length word and
a value each): for a 16-turn coding trajectory (~13,000 ids, masks and logprobs) that was a third of a
rollout worker's commit (`benchmarks/ledger_scale`, encoder `lists` vs `packed`). The format is simple: a header (dimensions,
null flag, element type), the dimension's size and lower bound, then a big-endian (length, value) pair per
element, so numpy writes it in one pass. The bytes are PostgreSQL's own format, identical to psycopg's (a test
compares them), so the server stores the same rows: nothing about the schema or the readers changes.
"""

from __future__ import annotations

import struct
from typing import Any, Sequence

import numpy as np
from psycopg import pq
from psycopg.adapt import Dumper, Loader

_HEAD = struct.Struct(">iiiii")  # dimensions, has-null flag, element oid, size, lower bound


class _PackedArray(Dumper):
    """A one-dimensional array without nulls of the element type `value`, from any sequence of numbers."""

    format = pq.Format.BINARY
    element_oid: int
    value: str  # numpy's big-endian type of one element

    def dump(self, obj: Sequence[Any]) -> bytes:
        n = len(obj)
        if n == 0:  # PostgreSQL's empty array has no dimension
            return struct.pack(">iii", 0, 0, self.element_oid)
        values = np.asarray(obj)
        element = np.dtype(self.value)
        if element.kind == "i" and (values.dtype.kind not in "iub" or values.min() < np.iinfo(element).min or values.max() > np.iinfo(element).max):
            raise ValueError(f"{self.__class__.__name__}: not all of these fit {element.name}: {values[:8]!r}...")
        pairs = np.empty(n, dtype=[("length", ">i4"), ("value", element)])
        pairs["length"] = element.itemsize
        pairs["value"] = values
        return _HEAD.pack(1, 0, self.element_oid, n, 1) + pairs.tobytes()


class _Int4Array(_PackedArray):
    oid, element_oid, value = 1007, 23, ">i4"


class _Int2Array(_PackedArray):
    oid, element_oid, value = 1005, 21, ">i2"


class _Float8Array(_PackedArray):
    oid, element_oid, value = 1022, 701, ">f8"


class _Float4Array(_PackedArray):
    oid, element_oid, value = 1021, 700, ">f4"


def use_packed_arrays(cursor) -> None:
    """This cursor's binary COPY dumps int4[], int2[], float4[] and float8[] columns packed (its own adapters
    only: the connection's other statements keep psycopg's dumpers)."""
    for dumper in (_Int4Array, _Int2Array, _Float4Array, _Float8Array):
        cursor.adapters.register_dumper(None, dumper)


class _NumpyArrayLoader(Loader):
    """The reverse, for readers of many ids (the learner): a one-dimensional array without nulls as a numpy
    array in one pass (psycopg's loader makes a Python int of every element: ~9x the memory, and the time)."""

    value: str

    def load(self, data) -> np.ndarray:
        dims, has_null, _ = struct.unpack_from(">iii", data)
        if dims == 0:
            return np.zeros(0, dtype=np.dtype(self.value).newbyteorder("="))
        if dims != 1 or has_null:
            raise ValueError(f"{self.__class__.__name__}: a {dims}-dimensional array{' with nulls' if has_null else ''}")
        (n,) = struct.unpack_from(">i", data, 12)
        pairs = np.frombuffer(data, dtype=[("length", ">i4"), ("value", self.value)], count=n, offset=20)
        return pairs["value"].astype(np.dtype(self.value).newbyteorder("="))


class _Int4Loader(_NumpyArrayLoader):
    format, value = pq.Format.BINARY, ">i4"


class _Int2Loader(_NumpyArrayLoader):
    format, value = pq.Format.BINARY, ">i2"


class _Float4Loader(_NumpyArrayLoader):
    format, value = pq.Format.BINARY, ">f4"


def read_numpy_arrays(cursor) -> None:
    """This cursor's binary results load int4[], int2[] and float4[] columns as numpy arrays."""
    for oid, loader in ((1007, _Int4Loader), (1005, _Int2Loader), (1021, _Float4Loader)):
        cursor.adapters.register_loader(oid, loader)
