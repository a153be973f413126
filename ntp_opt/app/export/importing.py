"""Reading a Megatron-LM NTP export back into a plan: :func:`import_megatron`."""

from __future__ import annotations

import ast
import json
import math
import os
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ntp_opt.app.export.names import (
    COLUMNS,
    CONFIG_NAME,
    EXTRAS_FORMAT,
    EXTRAS_NAME,
    RANK_ORDER,
    RANKS_NAME,
)
from ntp_opt.model.files import InputError
from ntp_opt.model.instance import Instance
from ntp_opt.model.plan import Plan, Replica, Stage


def read_config_module(path: str | os.PathLike[str]) -> dict[str, Any]:
    """``NTP_CONFIG_KWARGS`` of an ``ntp_config.py``, read without running it.

    Raises
    ------
    InputError
        When the file is missing, not Python, or has no literal ``NTP_CONFIG_KWARGS``.
    """
    source = str(path)
    try:
        tree = ast.parse(Path(path).read_text())
    except (OSError, UnicodeDecodeError, SyntaxError, ValueError) as err:
        raise InputError(source, [("", f"cannot read file: {err}")]) from None
    for node in tree.body:
        if (
            isinstance(node, ast.Assign)
            and len(node.targets) == 1
            and isinstance(node.targets[0], ast.Name)
            and node.targets[0].id == "NTP_CONFIG_KWARGS"
        ):
            try:
                value = ast.literal_eval(node.value)
            except ValueError as err:
                raise InputError(source, [("NTP_CONFIG_KWARGS", f"not a literal: {err}")]) from None
            if isinstance(value, dict):
                return value
    raise InputError(source, [("NTP_CONFIG_KWARGS", "missing (not an ntp-opt export)")])


def _parse_rank_file(text: str, source: str) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    problems: list[tuple[str, str]] = []
    for n, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        cells = line.split()
        if len(cells) != len(COLUMNS):
            problems.append((f"line {n}", f"{len(cells)} columns, expected {len(COLUMNS)}"))
            continue
        row: dict[str, Any] = dict(zip(COLUMNS, cells, strict=True))
        try:
            for c in ("rank", "device", "dp", "pp", "tp", "active"):
                row[c] = int(row[c])
            row["power"] = None if row["power"] == "-" else float(row["power"])
        except ValueError as err:
            problems.append((f"line {n}", f"not a number: {err}"))
            continue
        if row["active"] not in (0, 1):
            problems.append((f"line {n}", f"active must be 0 or 1, got {row['active']}"))
        if row["active"] and (
            row["power"] is None or not math.isfinite(row["power"]) or row["gpu"] == "-"
        ):
            problems.append((f"line {n}", "an active rank needs a GPU and a finite power"))
        row["line"] = n
        rows.append(row)
    if problems:
        raise InputError(source, problems)
    return rows


def import_megatron(path: str | os.PathLike[str], instance: Instance | None = None) -> Plan:
    """Rebuild a plan's replicas from an export (:func:`export_megatron`).

    Replica ``dp`` takes the sidecar's ``local_batch``; its stage ``pp`` takes
    the active ranks of ``(dp, pp)`` in local-rank order, their domain and
    power multiplier. Checked on the way: the rank numbering (``tp + tp_base
    (pp + PP dp)``), one row per rank, every TP group complete, the active
    ranks agreeing with ``ntp_config.py`` (the keys of
    ``non_active_ranks_per_dp`` and ``num_reduced_tp_dp_ranks = PP x reduced
    replicas``), one degree per replica, one domain and one power per stage.

    Parameters
    ----------
    path
        The export directory.
    instance
        The instance, to map node ids back to their type (a GPU id ``5``
        stays an integer); without it every id is a string.

    Returns
    -------
    Plan
        Metrics ``{"policy": "megatron-import"}``; judge it with
        :func:`ntp_opt.rules.validate.evaluate`.

    Raises
    ------
    InputError
        Naming the file and the line or field of every inconsistency.
    """
    p = Path(path)
    extras_path = p / EXTRAS_NAME if p.is_dir() else p
    out_dir = extras_path.parent
    source = str(extras_path)
    extras = _read_sidecar(extras_path)
    csource = str(out_dir / CONFIG_NAME)
    big_t, spares, n_blocks, non_active = _config_fields(
        read_config_module(out_dir / CONFIG_NAME), csource
    )
    n_pp, n_dp, batch, name = _sidecar_fields(extras, source, big_t)
    ranks_path = out_dir / RANKS_NAME
    try:
        text = ranks_path.read_text()
    except (OSError, UnicodeDecodeError) as err:
        raise InputError(str(ranks_path), [("", f"cannot read file: {err}")]) from None
    rsource = str(ranks_path)
    groups = _rank_groups(_parse_rank_file(text, rsource), n_dp, n_pp, big_t, rsource)
    n_reduced = len({dp for dp, _, _ in non_active})
    if n_blocks != n_reduced * n_pp:
        raise InputError(
            csource,
            [
                (
                    "num_reduced_tp_dp_ranks",
                    f"{n_blocks}, expected PP {n_pp} x {n_reduced} reduced replicas",
                )
            ],
        )
    problems: list[tuple[str, str]] = []
    node = _node_ids(instance, problems)
    replicas = [
        _imported_replica(
            [groups[(dp, pp)] for pp in range(n_pp)],
            dp,
            [non_active.get((dp, 0, pp), []) for pp in range(n_pp)],
            spares if dp < n_reduced else None,
            batch,
            node,
            problems,
        )
        for dp in range(n_dp)
    ]
    if problems:
        raise InputError(rsource, problems)
    return Plan(name, tuple(replicas), {"policy": "megatron-import"})


