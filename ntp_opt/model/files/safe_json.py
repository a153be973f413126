"""Reading untrusted JSON: size, value-count, string, depth and duplicate-key caps.

Every JSON input (instances, plans, workloads, multi-plans, event files) is
read by :func:`read_json` / :func:`parse_json` under the rules listed there
(``docs/safety.md``); the caps are those of :mod:`ntp_opt.model.files.caps`,
read at each call. A breach, like any bad input, is an :class:`InputError`
whose message names the source (the file) and the field.
"""

from __future__ import annotations

import gzip
import json
import math
import zlib
from itertools import chain
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import ValidationError

from ntp_opt.model.files import caps

_CHUNK = 1 << 22


class InputError(ValueError):
    """Bad input file or data; the message names the source and the field."""

    def __init__(self, source: str, problems: list[tuple[str, str]]):
        self.source = source
        self.problems = problems
        lines = [
            f"{source}: {field}: {msg}" if field else f"{source}: {msg}" for field, msg in problems
        ]
        if len(lines) > 10:
            lines = [*lines[:10], f"{source}: ... and {len(lines) - 10} more problems"]
        super().__init__("\n".join(lines))


def field_path(loc: tuple[int | str, ...]) -> str:
    """A field path as error messages write it: ``cluster.nodes[5].tdp_w``.

    Integers are list indices; the kind tag pydantic inserts after the index of
    a node (``nodes[5].gpu.tdp_w``) is left out.
    """
    parts: list[str] = []
    for p in loc:
        if isinstance(p, int):
            parts.append(f"[{p}]")
        elif (
            p in {"gpu", "tray", "domain", "rack", "switch"} and parts and parts[-1].startswith("[")
        ):
            continue  # discriminator tag inserted by pydantic
        else:
            parts.append(("." if parts else "") + str(p))
    return "".join(parts)


def validation_problems(err: ValidationError) -> list[tuple[str, str]]:
    """The ``(field path, message)`` pairs of a pydantic error, for :class:`InputError`."""
    return [
        (field_path(tuple(e["loc"])), e["msg"].removeprefix("Value error, "))
        for e in err.errors(include_url=False)
    ]


def _limits() -> tuple[int, int, int]:
    """(bytes, tokens, string bytes) a file may have, from the module's caps.

    Read at each call, so that tests and the service can lower
    :data:`ntp_opt.model.files.caps.MAX_NODES` and the others.
    """
    return (
        caps.MAX_FILE_BYTES,
        caps.TOKENS_PER_NODE * caps.MAX_NODES + caps.TOKENS_EXTRA,
        caps.MAX_STRING_BYTES,
    )


class _Scan:
    """Counts, chunk by chunk of the decompressed bytes, what bounds parsing memory.

    ``,``, ``{`` and ``[`` bound the number of JSON values (strings containing
    them only over-count), and the longest run of bytes between two ``"``
    bounds every string's length (escapes only make the raw run longer than
    the decoded string). No escape or encoding can hide from either count:
    the bytes are the raw UTF-8 that will be parsed (anything else is refused).
    """

    def __init__(self, source: str):
        self.source = source
        self.max_bytes, self.max_tokens, self.max_string = _limits()
        self.total = self.tokens = self.kinds = 0
        self.run = 0  # bytes since the last quote
        self.tail = b""

    def feed(self, chunk: bytes) -> None:
        self.total += len(chunk)
        if self.total > self.max_bytes:
            raise InputError(
                self.source, [("", f"uncompressed data exceeds {self.max_bytes} bytes")]
            )
        # "kind" keys written plainly: a fast early refusal of plain node bombs (an
        # escaped key such as "\\u006bind" is caught by the value count below).
        window = self.tail + chunk
        self.kinds += window.count(b'"kind"') - self.tail.count(b'"kind"')
        self.tail = window[-5:]
        if self.kinds > caps.MAX_NODES:
            raise InputError(
                self.source,
                [("cluster.nodes", f"declares more than {caps.MAX_NODES} nodes (kind fields)")],
            )
        self.tokens += chunk.count(b",") + chunk.count(b"{") + chunk.count(b"[")
        if self.tokens > self.max_tokens:
            raise InputError(
                self.source,
                [
                    (
                        "",
                        f"more than {self.max_tokens} JSON values: more than "
                        f"{caps.MAX_NODES} nodes' worth of data",
                    )
                ],
            )
        first = chunk.find(b'"')
        if first >= 0 and self._short_runs(chunk, first):
            longest = self.run + first  # <= the cap if only the carried run is long
            self.run = len(chunk) - chunk.rfind(b'"') - 1
            if longest > self.max_string:
                raise self._too_long()
            return
        quotes = np.flatnonzero(np.frombuffer(chunk, dtype=np.uint8) == 0x22)
        if quotes.size == 0:
            longest = self.run + len(chunk)
            self.run = longest
        else:
            inner = int(np.diff(quotes).max()) - 1 if quotes.size > 1 else 0
            longest = max(self.run + int(quotes[0]), inner)
            self.run = len(chunk) - int(quotes[-1]) - 1
        if longest > self.max_string:
            raise self._too_long()

    def _too_long(self) -> InputError:
        """The error for a string (or run of values) longer than the cap."""
        message = (
            f"more than {self.max_string} bytes without a quote (a string, "
            "or a run of values, longer than the cap)"
        )
        return InputError(self.source, [("", message)])

    def _short_runs(self, chunk: bytes, first: int) -> bool:
        """Whether no run between two quotes of ``chunk`` is longer than the cap, proven
        without listing the quotes: each window of ``cap // 2`` bytes from the first
        quote on holds a quote (a run of ``cap`` bytes would hold a whole window)."""
        width = self.max_string // 2
        if width < 1:
            return False
        last = chunk.rfind(b'"')
        return all(chunk.find(b'"', at, at + width) >= 0 for at in range(first, last, width))


