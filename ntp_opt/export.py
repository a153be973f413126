"""Export a plan to Megatron-LM's nonuniform TP runtime, and read the export back.

:func:`megatron_config` turns a validated plan into the configuration of
``megatron/core/distributed/nonuniform_tp.py`` (``NonuniformTPConfig``:
``tp_base``, ``tp_spares``, ``num_reduced_tp_dp_ranks``,
``non_active_ranks_per_dp``) plus the launch geometry; :func:`rank_table`
gives the rank-to-GPU ordering the launcher needs, one row per global rank;
:func:`export_megatron` writes both (``megatron-ntp.json`` and ``ranks.txt``)
and :func:`import_megatron` rebuilds the plan's replicas from them.

Rank order is Megatron's default ``tp-cp-ep-dp-pp`` with no context or expert
parallelism: global rank ``= tp + tp_base * (dp + DP * pp)``. Replica ``r`` of
the plan is DP rank ``r`` (reduced replicas first), stage ``k`` is PP rank
``k``, and the stage's GPUs, in plan order, are its active local TP ranks
``0 .. t-1``; local ranks ``t .. tp_base-1`` of a reduced replica are inactive
(Megatron's default when ``non_active_ranks_per_dp`` is left out, written out
anyway). Inactive ranks are launched and exit once the process groups exist;
each takes a GPU slot the plan leaves unused (see ``docs/export.md``).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Hashable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .files import InputError, _read_json, _write_json
from .instance import Instance
from .megatron import MegatronError, megatron_compatible, megatron_order
from .plan import Plan, Replica, Stage
from .safeio import atomic_write, check_target
from .validate import check

#: ``format`` field of the configuration file.
MEGATRON_FORMAT = "ntp-opt/megatron-ntp@1"
#: Megatron-LM's rank order (``initialize_model_parallel(order=...)``) the export follows.
RANK_ORDER = "tp-cp-ep-dp-pp"
#: File names written by :func:`export_megatron`.
CONFIG_NAME = "megatron-ntp.json"
RANKS_NAME = "ranks.txt"
#: Columns of the rank file, in order.
COLUMNS = ("rank", "host", "gpu", "domain", "local", "dp", "pp", "tp", "active", "power", "power_w")

__all__ = [
    "COLUMNS",
    "MEGATRON_FORMAT",
    "MegatronError",
    "RankRow",
    "export_megatron",
    "import_megatron",
    "megatron_compatible",
    "megatron_config",
    "megatron_order",
    "rank_table",
]


@dataclass(frozen=True)
class RankRow:
    """One global rank of the Megatron world.

    Attributes
    ----------
    rank
        Global rank.
    host
        Node id of the GPU's tray (the host the process runs on).
    gpu
        Node id of the GPU (for an inactive rank: the slot it is launched on).
    domain
        Node id of the GPU's NVLink domain.
    local
        Index of the GPU inside its tray, in graph order (``CUDA_VISIBLE_DEVICES``).
    dp, pp, tp
        Data-parallel, pipeline and local tensor-parallel rank.
    active
        The rank computes; inactive ranks exit after process-group set-up.
    power
        Power multiplier of an active rank (``None`` for inactive ranks).
    power_w
        Power limit in watts, ``tdp_w * power`` (``None`` for inactive ranks).
    """

    rank: int
    host: Hashable
    gpu: Hashable
    domain: Hashable
    local: int
    dp: int
    pp: int
    tp: int
    active: bool
    power: float | None
    power_w: float | None

    def line(self) -> str:
        """The row as one line of the rank file."""
        cells = [
            self.rank,
            self.host,
            self.gpu,
            self.domain,
            self.local,
            self.dp,
            self.pp,
            self.tp,
            int(self.active),
            "-" if self.power is None else repr(self.power),
            "-" if self.power_w is None else f"{self.power_w:.1f}",
        ]
        return " ".join(str(c) for c in cells)

    def as_dict(self) -> dict[str, Any]:
        """The row as a JSON object (keys :data:`COLUMNS`)."""
        return {c: getattr(self, c) for c in COLUMNS}


def _prepare(instance: Instance, plan: Plan, reorder: bool, uniform_batch: bool) -> Plan:
    """Check the plan against the model and the runtime; reorder if asked."""
    check(instance, plan)  # PlanError if the plan breaks a rule of the model
    if reorder:
        plan = megatron_order(plan, instance.job.tp)
    problems = megatron_compatible(instance, plan, uniform_batch=uniform_batch)
    if problems:
        raise MegatronError(problems)
    for node in (*instance.arrays.gpu_ids, *instance.arrays.tray_ids, *instance.arrays.domain_ids):
        if any(ch.isspace() for ch in str(node)) or not str(node):
            raise ValueError(
                f"node id {node!r} is empty or has whitespace: the rank file cannot carry it"
            )
    return plan


def _local_index(instance: Instance) -> np.ndarray:
    """Index of every GPU inside its tray, in graph order."""
    a = instance.arrays
    local = np.zeros(a.n_gpus, dtype=np.int64)
    count: dict[int, int] = {}
    for i, tray in enumerate(a.gpu_tray.tolist()):
        local[i] = count.get(tray, 0)
        count[tray] = local[i] + 1
    return local


def _rows(instance: Instance, plan: Plan) -> Iterator[RankRow]:
    """Every rank, in rank order, of a checked and compatible plan."""
    a = instance.arrays
    job = instance.job
    big_t, n_dp = job.tp, len(plan.replicas)
    local = _local_index(instance)
    used = np.zeros(a.n_gpus, dtype=bool)
    for g in plan.used_gpus():
        used[a.gpu_index[g]] = True
    free = ~used
    # Slots for inactive ranks: healthy unused GPUs of the stage's domain, then
    # healthy unused GPUs anywhere, then failed GPUs of the domain, then anywhere.
    by_domain = {
        d: (
            [int(i) for i in members if free[i] and a.healthy[i]],
            [int(i) for i in members if free[i] and not a.healthy[i]],
        )
        for d, members in enumerate(a.domain_gpus)
    }
    anywhere = (
        [int(i) for i in np.flatnonzero(free & a.healthy)],
        [int(i) for i in np.flatnonzero(free & ~a.healthy)],
    )
    taken = np.zeros(a.n_gpus, dtype=bool)
    cursor: dict[tuple[object, int], int] = {}

    def slot(d: int) -> int:
        for key, pool in (
            ((d, 0), by_domain[d][0]),
            (("*", 0), anywhere[0]),
            ((d, 1), by_domain[d][1]),
            (("*", 1), anywhere[1]),
        ):
            j = cursor.get(key, 0)
            while j < len(pool) and taken[pool[j]]:
                j += 1
            cursor[key] = j
            if j < len(pool):
                taken[pool[j]] = True
                return pool[j]
        raise AssertionError("megatron-slots was checked: a slot exists")  # pragma: no cover

    for k in range(job.pp):
        for r, rep in enumerate(plan.replicas):
            st = rep.stages[k]
            d = a.domain_index[st.domain]
            for j in range(big_t):
                active = j < rep.tp
                i = a.gpu_index[st.gpus[j]] if active else slot(d)
                yield RankRow(
                    rank=j + big_t * (r + n_dp * k),
                    host=a.tray_ids[a.gpu_tray[i]],
                    gpu=a.gpu_ids[i],
                    domain=st.domain if active else a.domain_ids[a.gpu_domain[i]],
                    local=int(local[i]),
                    dp=r,
                    pp=k,
                    tp=j,
                    active=active,
                    power=float(st.power) if active else None,
                    power_w=float(a.tdp[i] * st.power) if active else None,
                )


def rank_table(
    instance: Instance, plan: Plan, *, reorder: bool = False, uniform_batch: bool = False
) -> list[RankRow]:
    """The rank-to-GPU ordering of ``plan`` in Megatron's world, one row per rank.

    Parameters
    ----------
    instance
        The instance.
    plan
        A plan that passes the validator and :func:`megatron_compatible`.
    reorder
        Move reduced replicas first before checking (:func:`megatron_order`).
    uniform_batch
        Require one local batch for every replica.

    Returns
    -------
    list of RankRow
        In rank order (``rank`` = list index).

    Raises
    ------
    ntp_opt.validate.PlanError
        If the plan breaks a rule of the model.
    MegatronError
        If the runtime cannot run it; the message names every broken restriction.
    """
    plan = _prepare(instance, plan, reorder, uniform_batch)
    return sorted(_rows(instance, plan), key=lambda row: row.rank)


def megatron_config(
    instance: Instance, plan: Plan, *, reorder: bool = False, uniform_batch: bool = False
) -> dict[str, Any]:
    """The Megatron-LM NTP configuration that runs ``plan`` (JSON-ready).

    Parameters
    ----------
    instance
        The instance.
    plan
        A plan that passes the validator and :func:`megatron_compatible`.
    reorder
        Move reduced replicas first before checking (:func:`megatron_order`).
    uniform_batch
        Require one local batch for every replica.

    Returns
    -------
    dict
        ``format``, ``instance``, ``nonuniform_tp`` (the fields of
        ``NonuniformTPConfig``; ``non_active_ranks_per_dp`` keyed ``"dp,cp,pp"``),
        the launch geometry (``tensor_model_parallel_size``,
        ``pipeline_model_parallel_size``, ``data_parallel_size``,
        ``context_parallel_size``, ``world_size``, ``rank_order``),
        ``tp_domain_sizes`` (active TP size per DP rank),
        ``local_batch_per_dp``, ``global_batch``, ``uniform_local_batch``,
        ``power_boost``, ``megatron_args`` (command-line flags of Megatron's
        opt-in NTP training entry point), ``rank_file`` and the plan's
        ``metrics``.

    Raises
    ------
    ntp_opt.validate.PlanError
        If the plan breaks a rule of the model.
    MegatronError
        If the runtime cannot run it; the message names every broken restriction.
    """
    plan = _prepare(instance, plan, reorder, uniform_batch)
    job = instance.job
    big_t, n_dp = job.tp, len(plan.replicas)
    reduced = [r for r in plan.replicas if r.tp < big_t]
    spares = big_t - reduced[0].tp if reduced else 0
    non_active = {
        f"{r},0,{k}": list(range(rep.tp, big_t))
        for r, rep in enumerate(plan.replicas)
        if rep.tp < big_t
        for k in range(job.pp)
    }
    batches = [int(r.local_batch) for r in plan.replicas]
    args: list[str] = [
        "--tensor-model-parallel-size",
        str(big_t),
        "--pipeline-model-parallel-size",
        str(job.pp),
        "--global-batch-size",
        str(sum(batches)),
    ]
    if spares:
        args += [
            "--nonuniform-mode",
            "tp",
            "--nonuniform-tp-base",
            str(big_t),
            "--nonuniform-tp-spares",
            str(spares),
            "--nonuniform-tp-num-reduced-dp-ranks",
            str(len(reduced)),
            "--nonuniform-tp-non-active-ranks-json",
            json.dumps(non_active, separators=(",", ":")),
        ]
    metrics = {
        k: v
        for k, v in plan.metrics.items()
        if isinstance(v, str | int | bool) or (isinstance(v, float) and math.isfinite(v))
    }
    return {
        "format": MEGATRON_FORMAT,
        "instance": plan.instance,
        "nonuniform_tp": {
            "tp_base": big_t,
            "tp_spares": spares,
            "num_reduced_tp_dp_ranks": len(reduced),
            "non_active_ranks_per_dp": non_active,
        },
        "tensor_model_parallel_size": big_t,
        "pipeline_model_parallel_size": job.pp,
        "context_parallel_size": 1,
        "data_parallel_size": n_dp,
        "world_size": n_dp * job.pp * big_t,
        "rank_order": RANK_ORDER,
        "tp_domain_sizes": [r.tp for r in plan.replicas],
        "local_batch_per_dp": batches,
        "global_batch": sum(batches),
        "uniform_local_batch": len(set(batches)) == 1,
        "power_boost": any(st.power > 1.0 for r in plan.replicas for st in r.stages),
        "megatron_args": args,
        "rank_file": RANKS_NAME,
        "metrics": metrics,
    }


def rank_file_text(rows: list[RankRow]) -> str:
    """The rank file: a ``#`` header naming :data:`COLUMNS`, then one line per rank."""
    return "\n".join(["# " + " ".join(COLUMNS), *(row.line() for row in rows)]) + "\n"