def _config_fields(
    kw: dict[str, Any], csource: str
) -> tuple[int, int, int, dict[tuple[int, int, int], list[int]]]:
    """``tp_base``, ``tp_spares``, ``num_reduced_tp_dp_ranks``, ``non_active_ranks_per_dp``."""
    try:
        big_t = int(kw["tp_base"])
        spares = int(kw["tp_spares"])
        n_blocks = int(kw["num_reduced_tp_dp_ranks"])
        non_active = {
            (int(key[0]), int(key[1]), int(key[2])): [int(x) for x in v]
            for key, v in (kw.get("non_active_ranks_per_dp") or {}).items()
        }
    except (KeyError, TypeError, ValueError, IndexError) as err:
        raise InputError(csource, [("", f"missing or malformed field: {err!r}")]) from None
    return big_t, spares, n_blocks, non_active


def _sidecar_fields(extras: dict[str, Any], source: str, big_t: int) -> tuple[int, int, int, str]:
    """PP, DP, the local batch and the instance name of the sidecar (its TP is ``big_t``)."""
    try:
        n_pp = int(extras["pipeline_model_parallel_size"])
        n_dp = int(extras["data_parallel_size"])
        batch = int(extras["local_batch"])
        name = str(extras["instance"])
    except (KeyError, TypeError, ValueError) as err:
        raise InputError(source, [("", f"missing or malformed field: {err!r}")]) from None
    if int(extras.get("tensor_model_parallel_size", big_t)) != big_t:
        raise InputError(source, [("tensor_model_parallel_size", f"differs from tp_base {big_t}")])
    return n_pp, n_dp, batch, name


def _imported_replica(
    groups: list[dict[int, dict[str, Any]]],
    dp: int,
    non_active: list[list[int]],
    spares: int | None,
    batch: int,
    node: Callable[[str, str], Hashable],
    problems: list[tuple[str, str]],
) -> Replica:
    """DP rank ``dp`` as a replica: its stages' rank groups checked against the config.

    ``groups`` and ``non_active`` are per PP rank; ``spares`` is ``tp_spares``
    for a reduced replica (``None`` otherwise). Disagreements go to ``problems``.
    """
    stages: list[Stage] = []
    degree = None
    for pp, (group, want) in enumerate(zip(groups, non_active, strict=True)):
        inactive = sorted(tp for tp, row in group.items() if not row["active"])
        if spares is not None and len(want) != spares:
            problems.append((f"dp={dp} pp={pp}", f"{len(want)} inactive, tp_spares {spares}"))
        if inactive != sorted(want):
            problems.append(
                (f"dp={dp} pp={pp}", f"inactive local ranks {inactive}, config says {want}")
            )
        active = [group[tp] for tp in sorted(group) if group[tp]["active"]]
        if degree is None:
            degree = len(active)
        elif len(active) != degree:
            problems.append(
                (f"dp={dp} pp={pp}", f"{len(active)} active ranks, stage 0 has {degree}")
            )
        stage = _imported_stage(active, dp, pp, node, problems)
        if stage is not None:
            stages.append(stage)
    return Replica(int(degree or 0), batch, tuple(stages))


