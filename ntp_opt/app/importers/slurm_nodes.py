"""Slurm's node listings: ``scontrol show node`` records, node states, running ``scontrol``.

``scontrol show node --oneliner`` (or the multi-line form) gives per node
``NodeName``, ``NodeHostName``, ``Gres`` (``gpu:4``, ``gpu:h100:8``,
``gpu:8(S:0-1)``, several comma-separated entries), ``State`` (``IDLE``,
``IDLE+DRAIN``, ``DOWN+NOT_RESPONDING``, ...) and ``Reason``. Node states are
classified by :data:`STATE_WORDS` (every base state and flag scontrol prints,
Slurm 22.05 to 24.x, and sinfo's long names and suffixes): usable, unusable, or
unusable unless the user allows its kind (:data:`ALLOW_KINDS`). The topology is
read by :mod:`ntp_opt.app.importers.slurm_topology`; the cluster is built by
:func:`ntp_opt.app.importers.slurm.import_slurm`.
"""

from __future__ import annotations

import os
import re
import selectors
import shutil
import subprocess
import time
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

from ntp_opt.app.importers.compose import fail
from ntp_opt.model.files import MAX_NODES

__all__ = [
    "ALLOW_KINDS",
    "STATE_WORDS",
    "SlurmNode",
    "Source",
    "StateVerdict",
    "classify_state",
    "parse_gres",
    "read_nodes",
    "read_text",
    "scontrol",
]

#: Largest text source read (a file, or one scontrol output).
MAX_INPUT_BYTES = 256 * 1024**2
#: Seconds a live ``scontrol`` may run.
SCONTROL_TIMEOUT_S = 120.0

USABLE = "usable"
UNUSABLE = "unusable"
#: Kinds of node state the user may count as usable (``--allow KIND``), and why one would.
ALLOW_KINDS: dict[str, str] = {
    "reserved": "the job will run in that reservation, or after it ends",
    "powered-down": "power saving boots the node when a job asks for it",
    "reboot": "the node comes back after its reboot",
}
#: Every node state word -> (usable / unusable / an ALLOW_KINDS key, meaning).
#: Base states and flags of ``scontrol show node`` (Slurm 22.05 to 24.x), then the
#: long names ``sinfo`` prints. The one table of docs/import.md says the same.
STATE_WORDS: dict[str, tuple[str, str]] = {
    # base states
    "IDLE": (USABLE, "no job runs on it"),
    "ALLOCATED": (USABLE, "jobs run on it"),
    "MIXED": (USABLE, "jobs run on part of it"),
    "DOWN": (UNUSABLE, "down"),
    "ERROR": (UNUSABLE, "in an error state"),
    "FUTURE": (UNUSABLE, "configured for the future, not in service"),
    "UNKNOWN": (UNUSABLE, "state not yet known to slurmctld"),
    # flags
    "BLOCKED": (USABLE, "blocked by another job's exclusive topology request"),
    "CLOUD": (USABLE, "a cloud node"),
    "COMPLETING": (USABLE, "jobs are completing"),
    "DRAIN": (UNUSABLE, "drained by an administrator"),
    "DYNAMIC_FUTURE": (UNUSABLE, "a dynamic node not yet registered"),
    "DYNAMIC_NORM": (USABLE, "a dynamic node"),
    "EXTERNAL": (UNUSABLE, "external to Slurm"),
    "FAIL": (UNUSABLE, "failed by an administrator"),
    "INVALID_REG": (
        UNUSABLE,
        "registered with fewer resources than configured (often a GPU missing)",
    ),
    "MAINTENANCE": ("reserved", "in a maintenance reservation"),
    "NOT_RESPONDING": (UNUSABLE, "not responding"),
    "PERFCTRS": (USABLE, "network performance counters in use"),
    "PLANNED": (USABLE, "planned by the backfill scheduler"),
    "POWER_DOWN": ("powered-down", "about to be powered down"),
    "POWER_DRAIN": (UNUSABLE, "drained and about to be powered down"),
    "POWERED_DOWN": ("powered-down", "powered down"),
    "POWERING_DOWN": ("powered-down", "powering down"),
    "POWERING_UP": ("powered-down", "powering up"),
    "POWER_UP": ("powered-down", "about to be powered up"),
    "REBOOT_ISSUED": (UNUSABLE, "rebooting"),
    "REBOOT_REQUESTED": ("reboot", "a reboot is requested"),
    "RESERVED": ("reserved", "in an advance reservation"),
    "RESUME": (USABLE, "resumed by an administrator"),
    # sinfo's long names
    "ALLOC": (USABLE, "jobs run on it"),
    "DRAINED": (UNUSABLE, "drained by an administrator"),
    "DRAINING": (UNUSABLE, "being drained by an administrator"),
    "FAILING": (UNUSABLE, "failing, by an administrator"),
    "INVAL": (UNUSABLE, "registered with fewer resources than configured (often a GPU missing)"),
    "MAINT": ("reserved", "in a maintenance reservation"),
    "NPC": (USABLE, "network performance counters in use"),
    "REBOOT": ("reboot", "a reboot is requested"),
}
#: sinfo's state suffixes -> the flag each stands for.
STATE_SUFFIXES = {
    "*": "NOT_RESPONDING",
    "~": "POWERED_DOWN",
    "#": "POWERING_UP",
    "!": "POWER_DOWN",
    "%": "POWERING_DOWN",
    "$": "MAINTENANCE",
    "@": "REBOOT_REQUESTED",
    "^": "REBOOT_ISSUED",
    "-": "PLANNED",
}


