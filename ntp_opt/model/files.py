"""JSON files for instances and plans (docs/model.md, spec section 7).

Both formats are pydantic models; their JSON Schemas are published in
``ntp_opt/schemas/`` (``ntp-opt schema instance|plan`` prints them). Loading
validates everything and raises :class:`InputError` naming the file and the
field path; unknown fields are errors. Files ending in ``.gz`` are
gzip-compressed. Saving writes to a temporary file and renames it, so an
interrupted save never leaves a truncated file behind.
"""

from __future__ import annotations

import gzip
import json
import math
import os
import re
import zlib
from collections.abc import Hashable, Iterable
from itertools import chain, islice
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

import numpy as np
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictInt,
    StrictStr,
    ValidationError,
    ValidationInfo,
    field_validator,
)

from ntp_opt.model.instance import Instance
from ntp_opt.model.job import Job
from ntp_opt.model.plan import Plan, Replica, Stage
from ntp_opt.model.records import compile_records
from ntp_opt.model.safeio import atomic_open
from ntp_opt.model.topology import DEFAULT_TDP_W, TopologyError
from ntp_opt.model.topology.attrs import SPEED_MAX, SPEED_MIN

if TYPE_CHECKING:
    import networkx as nx

INSTANCE_FORMAT = "ntp-opt/instance@1"
PLAN_FORMAT = "ntp-opt/plan@1"
#: Largest number of cluster nodes a file may declare (about 900k GPUs).
MAX_NODES = 1_000_000
#: Largest file accepted, in bytes, uncompressed (a pretty-printed file takes
#: about 330 bytes per node).
MAX_FILE_BYTES = 512 * 1024**2
#: JSON values (counted as ``,``, ``{`` and ``[`` bytes) allowed per node of
#: :data:`MAX_NODES`: real instances have about 10.
TOKENS_PER_NODE = 12
#: JSON values allowed on top of ``TOKENS_PER_NODE * MAX_NODES``.
TOKENS_EXTRA = 100_000
#: Longest string (raw bytes between two quotes) accepted anywhere in a file.
MAX_STRING_BYTES = 1 << 20
_CHUNK = 1 << 22
# The schema's own caps on the cluster lists (fixed when the models are defined).
_SCHEMA_MAX_NODES = MAX_NODES

NodeId = StrictStr | StrictInt
Finite = Annotated[float, Field(allow_inf_nan=False)]


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


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class GpuNode(_Strict):
    """A GPU (``kind: gpu``)."""

    id: NodeId
    kind: Literal["gpu"]
    state: Literal["healthy", "failed"] = "healthy"
    speed: Finite = Field(default=1.0, ge=SPEED_MIN, le=SPEED_MAX)
    p_fail: Finite = Field(default=0.0, ge=0.0, le=1.0)
    tdp_w: Finite = Field(default=DEFAULT_TDP_W, ge=1.0, le=1e6)
    max_power_w: Finite | None = Field(
        default=None,
        ge=1.0,
        le=1e6,
        description=(
            "Largest power limit the board accepts, in watts (must be >= tdp_w). "
            "Absent: tdp_w * (1 + job.max_boost), i.e. only the job's boost cap applies."
        ),
    )
    uuid: str | None = Field(
        default=None, min_length=1, max_length=200, description="Device UUID (nvidia-smi)."
    )
    host: str | None = Field(
        default=None, min_length=1, max_length=255, description="Hostname the GPU is on."
    )
    index: StrictInt | None = Field(
        default=None, ge=0, le=1_000_000, description="Device index on its host."
    )

    @field_validator("max_power_w")
    @classmethod
    def _max_power_at_least_tdp(cls, v: float | None, info: ValidationInfo) -> float | None:
        tdp = info.data.get("tdp_w")
        if v is not None and tdp is not None and v < tdp:
            raise ValueError(
                f"{v:g} is below tdp_w {tdp:g} (a board accepts at least its nominal limit)"
            )
        return v


class TrayNode(_Strict):
    """A compute tray / host (``kind: tray``)."""

    id: NodeId
    kind: Literal["tray"]
    p_fail: Finite = Field(default=0.0, ge=0.0, le=1.0)
    host: str | None = Field(
        default=None, min_length=1, max_length=255, description="Hostname (scheduler's name)."
    )


