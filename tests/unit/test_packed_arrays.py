"""The segment arrays' packed COPY dumpers write exactly the bytes psycopg's own would (PostgreSQL's binary
array format), so the ledger's rows are the same whichever wrote them; what does not fit is refused, never
wrapped."""

from __future__ import annotations

import psycopg
import pytest
from psycopg import pq
from psycopg.adapt import AdaptersMap, Transformer

from loopline.store.packed import _Float4Array, _Float8Array, _Int2Array, _Int4Array


def _dump(oid: int, value, packed: type | None = None) -> bytes:
    adapters = AdaptersMap(psycopg.adapters)
    if packed is not None:
        adapters.register_dumper(None, packed)
    tx = Transformer(adapters)
    tx.set_dumper_types([oid], pq.Format.BINARY)  # as a binary COPY with set_types does
    return bytes(tx.dump_sequence([value], [pq.Format.BINARY])[0])


CASES = [
    (_Int4Array, [0, 1, 49_151, 151_642, 2**31 - 1, -(2**31)]),
    (_Int4Array, []),
    (_Int4Array, (7,)),
    (_Int2Array, [1, 0, 0, 1]),
    (_Float8Array, [-0.0, -1e-300, -3.25, -17.000000000000004, float("-inf")]),
    (_Float8Array, [-0.6931471805599453]),
    (_Float4Array, [-0.5, -0.1, -1e-30]),
]


@pytest.mark.parametrize("packed, value", CASES, ids=lambda x: getattr(x, "__name__", None))
def test_packed_bytes_are_psycopgs_own(packed, value):
    assert _dump(packed.oid, value, packed) == _dump(packed.oid, list(value))


def test_the_header_is_postgresqls_binary_array_format_by_hand():
    # 1 dimension, no nulls, element oid 23 (int4); size 2, lower bound 1; then (length 4, value) per element
    assert _dump(1007, [1, 258], _Int4Array) == bytes.fromhex("00000001 00000000 00000017 00000002 00000001 00000004 00000001 00000004 00000102")


@pytest.mark.parametrize("packed, value", [(_Int4Array, [1, 2**31]), (_Int4Array, [-(2**31) - 1]), (_Int2Array, [1, 40_000]), (_Int4Array, [1.5, 2.0])])
def test_a_value_that_does_not_fit_is_refused_not_wrapped(packed, value):
    with pytest.raises((ValueError, OverflowError)):
        _dump(packed.oid, value, packed)
