"""``nvidia-smi -q -x`` output, one file per host: UUIDs, power limits, fabric clique, health.

The element names are those of the driver's ``nvsmi_device_v12.dtd`` output
(``<nvidia_smi_log><gpu id="...">``): ``uuid``, ``minor_number``,
``product_name``; ``gpu_power_readings`` (older drivers: ``power_readings``)
with ``default_power_limit``, ``current_power_limit`` (older:
``enforced_power_limit``), ``min_power_limit``, ``max_power_limit``, values
like ``700.00 W``; ``fabric`` with ``state``, ``status``, ``cliqueId``,
``clusterUuid``; ``ecc_errors/volatile`` and ``ecc_errors/aggregate``
(``*uncorrectable*`` counters; older drivers ``double_bit/total``);
``retired_pages/pending_retirement`` and ``pending_blacklist``;
``remapped_rows/remapped_row_failure``; ``gpu_recovery_action``.

Mapping, per GPU:

* ``index`` = ``minor_number`` (``/dev/nvidia<N>``; the position in the file when
  it is N/A); GPU id ``<host>:gpu<index>``; ``uuid`` kept.
* ``tdp_w`` = the default power limit, or the current (enforced) limit when an
  operator set it lower: the limit the board runs at unboosted. A current
  limit above the default (e.g. a boost applied earlier) is not taken as
  nominal. ``max_power_w`` = the max power limit.
* failed when: retired pages pending, a remapped-row failure, any uncorrectable
  ECC error (volatile or aggregate), a recovery action other than None, or a
  fabric registration that completed without success.
* fabric clique ``<clusterUuid>.<cliqueId>`` (absent when N/A or all zeros) must
  agree with the scheduler's NVLink domain.

The files are parsed with :mod:`defusedxml` (no entity expansion, no external
references), after checks that bound time and memory: a regular file (a FIFO
or device is refused before it is opened), at most :data:`MAX_XML_BYTES` and
:data:`MAX_XML_TAGS`, at most
:data:`~ntp_opt.app.importers.compose.MAX_GPUS_PER_HOST` ``<gpu>`` elements.
Values are range-checked on the way in (``minor_number``, UUID, power
limits), naming the file, the GPU and the field.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from ntp_opt.app.importers.compose import (
    MAX_GPUS_PER_HOST,
    MAX_WATTS,
    Host,
    SmiGpu,
    SmiHost,
    UnreadableInput,
    Warn,
    fail,
    read_capped,
    show,
)

__all__ = ["MAX_XML_BYTES", "MAX_XML_TAGS", "XmlCache", "read_dir", "read_xml"]

#: Largest nvidia-smi -q -x file accepted: an 8-GPU host writes 100-300 KB.
MAX_XML_BYTES = 16 * 1024**2
#: Most tags (``<`` bytes) accepted in one file: a real 8-GPU file has about 10,000;
#: the cap bounds the parser's memory (about 100 MB at the cap) whatever the elements.
MAX_XML_TAGS = 1_000_000
#: Largest device minor number accepted (the instance schema's bound on ``index``).
MAX_MINOR = 1_000_000
_WATTS = re.compile(r"^\s*([0-9]{1,12}(?:\.[0-9]{0,12})?)\s*W\s*$")
_GPU_TAG = re.compile(rb"<gpu[\s/>]")
_MAX_UUID = 200  # the instance schema's bound; characters are checked by the exports
_NA = ("n/a", "[n/a]", "not supported", "[not supported]", "unknown error", "")
_ZERO_UUID = re.compile(r"^[0-]+$")


def _text(el: Any, path: str) -> str | None:
    node = el.find(path)
    if node is None or node.text is None:
        return None
    t = node.text.strip()
    return None if t.lower() in _NA else t


def _watts(el: Any, tags: Iterable[str], src: str, xpath: str) -> float | None:
    for tag in tags:
        node = el.find(tag)
        if node is None:
            continue
        t = (node.text or "").strip()
        if t.lower() in _NA:
            return None
        m = _WATTS.match(t)
        if m is None:
            fail(src, f"expected a power like '700.00 W', got {show(t)}", f"{xpath}/{tag}")
        w = float(m.group(1))
        if not 1.0 <= w <= MAX_WATTS:
            fail(src, f"power {t} out of range (1 to {MAX_WATTS:g} W)", f"{xpath}/{tag}")
        return w
    return None


def _count(t: str | None) -> int:
    """An error counter (0 when N/A or not a number; huge counts are capped, never lost)."""
    if t is None or not t.isdigit() or not t.isascii():
        return 0
    return int(t) if len(t) <= 18 else 10**18


def _health(gpu: Any) -> list[str]:
    why: list[str] = []
    rp = gpu.find("retired_pages")
    if rp is not None:
        for tag in ("pending_retirement", "pending_blacklist"):
            if (_text(rp, tag) or "").lower() == "yes":
                why.append(f"retired pages pending ({tag})")
                break
    rr = gpu.find("remapped_rows")
    if rr is not None and (_text(rr, "remapped_row_failure") or "").lower() == "yes":
        why.append("row remapping failure")
    ecc = gpu.find("ecc_errors")
    if ecc is not None:
        for scope in ("volatile", "aggregate"):
            sc = ecc.find(scope)
            if sc is None:
                continue
            n = sum(_count(_text(sc, f"./{e.tag}")) for e in sc if "uncorrectable" in e.tag)
            n += _count(_text(sc, "double_bit/total"))
            if n > 0:
                why.append(f"{n} uncorrectable ECC error(s) ({scope})")
    action = _text(gpu, "gpu_recovery_action")
    if action is not None and action.lower() != "none":
        why.append(f"recovery action {action}")
    fab = gpu.find("fabric")
    if fab is not None:
        state, status = _text(fab, "state"), _text(fab, "status")
        if state is not None and state.lower() == "completed" and status is not None:
            if status.lower() != "success":
                why.append(f"NVLink fabric registration failed ({status})")
    return why


def read_xml(path: str | Path) -> SmiHost:
    """Read one host's ``nvidia-smi -q -x`` file.

    Parameters
    ----------
    path : str or Path
        The file.

    Returns
    -------
    SmiHost
        Its GPUs in file order (index, UUID, product, limits, clique, health).

    Raises
    ------
    ntp_opt.app.importers.compose.UnreadableInput
        The file is empty or cannot be read.
    ntp_opt.model.files.InputError
        ``FILE: XPATH: message`` for a file that is not a regular file or is too
        large, malformed XML, a root that is not ``nvidia_smi_log``, too many
        GPUs, out-of-range values, or a max limit below the default.
    """
    src = str(Path(path))
    root = _parse(path, src)
    gpus: list[SmiGpu] = []
    capped: list[tuple[int, float, float]] = []
    for pos, g in enumerate(root.findall("gpu"), 1):
        gpus.append(_gpu(g, pos, src, capped))
    return SmiHost(src, gpus, capped=[(c, d) for _, c, d in capped])


def _parse(path: str | Path, src: str) -> Any:
    """The ``<nvidia_smi_log>`` root of a file, refusing too many tags or GPUs and bad XML."""
    try:
        import defusedxml.ElementTree as DET
        from defusedxml import DefusedXmlException
    except ImportError:  # pragma: no cover - the [import] extra
        raise ValueError(
            "reading nvidia-smi XML needs defusedxml: pip install 'ntp-opt[import]'"
        ) from None

    raw = read_capped(path, MAX_XML_BYTES, " (nvidia-smi -q -x of an 8-GPU host: 100-300 KB)")
    tags = raw.count(b"<")
    if tags > MAX_XML_TAGS:
        fail(src, f"{tags} tags, more than {MAX_XML_TAGS} (a real file has about 10,000)")
    n_gpus = len(_GPU_TAG.findall(raw))
    if n_gpus > MAX_GPUS_PER_HOST:
        fail(src, f"{n_gpus} <gpu> elements, more than {MAX_GPUS_PER_HOST}")
    try:
        root = DET.fromstring(raw)
    except DefusedXmlException as err:
        fail(src, f"refused XML construct: {err}")
    except DET.ParseError as err:
        fail(src, f"malformed XML: {err}")
    if root.tag != "nvidia_smi_log":
        fail(src, f"root element is <{root.tag}>, not <nvidia_smi_log> (nvidia-smi -q -x output)")
    return root


def _gpu(g: Any, pos: int, src: str, capped: list[tuple[int, float, float]]) -> SmiGpu:
    """The ``pos``-th ``<gpu>`` element; a limit capped below the default goes to ``capped``."""
    xpath = f"/nvidia_smi_log/gpu[{pos}]"
    minor = _text(g, "minor_number")
    if minor is None:
        index = pos - 1
    elif minor.isascii() and minor.isdigit() and len(minor) <= 7 and int(minor) <= MAX_MINOR:
        index = int(minor)
    else:
        fail(
            src,
            f"minor_number {show(minor)} is not a device number (0 to {MAX_MINOR})",
            f"{xpath}/minor_number",
        )
    uuid = _text(g, "uuid")
    if uuid is not None and len(uuid) > _MAX_UUID:
        fail(
            src,
            f"GPU {pos}: uuid of {len(uuid)} characters, more than {_MAX_UUID}",
            f"{xpath}/uuid",
        )
    product = _text(g, "product_name")
    if product is not None and len(product) > 200:
        fail(src, f"GPU {pos}: product_name longer than 200 characters", f"{xpath}/product_name")
    tdp, mx = _limits(g, index, src, xpath, capped)
    clique = None
    fab = g.find("fabric")
    if fab is not None:
        cu, ci = _text(fab, "clusterUuid"), _text(fab, "cliqueId")
        if cu is not None and ci is not None and not _ZERO_UUID.match(cu):
            clique = f"{cu}.{ci}"
    return SmiGpu(
        index=index,
        uuid=uuid,
        product=product,
        tdp_w=tdp,
        max_power_w=mx,
        clique=clique,
        where=src,
        field=xpath,
        failed=_health(g),
    )


def _limits(
    g: Any, index: int, src: str, xpath: str, capped: list[tuple[int, float, float]]
) -> tuple[float | None, float | None]:
    """``(tdp_w, max_power_w)`` of a ``<gpu>``: its default (or lower current) and max limits."""
    pr = g.find("gpu_power_readings")
    if pr is None:
        pr = g.find("power_readings")
    tdp = mx = None
    if pr is not None:
        pxp = f"{xpath}/{pr.tag}"
        default = _watts(pr, ("default_power_limit",), src, pxp)
        current = _watts(
            pr, ("current_power_limit", "enforced_power_limit", "power_limit"), src, pxp
        )
        mx = _watts(pr, ("max_power_limit",), src, pxp)
        tdp = default
        if default is not None and current is not None and current < default:
            tdp = current
            capped.append((index, current, default))
        if tdp is None:
            mx = None
        elif mx is not None and mx < tdp:
            fail(
                src,
                f"max power limit {mx:g} W is below the default limit {tdp:g} W",
                f"{pxp}/max_power_limit",
            )
    return tdp, mx


class XmlCache:
    """Parsed ``nvidia-smi -q -x`` files, re-read only when they change (``ntp-opt watch``).

    A file's result is kept under its path with its identity and state as
    ``stat`` gives them (device, inode, size, modification time in
    nanoseconds) and reused while these are the same. A file rewritten in
    place, renamed over, touched, or turned into something else (a FIFO, a
    directory) is read again by :func:`read_xml`, with all of its checks; so is
    a file that could not be read or was refused (only results are kept).
    :func:`read_dir` drops the entries of files no longer in the directory.

    A rewrite that keeps the size and the nanosecond modification time (a
    file system with coarse timestamps written twice within one tick) is
    not seen; writers that rename a new file over the old one (another inode)
    always are.
    """

    def __init__(self) -> None:
        self._entries: dict[str, tuple[tuple[int, int, int, int], SmiHost]] = {}

    def read(self, path: str | Path) -> SmiHost:
        """``read_xml(path)``, or its result of an earlier call if the file is unchanged.

        Parameters
        ----------
        path : str or Path
            The file.

        Returns
        -------
        SmiHost
            As :func:`read_xml` (the same object while the file is unchanged:
            callers must not modify it).

        Raises
        ------
        ntp_opt.app.importers.compose.UnreadableInput, ntp_opt.model.files.InputError
            As :func:`read_xml`.
        """
        src = str(path)
        hit = self._entries.pop(src, None)
        try:
            st = os.stat(path)
        except OSError:
            return read_xml(path)  # raises UnreadableInput, naming the file
        # a FIFO, device or directory put in its place is another inode: read_xml refuses it
        key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
        if hit is not None and hit[0] == key:
            self._entries[src] = hit
            return hit[1]
        data = read_xml(path)
        self._entries[src] = (key, data)
        return data

    def keep_only(self, paths: Iterable[str | Path]) -> None:
        """Forget every file but ``paths`` (those still in the directory)."""
        keep = {str(p) for p in paths}
        for src in [s for s in self._entries if s not in keep]:
            del self._entries[src]

    def __len__(self) -> int:
        return len(self._entries)


def read_dir(
    directory: str | Path,
    hosts: list[Host],
    *,
    warn: Warn | None = None,
    left_out: frozenset[str] = frozenset(),
    cache: XmlCache | None = None,
) -> dict[str, SmiHost]:
    """Read every ``<host>.xml`` of a directory, keyed by the scheduler's host name.

    Parameters
    ----------
    directory : str or Path
        Directory of ``<host>.xml`` files (the stem may also be a host's alias).
    hosts : list of Host
        The scheduler's hosts.
    warn : callable, optional
        Receives one message per warning.
    left_out : frozenset of str
        Hosts known to the scheduler but outside the NVLink topology (login nodes):
        their files are skipped with a warning.
    cache : XmlCache, optional
        Reuse the parse of each file unchanged since the last call (the directory
        is listed again every call: new and removed files are seen).

    Returns
    -------
    dict of str to SmiHost
        By the scheduler's host name.

    Raises
    ------
    ntp_opt.model.files.InputError
        For a file whose stem is no known host (or alias), two files for one host,
        a GPU UUID found in two files (one of them is from another host), or an
        empty or unreadable file for a host the scheduler reports usable (for a
        host it reports unusable, that is a warning and the file is ignored).
    """
    d = Path(directory)
    if not d.is_dir():
        fail(str(d), "not a directory (--nvidia-smi takes a directory of <host>.xml files)")
    names = {h.name: h.name for h in hosts}
    for h in hosts:
        for a in h.aliases:
            names.setdefault(a, h.name)
    out: dict[str, SmiHost] = {}
    uuid_at: dict[str, str] = {}
    files = sorted(p for p in d.iterdir() if p.suffix.lower() == ".xml")
    if cache is not None:
        cache.keep_only(files)
    if not files:
        fail(str(d), "no *.xml file (expected one nvidia-smi -q -x file per host)")
    skipped: list[str] = []
    by_name = {h.name: h for h in hosts}
    for f in files:
        host = names.get(f.stem)
        if host is None and f.stem in left_out:
            skipped.append(f.name)
            continue
        if host is None:
            fail(str(f), f"file for unknown host {f.stem!r}: not in the scheduler's topology")
        if host in out:
            fail(str(f), f"second file for host {host} (first: {out[host].path})")
        data = _host_file(f, by_name[host], warn, cache)
        if data is None:
            continue
        _check_uuids(f, data, uuid_at)
        out[host] = data
    if skipped and warn is not None:
        warn(
            f"{d}: skipped {len(skipped)} file(s) of hosts outside the topology: "
            + ", ".join(skipped)
        )
    if warn is not None:
        _warn_capped(d, out, warn)
    return out


def _check_uuids(f: Path, data: SmiHost, uuid_at: dict[str, str]) -> None:
    """Refuse a GPU UUID already seen in another file; note those of ``f`` in ``uuid_at``."""
    for g in data.gpus:
        if g.uuid is None:
            continue
        if g.uuid in uuid_at:
            fail(
                str(f),
                f"GPU {g.uuid} is also in {uuid_at[g.uuid]}: one of the two files is "
                "from another host",
                g.field + "/uuid",
            )
        uuid_at[g.uuid] = str(f)


def _host_file(f: Path, h: Host, warn: Warn | None, cache: XmlCache | None) -> SmiHost | None:
    """The file of host ``h``; ``None`` for an unreadable file of a failed host (a warning)."""
    try:
        return read_xml(f) if cache is None else cache.read(f)
    except UnreadableInput as err:
        why = err.problems[0][1]
        if h.failed_reason is None:
            fail(
                str(f),
                f"{why}, but host {h.name} is usable ({h.where}): run nvidia-smi -q -x on "
                f"{h.name} again and rewrite the file, or remove the file (its GPUs then "
                "take the hardware table's limits or --tdp-w)",
            )
        if warn is not None:
            warn(f"{f}: {why}; ignored: host {h.name} is {h.failed_reason}, its GPUs are failed")
        return None


def _warn_capped(d: Path, out: dict[str, SmiHost], warn: Warn) -> None:
    """One warning for the GPUs run at an operator-set limit below their default."""
    capped = [(h, c) for h, data in out.items() for c in data.capped]
    if capped:
        limits = ", ".join(
            f"{c:g} W (default {dflt:g} W)" for c, dflt in sorted({c for _, c in capped})
        )
        hosts_capped = sorted({h for h, _ in capped})
        shown = ", ".join(hosts_capped[:3]) + (" ..." if len(hosts_capped) > 3 else "")
        warn(
            f"{d}: {len(capped)} GPU(s) on {len(hosts_capped)} host(s) ({shown}) run at an "
            f"operator-set power limit below their default: {limits}; that limit is their "
            "tdp_w, their max power limit bounds the boost"
        )