class DomainNode(_Strict):
    """An NVLink scale-up domain (``kind: domain``)."""

    id: NodeId
    kind: Literal["domain"]
    size: int = Field(ge=1, le=100_000)


class RackNode(_Strict):
    """A rack, the power unit (``kind: rack``)."""

    id: NodeId
    kind: Literal["rack"]
    power_budget_w: Finite | None = Field(default=None, ge=0.0, le=1e12)
    budget_source: str | None = Field(
        default=None,
        min_length=1,
        max_length=1000,
        description="Where power_budget_w came from (written by ntp-opt import; shown by info).",
    )


class SwitchNode(_Strict):
    """A scale-out switch (``kind: switch``)."""

    id: NodeId
    kind: Literal["switch"]
    tier: Literal["leaf", "spine"] = "leaf"


Node = Annotated[
    GpuNode | TrayNode | DomainNode | RackNode | SwitchNode, Field(discriminator="kind")
]


class Link(_Strict):
    """An edge of the cluster graph."""

    source: NodeId
    target: NodeId
    bandwidth_gbps: Finite | None = Field(default=None, gt=0.0)


class GraphAttrs(_Strict):
    """Attributes of the cluster graph itself."""

    name: str | None = None
    power_budget_w: Finite | None = Field(default=None, ge=0.0, le=1e12)


class ClusterData(_Strict):
    """NetworkX node-link data (``node_link_data(G, edges="edges")``)."""

    directed: Literal[False] = False
    multigraph: Literal[False] = False
    graph: GraphAttrs = Field(default_factory=GraphAttrs)
    nodes: list[Node] = Field(max_length=MAX_NODES)
    edges: list[Link] = Field(default_factory=list, max_length=4 * MAX_NODES)


class InstanceFile(_Strict):
    """An instance file, format ``ntp-opt/instance@1``."""

    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={"$id": "https://ntp-opt.invalid/schemas/instance@1.schema.json"},
    )

    format: Literal["ntp-opt/instance@1"]
    name: str = Field(min_length=1, max_length=200)
    description: str | None = None
    meta: dict[str, Any] = Field(default_factory=dict)
    cluster: ClusterData
    job: Job


class StageData(_Strict):
    """One stage of a replica."""

    domain: NodeId
    gpus: list[NodeId]
    power: Finite = 1.0


class ReplicaData(_Strict):
    """One replica of a plan."""

    tp: int = Field(ge=1, le=1_000_000)
    local_batch: int = Field(ge=0, le=1_000_000_000_000)
    stages: list[StageData]


class MetricsData(BaseModel):
    """Figures reported with a plan; other scalar fields are allowed."""

    model_config = ConfigDict(extra="allow")

    goodput: Finite = Field(ge=0.0)
    relative_goodput: Finite = Field(ge=0.0)
    bound: Finite | None = None


class PlanFile(_Strict):
    """A plan file, format ``ntp-opt/plan@1``."""

    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={"$id": "https://ntp-opt.invalid/schemas/plan@1.schema.json"},
    )

    format: Literal["ntp-opt/plan@1"]
    instance: str
    replicas: list[ReplicaData]
    metrics: MetricsData


def _loc(loc: tuple[int | str, ...]) -> str:
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
        (_loc(tuple(e["loc"])), e["msg"].removeprefix("Value error, "))
        for e in err.errors(include_url=False)
    ]