class DuplicateKeyError(ValueError):
    """A JSON object names a key twice (its first argument is the key)."""


def unique_object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``object_pairs_hook`` of ``json.loads`` that refuses a key given twice.

    Raises
    ------
    DuplicateKeyError
        Naming the first repeated key.
    """
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen: set[str] = set()
        for k, _ in pairs:
            if k in seen:
                raise DuplicateKeyError(k)
            seen.add(k)
    return obj


def parse_json(raw: bytes, source: str) -> Any:
    """Parse untrusted JSON bytes with the file rules; errors are :class:`InputError`.

    The rules (caps of :mod:`ntp_opt.model.files.caps`): at most
    ``MAX_FILE_BYTES`` bytes, ``TOKENS_PER_NODE`` times ``MAX_NODES`` values
    and ``MAX_STRING_BYTES`` bytes per
    string (all counted on the raw bytes, before parsing); UTF-8 only, no
    byte-order mark; no duplicate keys; no ``NaN``, ``Infinity`` or numbers
    that overflow a float (``1e999``), anywhere, ``meta`` included; nesting
    deeper than Python's recursion limit is refused.

    Parameters
    ----------
    raw
        The bytes (already decompressed).
    source
        Name used in error messages.

    Returns
    -------
    Any
        The parsed value.
    """
    scan = _Scan(source)
    for i in range(0, len(raw), _CHUNK):
        scan.feed(raw[i : i + _CHUNK])
    return _parse_fast(raw, source)


def parse_checked(raw: bytes, source: str) -> Any:
    """Parse ``raw`` with a hook on every value: the parse whose errors name the field.

    Refuses a byte-order mark, text that is not UTF-8 (or holds NUL bytes), a
    repeated key, ``NaN``/``Infinity`` and numbers that overflow a float, naming
    the field of each. The caps are not checked here (see :func:`parse_json`).

    Parameters
    ----------
    raw
        The bytes (already decompressed).
    source
        Name used in error messages.

    Returns
    -------
    Any
        The parsed value.

    Raises
    ------
    InputError
        Naming ``source`` and, where there is one, the field.
    """
    text = _utf8_text(raw, source)
    numbers = _Numbers()
    try:
        data = json.loads(
            text,
            parse_constant=numbers.constant,
            parse_float=numbers.number,
            object_pairs_hook=unique_object,
        )
    except DuplicateKeyError as err:
        raise InputError(source, [("", f"duplicate key {err.args[0]!r}")]) from None
    except json.JSONDecodeError as err:
        raise InputError(
            source, [("", f"malformed JSON at line {err.lineno} column {err.colno}: {err.msg}")]
        ) from None
    except RecursionError:
        raise InputError(source, [("", "malformed JSON: nested too deeply")]) from None
    except ValueError as err:  # e.g. an integer of more than 4300 digits
        raise InputError(source, [("", f"malformed JSON: {err}")]) from None
    del text
    if numbers.seen:
        raise numbers.error(data, source)
    return data


def _utf8_text(raw: bytes, source: str) -> str:
    """``raw`` decoded; a byte-order mark, invalid UTF-8 or a NUL byte is an error."""
    if raw.startswith((b"\xef\xbb\xbf", b"\xff\xfe", b"\xfe\xff")):
        raise InputError(
            source, [("", "starts with a byte-order mark; save it as UTF-8 without one")]
        )
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise InputError(
            source, [("", f"not UTF-8 text: {err.reason} at byte {err.start}")]
        ) from None
    if "\x00" in text:
        raise InputError(source, [("", "not UTF-8 JSON text: it holds NUL bytes (UTF-16?)")])
    return text


class _Numbers:
    """``parse_constant`` and ``parse_float`` hooks noting every non-finite number."""

    def __init__(self) -> None:
        self.seen: list[str] = []
        self.overflow: set[float] = set()

    def constant(self, token: str) -> float:
        """``NaN``, ``Infinity``, ``-Infinity``: noted, refused after the parse."""
        self.seen.append(token)
        return float(token.replace("Infinity", "inf"))

    def number(self, token: str) -> float:
        """A float literal; one that overflows to infinity is noted."""
        x = float(token)
        if not math.isfinite(x):
            self.seen.append(token)
            self.overflow.add(x)
        return x

    def error(self, data: Any, source: str) -> InputError:
        """The error naming the field of every non-finite number in ``data``."""
        try:
            where = _nonfinite(data)
        except RecursionError:
            where = []
        problems = [
            (
                field_path(loc),
                "a number too large for a float (overflows to infinity)"
                if x in self.overflow and _token(x) not in self.seen
                else f"{_token(x)} is not valid JSON",
            )
            for loc, x in where
        ]
        return InputError(
            source, problems or [("", f"{self.seen[0]} is not valid JSON (not a finite number)")]
        )


def read_json(path: Path) -> Any:
    """Read a ``.json`` or ``.json.gz`` file under the rules of :func:`parse_json`.

    Decompression is streamed and the caps are checked chunk by chunk, so a
    gzip bomb is refused after reading at most ``caps.MAX_FILE_BYTES`` bytes.
    """
    return _parse_fast(read_bytes(path), str(path))


def read_bytes(path: Path) -> bytes:
    """The file's (decompressed) bytes, the caps of :class:`_Scan` checked chunk by chunk."""
    source = str(path)
    max_bytes = _limits()[0]
    try:
        st = path.stat()
    except OSError as err:
        raise InputError(source, [("", f"cannot read file: {err.strerror}")]) from None
    if st.st_size > max_bytes:
        raise InputError(source, [("", f"file is {st.st_size} bytes, more than {max_bytes}")])
    scan = _Scan(source)
    chunks: list[bytes] = []
    try:
        with gzip.open(path, "rb") if path.suffix == ".gz" else path.open("rb") as fh:
            while chunk := fh.read(_CHUNK):
                scan.feed(chunk)
                chunks.append(chunk)
    except (OSError, EOFError, zlib.error) as err:
        raise InputError(source, [("", f"cannot read file: {err}")]) from None
    return b"".join(chunks)


