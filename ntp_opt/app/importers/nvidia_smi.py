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
references).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from ntp_opt.app.importers.compose import Host, SmiGpu, SmiHost, Warn, fail

__all__ = ["MAX_XML_BYTES", "read_dir", "read_xml"]

MAX_XML_BYTES = 64 * 1024**2
_WATTS = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?)\s*W\s*$")
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
        if m is None or float(m.group(1)) <= 0:
            fail(src, f"expected a power like '700.00 W', got {t!r}", f"{xpath}/{tag}")
        return float(m.group(1))
    return None


def _count(t: str | None) -> int:
    if t is None:
        return 0
    try:
        return int(t)
    except ValueError:
        return 0


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
    ntp_opt.files.InputError
        ``FILE: XPATH: message`` for malformed XML, a root that is not
        ``nvidia_smi_log``, bad power values, or a max limit below the default.
    """
    try:
        import defusedxml.ElementTree as DET
        from defusedxml import DefusedXmlException
    except ImportError:  # pragma: no cover - the [import] extra
        raise ValueError(
            "reading nvidia-smi XML needs defusedxml: pip install 'ntp-opt[import]'"
        ) from None

    p = Path(path)
    src = str(p)
    try:
        size = p.stat().st_size
        if size > MAX_XML_BYTES:
            fail(src, f"file is {size} bytes, more than {MAX_XML_BYTES}")
        root = DET.parse(str(p)).getroot()
    except DefusedXmlException as err:
        fail(src, f"refused XML construct: {err}")
    except DET.ParseError as err:
        fail(src, f"malformed XML: {err}")
    except OSError as err:
        fail(src, f"cannot read file: {err.strerror}")
    if root.tag != "nvidia_smi_log":
        fail(src, f"root element is <{root.tag}>, not <nvidia_smi_log> (nvidia-smi -q -x output)")
    gpus: list[SmiGpu] = []
    capped: list[tuple[int, float, float]] = []
    for pos, g in enumerate(root.findall("gpu"), 1):
        xpath = f"/nvidia_smi_log/gpu[{pos}]"
        minor = _text(g, "minor_number")
        if minor is None:
            index = pos - 1
        elif minor.isdigit():
            index = int(minor)
        else:
            fail(src, f"minor_number {minor!r} is not a number", f"{xpath}/minor_number")
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
        clique = None
        fab = g.find("fabric")
        if fab is not None:
            cu, ci = _text(fab, "clusterUuid"), _text(fab, "cliqueId")
            if cu is not None and ci is not None and not _ZERO_UUID.match(cu):
                clique = f"{cu}.{ci}"
        gpus.append(
            SmiGpu(
                index=index,
                uuid=_text(g, "uuid"),
                product=_text(g, "product_name"),
                tdp_w=tdp,
                max_power_w=mx,
                clique=clique,
                where=src,
                field=xpath,
                failed=_health(g),
            )
        )
    return SmiHost(src, gpus, capped=[(c, d) for _, c, d in capped])


def read_dir(
    directory: str | Path,
    hosts: list[Host],
    *,
    warn: Warn | None = None,
    left_out: frozenset[str] = frozenset(),
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

    Returns
    -------
    dict of str to SmiHost
        By the scheduler's host name.

    Raises
    ------
    ntp_opt.files.InputError
        For a file whose stem is no known host (or alias), two files for one host,
        or a GPU UUID found in two files (one of them is from another host).
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
    if not files:
        fail(str(d), "no *.xml file (expected one nvidia-smi -q -x file per host)")
    skipped: list[str] = []
    for f in files:
        host = names.get(f.stem)
        if host is None and f.stem in left_out:
            skipped.append(f.name)
            continue
        if host is None:
            fail(str(f), f"file for unknown host {f.stem!r}: not in the scheduler's topology")
        if host in out:
            fail(str(f), f"second file for host {host} (first: {out[host].path})")
        data = read_xml(f)
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
        out[host] = data
    if skipped and warn is not None:
        warn(
            f"{d}: skipped {len(skipped)} file(s) of hosts outside the topology: "
            + ", ".join(skipped)
        )
    capped = [(h, c) for h, data in out.items() for c in data.capped]
    if capped and warn is not None:
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
    return out