@dataclass(frozen=True)
class Source:
    """Text read from somewhere other than a file (``scontrol``'s output)."""

    text: str
    name: str


@dataclass
class SlurmNode:
    """One node of ``scontrol show node``."""

    name: str
    hostname: str | None
    gpus: int
    gpu_type: str | None
    state: str
    reason: str
    where: str


@dataclass(frozen=True)
class StateVerdict:
    """What a node state means for its GPUs.

    Attributes
    ----------
    usable : bool
        The GPUs may be planned on.
    why : str
        For an unusable state, the words that make it so and their meaning; for a
        usable one, the allowed words (empty when nothing was allowed).
    allow : tuple of str
        The :data:`ALLOW_KINDS` that would make the state usable (unusable states
        whose only obstacles are such kinds).
    unknown : tuple of str
        Words not in :data:`STATE_WORDS` (taken as unusable).
    """

    usable: bool
    why: str = ""
    allow: tuple[str, ...] = ()
    unknown: tuple[str, ...] = ()


def classify_state(state: str, allow: Collection[str] = ()) -> StateVerdict:
    """Classify a Slurm node state (``IDLE+DRAIN``, ``DOWN*``, ``mixed~`` ...).

    Parameters
    ----------
    state : str
        The ``State=`` value (words joined by ``+``, sinfo suffixes accepted, any case).
    allow : collection of str
        :data:`ALLOW_KINDS` the user counts as usable.

    Returns
    -------
    StateVerdict

    Examples
    --------
    >>> classify_state("IDLE+DRAIN").usable
    False
    >>> classify_state("IDLE+POWERED_DOWN", allow={"powered-down"}).usable
    True
    """
    words: list[str] = []
    for part in state.strip().upper().split("+"):
        if not part:
            continue  # "ALLOCATED+" (sinfo: allocated and completing)
        core = part.rstrip("".join(STATE_SUFFIXES))
        words.append(core or part)
        words += [STATE_SUFFIXES[c] for c in part[len(core) :] if core]
    bad: list[str] = []
    kinds: list[str] = []
    allowed: list[str] = []
    unknown: list[str] = []
    for w in dict.fromkeys(words):
        use, meaning = STATE_WORDS.get(w, ("", ""))
        if not use:
            unknown.append(w)
            bad.append(f"{w}: not a node state this importer knows")
        elif use == UNUSABLE:
            bad.append(f"{w}: {meaning}")
        elif use != USABLE:
            if use in allow:
                allowed.append(f"{w}: {meaning} (--allow {use})")
            else:
                kinds.append(use)
                bad.append(f"{w}: {meaning}")
    if not words:
        return StateVerdict(False, "empty state", (), ("",))
    if bad:
        only_kinds = len(bad) == len(kinds)
        return StateVerdict(
            False, "; ".join(bad), tuple(dict.fromkeys(kinds)) if only_kinds else (), tuple(unknown)
        )
    return StateVerdict(True, "; ".join(allowed))


# --- reading ------------------------------------------------------------------


