"""The ``nvidia-smi`` power-limit scripts: :func:`power_commands` and :func:`power_only`."""

from __future__ import annotations

import os
from collections.abc import Sequence

from ntp_opt.app.export.names import POWER_RESTORE_NAME, POWER_SET_NAME
from ntp_opt.app.export.rows import RankRow, active_row, check_rows, gpu_hosts
from ntp_opt.app.export.writing import write_launch_set
from ntp_opt.model.instance import Instance
from ntp_opt.model.plan import Plan
from ntp_opt.rules.power import whole_watts
from ntp_opt.rules.validate import check


def power_commands(rows: Sequence[RankRow], restore: bool, tdp: dict[tuple[str, int], int]) -> str:
    """The power-limit script: per host, ``nvidia-smi -i INDEX -pl WATTS`` lines.

    Parameters
    ----------
    rows
        The rank table.
    restore
        Write the commands restoring the nominal limits instead.
    tdp
        Nominal limit (whole watts) per ``(host, device)``.

    Returns
    -------
    str
        A shell script with one ``case`` branch per host that has a boosted GPU.
    """
    by_host: dict[str, list[tuple[int, int]]] = {}
    for row in rows:
        if not row.active or row.power is None or row.power <= 1.0 or row.power_w is None:
            continue
        nominal = tdp[(row.host, row.device)]
        if row.power_w <= nominal:
            continue
        watts = nominal if restore else row.power_w
        by_host.setdefault(row.host, []).append((row.device, watts))
    what = "restore the nominal power limits" if restore else "set the boosted power limits"
    lines = [
        "#!/bin/sh",
        f"# Written by ntp-opt: {what}. Run once on every host (as root), for example",
        "#   srun --ntasks-per-node=1 sh " + (POWER_RESTORE_NAME if restore else POWER_SET_NAME),
        "set -e",
        'host="${NTP_HOST:-${SLURMD_NODENAME:-$(hostname -s)}}"',
        'case "$host" in',
    ]
    check_rows(rows, ids=False)
    for host in sorted(by_host):
        lines.append(f"{host})")
        lines += [f"  nvidia-smi -i {int(d)} -pl {int(w)}" for d, w in sorted(by_host[host])]
        lines.append("  ;;")
    lines += ["*) ;;", "esac", ""]
    return "\n".join(lines)


def power_only(
    instance: Instance,
    plan: Plan,
    out_dir: str | os.PathLike[str],
    *,
    inputs: Sequence[str | os.PathLike[str]] = (),
) -> list[str]:
    """Write only ``power-limits.sh`` and ``power-restore.sh`` for any valid plan.

    Parameters
    ----------
    instance
        The instance.
    plan
        A plan that passes the validator (Megatron's restrictions do not apply).
    out_dir
        Output directory (created if missing).
    inputs
        Files the caller read (never overwritten).

    Returns
    -------
    list of str
        The names written.

    Raises
    ------
    ntp_opt.rules.validate.PlanError
        If the plan breaks a rule of the model.
    MegatronError
        If a host name or device index is unusable.
    """
    check(instance, plan)
    a = instance.arrays
    hosts, device = gpu_hosts(instance)
    rows = [
        active_row(instance, hosts, device, i, st, -1, r, k, j)
        for r, rep in enumerate(plan.replicas)
        for k, st in enumerate(rep.stages)
        for j, g in enumerate(st.gpus)
        for i in [a.gpu_index[g]]
    ]
    tdp = {(hosts[i], int(device[i])): whole_watts(float(a.tdp[i])) for i in range(a.n_gpus)}
    files = {
        POWER_SET_NAME: power_commands(rows, False, tdp),
        POWER_RESTORE_NAME: power_commands(rows, True, tdp),
    }
    return write_launch_set(files, out_dir, inputs=inputs, executable=tuple(files), prune=False)