def plain_text(raw: bytes) -> str | None:
    """``raw`` decoded, or ``None`` if :func:`parse_checked` must judge it (BOM, not UTF-8, NUL)."""
    if raw.startswith((b"\xef\xbb\xbf", b"\xff\xfe", b"\xfe\xff")):
        return None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return None
    return None if "\x00" in text else text


def loads_plain(text: str) -> Any:
    """``json.loads`` without per-value hooks; ``None`` where :func:`parse_checked` must judge.

    The caller still has to prove that no key was repeated and no number
    overflowed (see :func:`_parse_fast`).
    """
    constants: list[str] = []
    try:
        data = json.loads(text, parse_constant=constants.append)
    except (ValueError, RecursionError):  # JSONDecodeError included
        return None
    return None if constants else data


def _parse_fast(raw: bytes, source: str) -> Any:
    """:func:`parse_checked` without its per-value hooks, when the parsed value proves them idle.

    ``json.loads`` without hooks gives the same value unless the text has a
    duplicate key, a ``NaN``/``Infinity`` or a number that overflows: every
    key is followed by a ``:`` byte, so as many ``:`` bytes as keys in the
    parsed value proves no key was repeated; ``NaN``/``Infinity`` still go
    through ``parse_constant``; an overflow leaves an infinite float. Anything
    else, errors included, takes :func:`parse_checked`.
    """
    text = plain_text(raw)
    data = None if text is None else loads_plain(text)
    del text
    if data is None:
        return parse_checked(raw, source)
    keys, finite = keys_and_finite(data)
    if not finite or raw.count(b":") != keys:
        return parse_checked(raw, source)
    return data


def keys_and_finite(data: Any) -> tuple[int, bool]:
    """Number of object keys in parsed JSON, and whether every float in it is finite.

    Level by level, so that a list of a million records costs a few scans.
    """
    total = 0
    finite = True
    level: list[Any] = [data]
    while level:
        types = set(map(type, level))
        if float in types:
            floats = [v for v in level if type(v) is float]
            finite = finite and bool(np.isfinite(np.array(floats, dtype=float)).all())
        if dict not in types and list not in types:
            break
        dicts = level if types == {dict} else [v for v in level if type(v) is dict]
        lists = [v for v in level if type(v) is list] if list in types else []
        total += sum(map(len, dicts))
        level = [*chain.from_iterable(map(dict.values, dicts)), *chain.from_iterable(lists)]
    return total, finite


def _token(x: float) -> str:
    return "NaN" if math.isnan(x) else ("Infinity" if x > 0 else "-Infinity")


def _nonfinite(
    data: Any, loc: tuple[int | str, ...] = ()
) -> list[tuple[tuple[int | str, ...], float]]:
    """Paths and values of the non-finite floats in parsed JSON."""
    if isinstance(data, float) and not math.isfinite(data):
        return [(loc, data)]
    out: list[tuple[tuple[int | str, ...], float]] = []
    if isinstance(data, dict):
        for k, v in data.items():
            out += _nonfinite(v, (*loc, k))
    elif isinstance(data, list):
        for i, v in enumerate(data):
            out += _nonfinite(v, (*loc, i))
    return out