def read_text(path: Path | Source, limit: int = MAX_INPUT_BYTES) -> tuple[str, str]:
    """Read a file or a :class:`Source`, refusing more than ``limit`` bytes.

    Parameters
    ----------
    path : Path or Source
        A file (read in chunks: a pipe has no size) or text already read.
    limit : int
        Most bytes read.

    Returns
    -------
    tuple of (str, str)
        The text and its name for error messages.

    Raises
    ------
    ntp_opt.model.files.InputError
        When the file is larger than ``limit``, not UTF-8 or cannot be read.
    """
    if isinstance(path, Source):
        return path.text, path.name
    try:
        size = path.stat().st_size
        if size > limit:
            fail(str(path), f"file is {size} bytes, more than {limit}")
        chunks: list[bytes] = []
        total = 0
        with path.open("rb") as fh:  # in chunks: a pipe (<(scontrol ...)) has no size
            while chunk := fh.read(1 << 20):
                total += len(chunk)
                if total > limit:
                    fail(str(path), f"more than {limit} bytes")
                chunks.append(chunk)
        return b"".join(chunks).decode("utf-8"), str(path)
    except UnicodeDecodeError as err:
        fail(str(path), f"not UTF-8 text: {err.reason}")
    except OSError as err:
        fail(str(path), f"cannot read file: {err.strerror}")


