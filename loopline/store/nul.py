"""NUL characters, which PostgreSQL cannot store (not in text, not in jsonb), kept losslessly.

An agent's tools produce them (`cat` of a binary file; a tokenizer can emit U+0000), and a trajectory whose
commit failed on one was retried forever. In a JSON value a string holding NULs is stored as
`{"\u2400": [the pieces between the NULs]}` and restored on reading (an object whose only key is that
symbol is itself wrapped, `{"\u2400": {"v": its value}}`, so nothing an agent writes reads back as
another value); free text (an attempt's error, an object's key) shows each NUL as `\\x00`.

A lone surrogate (U+D800..U+DFFF, which a model writes through a JSON escape such as "\\ud800") has no
UTF-8 encoding at all: it is stored as U+FFFD, the replacement character (lossy: it was never text).
"""

from __future__ import annotations

import re
from typing import Any

NUL = "\x00"
_SURROGATE = re.compile("[\ud800-\udfff]")
TAG = "\u2400"  # SYMBOL FOR NULL: a one-key object with this key is an encoded string


def unicode(value: str) -> str:
    """`value` with each lone surrogate replaced by U+FFFD (what UTF-8 can encode)."""
    return _SURROGATE.sub("\ufffd", value)


def storable(value: Any) -> Any:
    """`value` (JSON: dicts, lists, strings, numbers) with every string that holds a NUL encoded."""
    if isinstance(value, str):
        value = unicode(value)
        return {TAG: value.split(NUL)} if NUL in value else value
    if isinstance(value, dict):
        if list(value) == [TAG]:
            return {TAG: {"v": storable(value[TAG])}}
        return {text(k) if isinstance(k, str) else k: storable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [storable(v) for v in value]
    return value


def restored(value: Any) -> Any:
    """The inverse of `storable`."""
    if isinstance(value, dict):
        if list(value) == [TAG]:
            inner = value[TAG]
            return NUL.join(inner) if isinstance(inner, list) else {TAG: restored(inner["v"])}
        return {k: restored(v) for k, v in value.items()}
    if isinstance(value, list):
        return [restored(v) for v in value]
    return value


def text(value: str | None) -> str | None:
    """Free text (an error message) PostgreSQL can store."""
    return unicode(value).replace(NUL, "\\x00") if value else value
