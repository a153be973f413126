"""Writing JSON files: atomically, and indented as ``json.dumps`` would, faster.

Files ending in ``.gz`` are gzip-compressed (compact JSON); others are
indented by one space. Saving writes to a temporary file and renames it, so an
interrupted save never leaves a truncated file behind.
"""

from __future__ import annotations

import gzip
import json
import math
import os
from collections.abc import Iterable
from itertools import chain, islice
from pathlib import Path
from typing import Any

from ntp_opt.model.safeio import atomic_open


def write_json(data: Any, path: Path, inputs: Iterable[str | os.PathLike[str]] = ()) -> None:
    """Write through :func:`ntp_opt.model.safeio.atomic_open` (temp file, fsync, rename).

    ``inputs`` are the files the command read: writing onto one is refused.
    """
    path = Path(path)
    text = json.dumps(data, allow_nan=False) if path.suffix == ".gz" else dumps_indented(data)
    with atomic_open(path, inputs) as fh:
        if path.suffix == ".gz":
            with gzip.GzipFile(fileobj=fh, mode="wb", mtime=0) as gz:
                gz.write(text.encode())
        else:
            fh.write(text.encode())
            fh.write(b"\n")


_ENCODE_STR = json.encoder.encode_basestring_ascii
_SCALARS = frozenset({str, int, float, bool, type(None)})


class _Unusual(Exception):
    """A value the fast encoder leaves to :func:`json.dumps` (which decides how to fail)."""


def _scalar(x: Any) -> str:
    t = type(x)
    if t is str:
        return _ENCODE_STR(x)
    if t is float:
        if not math.isfinite(x):
            raise _Unusual
        return float.__repr__(x)
    if t is int:
        return int.__repr__(x)
    if x is None:
        return "null"
    if t is bool:
        return "true" if x else "false"
    raise _Unusual


def dumps_indented(data: Any, indent: int = 1) -> str:
    """``json.dumps(data, indent=indent, allow_nan=False)``, byte for byte, faster.

    The standard library encodes with indentation in pure Python, one
    generator step per value; this joins lists and objects of plain values
    (the GPU lists of a plan, the records of an instance) at C speed. Values
    of other types (subclasses included) and non-string keys are left to
    :func:`json.dumps`, whose output or error is returned or raised.

    Parameters
    ----------
    data
        JSON-able value.
    indent
        Spaces per level.

    Returns
    -------
    str
    """
    try:
        parts: list[str] = []
        _encode(data, parts, 0, " " * indent)
        return "".join(parts)
    except (_Unusual, RecursionError):
        return json.dumps(data, indent=indent, allow_nan=False)


def _encode(x: Any, out: list[str], level: int, unit: str) -> None:
    t = type(x)
    if t is dict:
        if not x:
            out.append("{}")
            return
        pad = "\n" + unit * (level + 1)
        keys = list(x)
        if set(map(type, keys)) != {str}:
            raise _Unusual
        values = list(x.values())
        if set(map(type, values)) <= _SCALARS:
            out.append("{" + pad)
            out.append(
                ("," + pad).join(
                    [
                        f"{k}: {v}"
                        for k, v in zip(map(_ENCODE_STR, keys), map(_scalar, values), strict=True)
                    ]
                )
            )
        else:
            out.append("{")
            sep, comma = pad, "," + pad
            for k, v in zip(keys, values, strict=True):
                if type(v) in _SCALARS:  # inline: no call per scalar field
                    out.append(f"{sep}{_ENCODE_STR(k)}: {_scalar(v)}")
                else:
                    out.append(f"{sep}{_ENCODE_STR(k)}: ")
                    _encode(v, out, level + 1, unit)
                sep = comma
        out.append("\n" + unit * level + "}")
    elif t is list or t is tuple:
        if not x:
            out.append("[]")
            return
        pad = "\n" + unit * (level + 1)
        types = set(map(type, x))
        if types <= _SCALARS:
            encode = _ENCODE_STR if types == {str} else _scalar
            out.append("[" + pad + ("," + pad).join(map(encode, x)))
        elif types == {dict} and (rows := _records(x, level + 1, unit)) is not None:
            out.append("[" + pad + ("," + pad).join(rows))
        else:
            out.append("[")
            first = True
            for v in x:
                out.append(pad if first else "," + pad)
                first = False
                _encode(v, out, level + 1, unit)
        out.append("\n" + unit * level + "]")
    else:
        out.append(_scalar(x))


def _records(items: list[dict[str, Any]], level: int, unit: str) -> list[str] | None:
    """Objects with the same keys in the same order (records: a plan's stages, its
    replicas), each encoded at ``level``, column by column; ``None`` for others.

    A column of scalars, or of lists of scalars, is encoded at C speed
    (``map``, ``str.join``); each object is then one ``str.format`` of a
    template holding the keys.
    """
    keys = tuple(items[0])
    if not keys or set(map(type, keys)) != {str}:
        return None
    if not all(map(keys.__eq__, map(tuple, items))):
        return None
    pad = "\n" + unit * (level + 1)
    fields = [_ENCODE_STR(k).replace("{", "{{").replace("}", "}}") + ": {}" for k in keys]
    template = "{{" + pad + ("," + pad).join(fields) + "\n" + unit * level + "}}"
    columns = [_column_text([item[k] for item in items], level + 1, unit) for k in keys]
    return list(map(template.format, *columns))


def _column_text(values: list[Any], level: int, unit: str) -> list[str]:
    """Each of ``values`` encoded at ``level`` (as :func:`_encode` would)."""
    types = set(map(type, values))
    if types <= _SCALARS:
        return list(map(_ENCODE_STR if types == {str} else _scalar, values))
    if types <= {list, tuple}:
        inner = set(map(type, chain.from_iterable(values)))
        pad = "\n" + unit * (level + 1)
        sep, close = "," + pad, "\n" + unit * level + "]"
        if inner <= _SCALARS:
            encode = _ENCODE_STR if inner == {str} else _scalar
            return ["[" + pad + sep.join(map(encode, v)) + close if v else "[]" for v in values]
        # lists of records (every replica's stages): all the records encoded at once
        flat = list(chain.from_iterable(values)) if inner == {dict} else []
        rows = _records(flat, level + 1, unit) if flat else None
        if rows is not None:
            it = iter(rows)
            return ["[" + pad + sep.join(islice(it, len(v))) + close if v else "[]" for v in values]
    texts = []
    for v in values:
        parts: list[str] = []
        _encode(v, parts, level, unit)
        texts.append("".join(parts))
    return texts