def scontrol(*args: str, timeout: float = SCONTROL_TIMEOUT_S) -> Source:
    """Run the ``scontrol`` on ``PATH`` (``SLURM_CONF`` is honoured) and return its output.

    Parameters
    ----------
    *args : str
        Its arguments, e.g. ``"show", "node", "--oneliner"``.
    timeout : float
        Seconds before it is killed.

    Returns
    -------
    Source
        Its standard output, named ``scontrol ARGS``.

    Raises
    ------
    ntp_opt.model.files.InputError
        When scontrol is missing, exits non-zero (its first error line is quoted),
        runs longer than ``timeout`` or prints more than :data:`MAX_INPUT_BYTES`.
    """
    name = " ".join(("scontrol", *args))
    exe = shutil.which("scontrol")
    if exe is None:
        fail(name, "scontrol is not on PATH (--live runs it; or give saved files)")
    conf = os.environ.get("SLURM_CONF")
    if conf and not os.path.isfile(conf):  # scontrol itself retries for a minute
        fail(name, f"SLURM_CONF={conf} is not a file")
    try:
        proc = subprocess.Popen(
            [exe, *args],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
    except OSError as err:
        fail(name, f"cannot run {exe}: {err.strerror}")
    out, err_b = bytearray(), bytearray()
    deadline = time.monotonic() + timeout
    problem = ""
    with selectors.DefaultSelector() as sel:
        assert proc.stdout is not None and proc.stderr is not None
        sel.register(proc.stdout, selectors.EVENT_READ, out)
        sel.register(proc.stderr, selectors.EVENT_READ, err_b)
        while sel.get_map() and not problem:
            left = deadline - time.monotonic()
            if left <= 0:
                problem = f"did not finish within {timeout:g} s"
                break
            for key, _ in sel.select(left):
                chunk = os.read(key.fd, 1 << 16)
                if not chunk:
                    sel.unregister(key.fileobj)
                    continue
                buf: bytearray = key.data
                buf += chunk
                if len(out) > MAX_INPUT_BYTES or len(err_b) > 1 << 20:
                    problem = f"printed more than {MAX_INPUT_BYTES} bytes"
    if problem:
        proc.kill()
    try:
        code = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        proc.kill()
        code = proc.wait()
        problem = problem or f"did not finish within {timeout:g} s"
    finally:
        proc.stdout.close()
        proc.stderr.close()
    if problem:
        fail(name, problem)
    if code != 0:
        first = next((ln for ln in err_b.decode(errors="replace").splitlines() if ln.strip()), "")
        fail(name, f"exit status {code}" + (f": {first.strip()[:200]}" if first else ""))
    try:
        return Source(out.decode("utf-8"), name)
    except UnicodeDecodeError as err:
        fail(name, f"output is not UTF-8 text: {err.reason}")


# --- scontrol show node -------------------------------------------------------

_KEY = re.compile(r"(?:^|(?<=\s))([A-Za-z][A-Za-z0-9_]*)=")
# Keys printed after Reason= (whose value is free text): scontrol's node printer order.
_AFTER_REASON = frozenset({"Comment", "Extra", "InstanceId", "InstanceType", "ReservationName"})


def _fields(record: str) -> dict[str, str]:
    out: dict[str, str] = {}
    keep: list[re.Match[str]] = []
    in_reason = False
    for m in _KEY.finditer(record):
        key = m.group(1)
        if in_reason and key not in _AFTER_REASON:
            continue
        keep.append(m)
        if key == "Reason":
            in_reason = True
    for i, m in enumerate(keep):
        end = keep[i + 1].start() if i + 1 < len(keep) else len(record)
        out.setdefault(m.group(1), record[m.end() : end].strip())
    return out


def _split_gres(value: str) -> list[str]:
    parts: list[str] = []
    depth = 0
    start = 0
    for i, ch in enumerate(value):
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(value[start:i])
            start = i + 1
    parts.append(value[start:])
    return [p for p in parts if p]


def parse_gres(value: str, where: str) -> tuple[int, str | None]:
    """GPU count and type of a ``Gres=`` value.

    Parameters
    ----------
    value : str
        The value, e.g. ``gpu:4``, ``gpu:h100:8(S:0-1)``, ``gpu:a:4,nic:1`` or ``(null)``.
    where : str
        ``FILE:LINE`` for error messages.

    Returns
    -------
    tuple of (int, str or None)
        The number of GPUs (summed over ``gpu`` entries) and the last GPU type named.

    Raises
    ------
    ntp_opt.model.files.InputError
        On a malformed ``gpu`` entry (``gpu::4``), or more GPUs than an instance
        may have nodes (:data:`ntp_opt.model.files.MAX_NODES`).
    """
    total = 0
    gpu_type: str | None = None
    if value in ("", "(null)"):
        return 0, None
    for entry in _split_gres(value):
        core = entry.split("(", 1)[0]
        fields = core.split(":")
        if fields[0] != "gpu":
            continue
        count = 1
        if len(fields) >= 2 and fields[-1].isdigit():
            digits = fields[-1]
            count = int(digits) if len(digits) <= 9 else MAX_NODES + 1
            tfields = fields[1:-1]
        else:
            tfields = fields[1:]
        if any(not f for f in tfields) or len(tfields) > 1:
            fail(where, f"malformed Gres entry {entry[:60]!r}")
        if tfields:
            gpu_type = tfields[0]
        total += count
        if total > MAX_NODES:
            fail(
                where,
                f"Gres {value[:60]!r} counts more GPUs than an instance may have nodes "
                f"({MAX_NODES})",
            )
    return total, gpu_type


def read_nodes(path: str | Path | Source) -> list[SlurmNode]:
    """Read ``scontrol show node --oneliner`` output (the multi-line form is accepted too).

    Parameters
    ----------
    path : str, Path or Source
        The saved output, or :func:`scontrol`'s.

    Returns
    -------
    list of SlurmNode
        In file order, each with its ``FILE:LINE``.

    Raises
    ------
    ntp_opt.model.files.InputError
        ``FILE:LINE: message`` for lines that are not node records, a node without
        ``State=``, a malformed ``Gres=``, or a node listed twice.
    """
    text, src = read_text(path if isinstance(path, Source) else Path(path))
    records: list[tuple[int, list[str]]] = []
    for no, raw in enumerate(text.splitlines(), 1):
        if not raw.strip():
            continue
        if raw[:1].isspace() and records:
            records[-1][1].append(raw.strip())  # a list: joined once, linear in the input
        elif raw.startswith("NodeName="):
            records.append((no, [raw.strip()]))
        else:
            fail(f"{src}:{no}", f"expected a NodeName=... record, got {raw.strip()[:60]!r}")
    if not records:
        fail(src, "no NodeName= record")
    out: list[SlurmNode] = []
    seen: dict[str, str] = {}
    for no, parts in records:
        where = f"{src}:{no}"
        f = _fields(" ".join(parts))
        name = f.get("NodeName", "")
        if not name or " " in name or len(name) > 255:
            fail(where, f"bad NodeName {name[:60]!r}")
        if name in seen:
            fail(where, f"node {name} listed twice (first at {seen[name]})")
        seen[name] = where
        if "State" not in f or not f["State"]:
            fail(where, f"node {name} has no State=")
        gpus, gpu_type = parse_gres(f.get("Gres", "(null)"), where)
        hostname = f.get("NodeHostName") or None
        out.append(
            SlurmNode(name, hostname, gpus, gpu_type, f["State"], f.get("Reason", ""), where)
        )
    return out