def _read_sidecar(extras_path: Path) -> dict[str, Any]:
    """The export's sidecar JSON, checked to be of :data:`EXTRAS_FORMAT`."""
    source = str(extras_path)
    try:
        extras = json.loads(extras_path.read_text())
    except (OSError, UnicodeDecodeError) as err:
        raise InputError(source, [("", f"cannot read file: {err}")]) from None
    except json.JSONDecodeError as err:
        raise InputError(source, [("", f"malformed JSON: {err}")]) from None
    if not isinstance(extras, dict) or extras.get("format") != EXTRAS_FORMAT:
        got = extras.get("format") if isinstance(extras, dict) else type(extras).__name__
        raise InputError(source, [("format", f"expected {EXTRAS_FORMAT!r}, got {got!r}")])
    return extras


def _rank_groups(
    rows: list[dict[str, Any]], n_dp: int, n_pp: int, big_t: int, rsource: str
) -> dict[tuple[int, int], dict[int, dict[str, Any]]]:
    """The rank file's rows by ``(dp, pp)`` and local rank, once the numbering checks out."""
    world = n_dp * n_pp * big_t
    problems: list[tuple[str, str]] = []
    if len(rows) != world:
        problems.append(("", f"{len(rows)} ranks, the world has {world}"))
    groups: dict[tuple[int, int], dict[int, dict[str, Any]]] = {}
    for row in rows:
        where = f"line {row['line']}"
        dp, pp, tp = row["dp"], row["pp"], row["tp"]
        if not (0 <= dp < n_dp and 0 <= pp < n_pp and 0 <= tp < big_t):
            problems.append((where, f"coordinates dp={dp} pp={pp} tp={tp} outside the world"))
            continue
        if row["rank"] != tp + big_t * (pp + n_pp * dp):
            problems.append(
                (where, f"rank {row['rank']} is not tp + tp_base * (pp + PP * dp) ({RANK_ORDER})")
            )
        group = groups.setdefault((dp, pp), {})
        if tp in group:
            problems.append((where, f"local rank {tp} of dp={dp} pp={pp} appears twice"))
        group[tp] = row
    if problems:
        raise InputError(rsource, problems)
    return groups


def _node_ids(
    instance: Instance | None, problems: list[tuple[str, str]]
) -> Callable[[str, str], Hashable]:
    """Maps a node id as written back to the instance's id (unknown ones go to ``problems``)."""
    ids: dict[str, Hashable] = {}
    if instance is not None:
        a = instance.arrays
        ids = {str(x): x for x in (*a.gpu_ids, *a.domain_ids)}
    return _NodeIds(instance, ids, problems)


@dataclass(frozen=True)
class _NodeIds:
    """A node id as written -> the instance's id; unknown ones go to ``problems``."""

    instance: Instance | None
    ids: dict[str, Hashable]
    problems: list[tuple[str, str]]

    def __call__(self, text: str, where: str) -> Hashable:
        """The id ``text`` (read at ``where``) stands for."""
        if self.instance is None:
            return text
        if text not in self.ids:
            self.problems.append(
                (where, f"{text!r} is not a GPU or domain of {self.instance.name!r}")
            )
        return self.ids.get(text, text)


def _imported_stage(
    active: list[dict[str, Any]],
    dp: int,
    pp: int,
    node: Callable[[str, str], Hashable],
    problems: list[tuple[str, str]],
) -> Stage | None:
    """The stage of the active rows of ``(dp, pp)``; None (and a problem) if they disagree."""
    domains = {row["domain"] for row in active}
    powers = {row["power"] for row in active}
    if len(domains) != 1 or len(powers) != 1:
        problems.append(
            (
                f"dp={dp} pp={pp}",
                f"active ranks span domains {sorted(domains)} or "
                f"powers {sorted(powers)}; a stage has one of each",
            )
        )
        return None
    where = f"line {active[0]['line']}"
    return Stage(
        node(active[0]["domain"], where),
        tuple(node(row["gpu"], f"line {row['line']}") for row in active),
        float(active[0]["power"]),
    )