def _limits() -> tuple[int, int, int]:
    """(bytes, tokens, string bytes) a file may have, from the module's caps.

    Read at each call, so that tests and the service can lower :data:`MAX_NODES`
    and the others.
    """
    return MAX_FILE_BYTES, TOKENS_PER_NODE * MAX_NODES + TOKENS_EXTRA, MAX_STRING_BYTES


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
        if self.kinds > MAX_NODES:
            raise InputError(
                self.source,
                [("cluster.nodes", f"declares more than {MAX_NODES} nodes (kind fields)")],
            )
        self.tokens += chunk.count(b",") + chunk.count(b"{") + chunk.count(b"[")
        if self.tokens > self.max_tokens:
            raise InputError(
                self.source,
                [
                    (
                        "",
                        f"more than {self.max_tokens} JSON values: more than "
                        f"{MAX_NODES} nodes' worth of data",
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

    The rules: at most :data:`MAX_FILE_BYTES` bytes, :data:`TOKENS_PER_NODE`
    times :data:`MAX_NODES` values and :data:`MAX_STRING_BYTES` bytes per
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


def _parse(raw: bytes, source: str) -> Any:
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

    seen: list[str] = []
    overflow: set[float] = set()

    def constant(token: str) -> float:
        seen.append(token)  # NaN, Infinity, -Infinity: refused below, naming the field
        return float(token.replace("Infinity", "inf"))

    def number(token: str) -> float:
        x = float(token)
        if not math.isfinite(x):
            seen.append(token)
            overflow.add(x)
        return x

    try:
        data = json.loads(
            text, parse_constant=constant, parse_float=number, object_pairs_hook=unique_object
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
    if seen:
        try:
            where = _nonfinite(data)
        except RecursionError:
            where = []
        problems = [
            (
                _loc(loc),
                "a number too large for a float (overflows to infinity)"
                if x in overflow and _token(x) not in seen
                else f"{_token(x)} is not valid JSON",
            )
            for loc, x in where
        ]
        raise InputError(
            source, problems or [("", f"{seen[0]} is not valid JSON (not a finite number)")]
        )
    return data


def read_json(path: Path) -> Any:
    """Read a ``.json`` or ``.json.gz`` file under the rules of :func:`parse_json`.

    Decompression is streamed and the caps are checked chunk by chunk, so a
    gzip bomb is refused after reading at most :data:`MAX_FILE_BYTES` bytes.
    """
    return _parse_fast(_read_bytes(path), str(path))


def _read_bytes(path: Path) -> bytes:
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


def _plain_text(raw: bytes) -> str | None:
    """``raw`` decoded, or ``None`` if :func:`_parse` must judge it (BOM, not UTF-8, NUL)."""
    if raw.startswith((b"\xef\xbb\xbf", b"\xff\xfe", b"\xfe\xff")):
        return None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return None
    return None if "\x00" in text else text


def _loads_plain(text: str) -> Any:
    """``json.loads`` without per-value hooks; ``None`` on anything :func:`_parse` must judge.

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
    """:func:`_parse` without its per-value hooks, when the parsed value proves them idle.

    ``json.loads`` without hooks gives the same value unless the text has a
    duplicate key, a ``NaN``/``Infinity`` or a number that overflows: every
    key is followed by a ``:`` byte, so as many ``:`` bytes as keys in the
    parsed value proves no key was repeated; ``NaN``/``Infinity`` still go
    through ``parse_constant``; an overflow leaves an infinite float. Anything
    else, errors included, takes :func:`_parse`.
    """
    text = _plain_text(raw)
    data = None if text is None else _loads_plain(text)
    del text
    if data is None:
        return _parse(raw, source)
    keys, finite = _keys_and_finite(data)
    if not finite or raw.count(b":") != keys:
        return _parse(raw, source)
    return data


def _keys_and_finite(data: Any) -> tuple[int, bool]:
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


def write_json(data: Any, path: Path, inputs: Iterable[str | os.PathLike[str]] = ()) -> None:
    """Write through :func:`ntp_opt.safeio.atomic_open` (temp file, fsync, rename).

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


# --- instances ---------------------------------------------------------------


def check_format(data: Any, expected: str, source: str) -> None:
    """Raise :class:`InputError` unless ``data`` is an object whose ``format`` is ``expected``."""
    if not isinstance(data, dict):
        raise InputError(source, [("", f"expected a JSON object, got {type(data).__name__}")])
    fmt = data.get("format")
    if fmt != expected:
        raise InputError(source, [("format", f"expected {expected!r}, got {fmt!r}")])


def _check_counts(data: dict[str, Any], source: str) -> None:
    """Refuse more than :data:`MAX_NODES` nodes (4x as many edges) before building objects."""
    cluster = data.get("cluster")
    if not isinstance(cluster, dict):
        return
    for key, cap in (("nodes", MAX_NODES), ("edges", 4 * MAX_NODES)):
        items = cluster.get(key)
        if isinstance(items, list) and len(items) > cap:
            raise InputError(
                source, [(f"cluster.{key}", f"declares more than {cap} {key} ({len(items)})")]
            )


_DIGITS = re.compile(r"[0-9]{1,9}")


def _strict_ready(data: dict[str, Any]) -> dict[str, Any]:
    """``data`` with the two JSON forms strict validation cannot take as they are.

    ``job.tp_allowed`` (a JSON array) becomes a tuple and the keys of
    ``job.tp_efficiency`` (JSON object keys are strings) that are plain decimal
    integers become ints; any other key is left a string and refused. The rest
    is validated strictly: ``true`` or ``"1.0"`` is not a number, ``"4"`` not
    an integer, as the published schema says.
    """
    job = data.get("job")
    if not isinstance(job, dict):
        return data
    job = dict(job)
    if isinstance(job.get("tp_allowed"), list):
        job["tp_allowed"] = tuple(job["tp_allowed"])
    eff = job.get("tp_efficiency")
    if isinstance(eff, dict):
        job["tp_efficiency"] = {
            int(k) if isinstance(k, str) and _DIGITS.fullmatch(k) else k: v for k, v in eff.items()
        }
    return {**data, "job": job}


def instance_from_dict(data: Any, source: str = "<instance>") -> Instance:
    """Build an :class:`Instance` from parsed JSON, validating everything.

    The cluster's records are checked column by column and compiled straight
    into :attr:`Instance.arrays`; the NetworkX graph (:attr:`Instance.cluster`)
    is built from them when first read, so the instance keeps references to
    ``data``'s node records until then (do not change them). Records
    the column checks cannot prove valid take :func:`instance_from_dict_reference`,
    whose errors name the node and the field.

    Parameters
    ----------
    data
        Parsed instance JSON.
    source
        Name used in error messages (usually the file name).

    Returns
    -------
    Instance

    Raises
    ------
    InputError
        On any schema or topology problem, naming ``source`` and the field.
    """
    check_format(data, INSTANCE_FORMAT, source)
    _check_counts(data, source)
    fast = _instance_from_columns(data)
    return fast[0] if fast is not None else _instance_from_models(data, source)


def _instance_from_columns(data: dict[str, Any]) -> tuple[Instance, int] | None:
    """The instance and the number of keys in its records, or ``None`` unless every
    check passes on the columns."""
    cluster = data.get("cluster")
    if not isinstance(cluster, dict):
        return None
    nodes, edges = cluster.get("nodes"), cluster.get("edges", [])
    if type(nodes) is not list or type(edges) is not list:
        return None
    if len(nodes) > _SCHEMA_MAX_NODES or len(edges) > 4 * _SCHEMA_MAX_NODES:
        return None
    head = {**data, "cluster": {**cluster, "nodes": [], "edges": []}}
    try:  # everything but the records, through the schema
        model = InstanceFile.model_validate(_strict_ready(head), strict=True)
    except ValidationError:
        return None
    site = model.cluster.graph
    compiled = compile_records(nodes, edges, site.power_budget_w, model.job.tp)
    if compiled is None:
        return None
    graph_attrs = {k: getattr(site, k) for k in cluster.get("graph", {})}
    # The graph, if ever read, is built from the node records and the compiled
    # edges: the instance keeps no reference to the edge records.
    instance = Instance.from_arrays(
        model.name,
        compiled.arrays,
        model.job,
        _meta(model),
        lambda: compiled.graph(graph_attrs, nodes),
    )
    return instance, compiled.n_keys


def _meta(model: InstanceFile) -> dict[str, Any]:
    meta = dict(model.meta)
    if model.description is not None:
        meta["description"] = model.description
    return meta


def instance_from_dict_reference(data: Any, source: str = "<instance>") -> Instance:
    """:func:`instance_from_dict` the reference way: pydantic per record, the graph first.

    Every node and edge is validated by the schema's models, the graph is
    built and checked (:func:`ntp_opt.model.topology.check_topology`), then
    compiled. Slower by far on large clusters; it gives the error messages of
    :func:`instance_from_dict` and is the oracle of its column checks.

    Parameters
    ----------
    data
        Parsed instance JSON.
    source
        Name used in error messages.

    Returns
    -------
    Instance
        With its graph built.

    Raises
    ------
    InputError
        On any schema or topology problem, naming ``source`` and the field.
    """
    check_format(data, INSTANCE_FORMAT, source)
    _check_counts(data, source)
    return _instance_from_models(data, source)


def _instance_from_models(data: dict[str, Any], source: str) -> Instance:
    try:
        model = InstanceFile.model_validate(_strict_ready(data), strict=True)
    except ValidationError as err:
        raise InputError(source, validation_problems(err)) from None
    import networkx as nx  # here, not at import: the column path builds no graph

    graph = nx.Graph()
    graph.graph.update(
        {k: getattr(model.cluster.graph, k) for k in data["cluster"].get("graph", {})}
    )
    seen: set[Hashable] = set()
    dups: list[tuple[str, str]] = []
    node_rows = []
    # Attributes keep the order of the file (so that load + save is the identity)
    # and the validated values.
    raw_nodes = data["cluster"]["nodes"]
    for i, node in enumerate(model.cluster.nodes):
        if node.id in seen:
            dups.append((f"cluster.nodes[{i}].id", f"duplicate node id {node.id!r}"))
        seen.add(node.id)
        attrs = {k: getattr(node, k) for k in raw_nodes[i] if k != "id"}
        if isinstance(node, SwitchNode):  # the schema's default tier, which the topology needs
            attrs.setdefault("tier", node.tier)
        node_rows.append((node.id, attrs))
    graph.add_nodes_from(node_rows)
    for i, link in enumerate(model.cluster.edges):
        for end in ("source", "target"):
            if getattr(link, end) not in seen:
                dups.append((f"cluster.edges[{i}].{end}", f"unknown node {getattr(link, end)!r}"))
    raw_edges = data["cluster"].get("edges", [])
    graph.add_edges_from(
        (
            link.source,
            link.target,
            {k: getattr(link, k) for k in raw_edges[i] if k not in ("source", "target")},
        )
        for i, link in enumerate(model.cluster.edges)
    )
    if dups:
        raise InputError(source, dups)
    try:
        return Instance(model.name, graph, model.job, _meta(model), copy_graph=False)
    except TopologyError as err:
        raise InputError(source, [("cluster", p) for p in err.problems]) from None


def check_cluster(graph: nx.Graph, source: str = "<cluster>") -> None:
    """Check a cluster graph against the instance file schema (strict), as a load would.

    Used by ``ntp-opt gen`` so that it never writes a file no command can load.

    Raises
    ------
    InputError
        Naming ``source`` and the field (``cluster.nodes[5].tdp_w``).
    """
    if graph.number_of_nodes() > MAX_NODES:
        raise InputError(source, [("cluster.nodes", f"more than {MAX_NODES} nodes")])
    import networkx as nx

    data = nx.node_link_data(graph, edges="edges")
    try:
        nodes, edges = data["nodes"], data["edges"]
        ClusterData.model_validate({**data, "nodes": [], "edges": []}, strict=True)
        if compile_records(nodes, edges, None) is not None:
            return  # the records proven valid column by column (topology included)
        ClusterData.model_validate(data, strict=True)
    except ValidationError as err:
        raise InputError(
            source, [(f"cluster.{f}", m) for f, m in validation_problems(err)]
        ) from None


def instance_to_dict(instance: Instance) -> dict[str, Any]:
    """The JSON form of ``instance`` (format ``ntp-opt/instance@1``)."""
    meta = dict(instance.meta)
    description = meta.pop("description", None)
    for node in instance.cluster.nodes:
        if isinstance(node, bool) or not isinstance(node, str | int):
            raise ValueError(f"node id {node!r} is not a string or an integer; JSON needs one")
    import networkx as nx

    cluster = nx.node_link_data(instance.cluster, edges="edges")
    data: dict[str, Any] = {"format": INSTANCE_FORMAT, "name": instance.name}
    if description is not None:
        data["description"] = description
    data["meta"] = meta
    job = instance.job.model_dump(mode="json")
    if job["micro_batch"] == 1:  # the default: files written before the field stay byte-equal
        del job["micro_batch"]
    data["job"] = job
    data["cluster"] = cluster
    return data


def load_instance(path: str | os.PathLike[str]) -> Instance:
    """Load and validate an instance file (``.json`` or ``.json.gz``).

    The fast way when it applies: the file parsed without per-value hooks,
    its cluster compiled by the column checks (:func:`instance_from_dict`),
    then the parse proven equal to the checked one (:func:`_parse_fast`'s
    rules: no repeated key, no overflowed number). Otherwise the checked
    parse (of the file read again) and :func:`instance_from_dict`, whose
    errors name the field.

    Raises
    ------
    InputError
        Naming the file and the field path of every problem.
    """
    p = Path(path)
    raw = _read_bytes(p)
    text = _plain_text(raw)
    if text is None:
        return instance_from_dict(_parse(raw, str(p)), str(p))
    del raw
    colons = text.count(":")  # ':' never occurs inside a multi-byte UTF-8 character
    data = _loads_plain(text)
    del text  # peak memory: the checked path below reads the file again
    if isinstance(data, dict) and data.get("format") == INSTANCE_FORMAT:
        try:
            _check_counts(data, str(p))
        except InputError:
            pass  # the checked path below reports it
        else:
            fast = _instance_from_columns(data)
            if fast is not None and _same_as_checked(colons, data, fast[1]):
                return fast[0]
    del data
    return instance_from_dict(_parse(_read_bytes(p), str(p)), str(p))


def _same_as_checked(colons: int, data: dict[str, Any], record_keys: int) -> bool:
    """Whether :func:`_parse` gives ``data`` too, for records the column checks accepted.

    ``colons``: the ``:`` characters of the text ``data`` was parsed from;
    ``record_keys``: the keys in its cluster's records (counted by the checks).

    Their values are proven scalars and finite, so only the rest of the file
    is walked for floats, and the keys are counted as in :func:`_parse_fast`.
    """
    cluster = data["cluster"]
    rest = {**data, "cluster": {**cluster, "nodes": [], "edges": []}}
    keys, finite = _keys_and_finite(rest)
    return finite and colons == keys + record_keys


def save_instance(
    instance: Instance,
    path: str | os.PathLike[str],
    inputs: Iterable[str | os.PathLike[str]] = (),
) -> None:
    """Write ``instance`` to ``path`` atomically (gzip if it ends in ``.gz``).

    ``inputs``: files the command read; writing onto one of them is refused
    (:class:`ntp_opt.safeio.UnsafeTargetError`).
    """
    write_json(instance_to_dict(instance), Path(path), inputs)


# --- plans -------------------------------------------------------------------


def plan_from_dict(data: Any, source: str = "<plan>") -> Plan:
    """Build a :class:`Plan` from parsed JSON (schema checks only).

    The model's rules (healthy GPUs, budgets, ...) are the validator's job:
    see :func:`ntp_opt.validate.validate`.
    """
    check_format(data, PLAN_FORMAT, source)
    try:
        model = PlanFile.model_validate(data, strict=True)
    except ValidationError as err:
        raise InputError(source, validation_problems(err)) from None
    replicas = tuple(
        Replica(
            tp=r.tp,
            local_batch=r.local_batch,
            stages=tuple(Stage(s.domain, tuple(s.gpus), s.power) for s in r.stages),
        )
        for r in model.replicas
    )
    return Plan(model.instance, replicas, model.metrics.model_dump(exclude_unset=True))


def plan_to_dict(plan: Plan) -> dict[str, Any]:
    """The JSON form of ``plan`` (format ``ntp-opt/plan@1``).

    Raises
    ------
    ValueError
        If the plan's metrics lack ``goodput`` or ``relative_goodput`` (use
        :func:`ntp_opt.validate.evaluate` to compute them).
    """
    metrics = {
        k: v for k, v in plan.metrics.items() if not (isinstance(v, float) and not math.isfinite(v))
    }
    missing = [k for k in ("goodput", "relative_goodput") if k not in metrics]
    if missing:
        raise ValueError(f"plan metrics lack {missing}; evaluate the plan first")
    return {
        "format": PLAN_FORMAT,
        "instance": plan.instance,
        "replicas": [
            {
                "tp": r.tp,
                "local_batch": r.local_batch,
                "stages": [
                    {"domain": s.domain, "gpus": list(s.gpus), "power": s.power} for s in r.stages
                ],
            }
            for r in plan.replicas
        ],
        "metrics": metrics,
    }


def load_plan(path: str | os.PathLike[str]) -> Plan:
    """Load a plan file; schema errors raise :class:`InputError`."""
    p = Path(path)
    return plan_from_dict(read_json(p), str(p))


def save_plan(
    plan: Plan, path: str | os.PathLike[str], inputs: Iterable[str | os.PathLike[str]] = ()
) -> None:
    """Write ``plan`` to ``path`` atomically (never onto one of ``inputs``)."""
    write_json(plan_to_dict(plan), Path(path), inputs)


def json_schema(kind: Literal["instance", "plan"]) -> dict[str, Any]:
    """The published JSON Schema of an instance or plan file."""
    model = InstanceFile if kind == "instance" else PlanFile
    schema = model.model_json_schema()
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    return schema