def export_megatron(
    instance: Instance,
    plan: Plan,
    out_dir: str | os.PathLike[str],
    *,
    reorder: bool = False,
    uniform_batch: bool = False,
    inputs: Iterable[str | os.PathLike[str]] = (),
) -> tuple[Path, Path]:
    """Write ``megatron-ntp.json`` and ``ranks.txt`` for ``plan`` into ``out_dir``.

    Parameters
    ----------
    instance
        The instance.
    plan
        A plan that passes the validator and :func:`megatron_compatible`.
    out_dir
        Output directory (created if missing).
    reorder, uniform_batch
        As for :func:`megatron_config`.
    inputs
        Files the command read; neither output may be one of them. Both files
        are written by :func:`ntp_opt.safeio.atomic_write` (random ``O_EXCL``
        temporary names: a planted file or symlink is never followed).

    Returns
    -------
    tuple of Path
        The configuration file and the rank file.

    Raises
    ------
    ntp_opt.validate.PlanError, MegatronError
        As :func:`megatron_config`; nothing is written then.
    """
    config = megatron_config(instance, plan, reorder=reorder, uniform_batch=uniform_batch)
    rows = rank_table(instance, plan, reorder=reorder, uniform_batch=uniform_batch)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config_path, ranks_path = out / CONFIG_NAME, out / RANKS_NAME
    inputs = list(inputs)
    for target in (config_path, ranks_path):  # refuse before writing either file
        check_target(target, inputs)
    _write_json(config, config_path, inputs)
    atomic_write(ranks_path, rank_file_text(rows), inputs)
    return config_path, ranks_path


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
            for c in ("rank", "local", "dp", "pp", "tp", "active"):
                row[c] = int(row[c])
            row["power"] = None if row["power"] == "-" else float(row["power"])
        except ValueError as err:
            problems.append((f"line {n}", f"not a number: {err}"))
            continue
        if row["active"] not in (0, 1):
            problems.append((f"line {n}", f"active must be 0 or 1, got {row['active']}"))
        if row["active"] and (row["power"] is None or not math.isfinite(row["power"])):
            problems.append((f"line {n}", "an active rank needs a finite power multiplier"))
        row["line"] = n
        rows.append(row)
    if problems:
        raise InputError(source, problems)
    return rows


def import_megatron(path: str | os.PathLike[str], instance: Instance | None = None) -> Plan:
    """Rebuild a plan's replicas from an export (:func:`export_megatron`).

    Replica ``dp`` has the configuration's ``local_batch_per_dp[dp]``; its
    stage ``pp`` takes the active ranks of ``(dp, pp)`` in local-rank order,
    their domain and power multiplier. Checked on the way: the rank numbering
    (``tp + tp_base (dp + DP pp)``), one row per rank, every TP group complete,
    the active ranks agreeing with ``non_active_ranks_per_dp`` and
    ``num_reduced_tp_dp_ranks``, one degree per replica, one domain and one
    power per stage.

    Parameters
    ----------
    path
        The export directory (or its ``megatron-ntp.json``).
    instance
        The instance, to map node ids back to their type (a GPU id ``5``
        stays an integer); without it every id is a string.

    Returns
    -------
    Plan
        Metrics ``{"policy": "megatron-import"}``; judge it with
        :func:`ntp_opt.validate.evaluate`.

    Raises
    ------
    InputError
        Naming the file and the line or field of every inconsistency.
    """
    p = Path(path)
    config_path = p / CONFIG_NAME if p.is_dir() else p
    source = str(config_path)
    config = _read_json(config_path)  # the file rules: caps, UTF-8, no NaN or duplicate keys
    if not isinstance(config, dict) or config.get("format") != MEGATRON_FORMAT:
        got = config.get("format") if isinstance(config, dict) else type(config).__name__
        raise InputError(source, [("format", f"expected {MEGATRON_FORMAT!r}, got {got!r}")])
    try:
        ntp = config["nonuniform_tp"]
        big_t = int(ntp["tp_base"])
        spares = int(ntp["tp_spares"])
        n_reduced = int(ntp["num_reduced_tp_dp_ranks"])
        non_active = {
            tuple(int(x) for x in key.split(",")): [int(x) for x in v]
            for key, v in (ntp.get("non_active_ranks_per_dp") or {}).items()
        }
        n_pp = int(config["pipeline_model_parallel_size"])
        n_dp = int(config["data_parallel_size"])
        batches = [int(b) for b in config["local_batch_per_dp"]]
        name = str(config["instance"])
        rank_name = str(config.get("rank_file", RANKS_NAME))
    except (KeyError, TypeError, ValueError) as err:
        raise InputError(source, [("", f"missing or malformed field: {err!r}")]) from None
    if len(batches) != n_dp:
        raise InputError(
            source, [("local_batch_per_dp", f"{len(batches)} entries for {n_dp} DP ranks")]
        )
    if Path(rank_name).name != rank_name or rank_name in ("", ".", ".."):
        raise InputError(
            source, [("rank_file", f"must be a file name beside it, got {rank_name!r}")]
        )
    ranks_path = config_path.parent / rank_name
    try:
        text = ranks_path.read_text()
    except (OSError, UnicodeDecodeError) as err:
        raise InputError(str(ranks_path), [("", f"cannot read file: {err}")]) from None
    rsource = str(ranks_path)
    rows = _parse_rank_file(text, rsource)
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
        if row["rank"] != tp + big_t * (dp + n_dp * pp):
            problems.append(
                (where, f"rank {row['rank']} is not tp + tp_base * (dp + DP * pp) ({RANK_ORDER})")
            )
        group = groups.setdefault((dp, pp), {})
        if tp in group:
            problems.append((where, f"local rank {tp} of dp={dp} pp={pp} appears twice"))
        group[tp] = row
    if problems:
        raise InputError(rsource, problems)
    ids: dict[str, Hashable] = {}
    if instance is not None:
        a = instance.arrays
        ids = {str(x): x for x in (*a.gpu_ids, *a.domain_ids)}

    def node(text: str, where: str) -> Hashable:
        if instance is None:
            return text
        if text not in ids:
            problems.append((where, f"{text!r} is not a GPU or domain of {instance.name!r}"))
        return ids.get(text, text)

    replicas: list[Replica] = []
    for dp in range(n_dp):
        if dp < n_reduced:
            expected = non_active.get((dp, 0, 0), list(range(big_t - spares, big_t)))
        else:
            expected = []
        stages: list[Stage] = []
        degree = None
        for pp in range(n_pp):
            group = groups[(dp, pp)]
            inactive = sorted(tp for tp, row in group.items() if not row["active"])
            want = non_active.get((dp, 0, pp), expected)
            if inactive != sorted(want):
                problems.append(
                    (f"dp={dp} pp={pp}", f"inactive local ranks {inactive}, config says {want}")
                )
            active = [group[tp] for tp in range(big_t) if group[tp]["active"]]
            if degree is None:
                degree = len(active)
            elif len(active) != degree:
                problems.append(
                    (f"dp={dp} pp={pp}", f"{len(active)} active ranks, stage 0 has {degree}")
                )
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
                continue
            where = f"line {active[0]['line']}"
            stages.append(
                Stage(
                    node(active[0]["domain"], where),
                    tuple(node(row["gpu"], f"line {row['line']}") for row in active),
                    float(active[0]["power"]),
                )
            )
        replicas.append(Replica(int(degree or 0), batches[dp], tuple(stages)))
    if problems:
        raise InputError(rsource, problems)
    return Plan(name, tuple(replicas), {"policy": "megatron-import"})
