"""The text of a launch set.

``ntp_config.py``, ``bind.sh``, torchrun's table and script, ``LAUNCH.md``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence

from ntp_opt.app.export.names import (
    ARGS_NAME,
    BIND_NAME,
    COLUMNS,
    CONFIG_NAME,
    EXTRAS_NAME,
    HOSTFILE_NAME,
    LAUNCH_NAME,
    POWER_RESTORE_NAME,
    POWER_SET_NAME,
    RANK_ORDER,
    RANKS_NAME,
    TORCHRUN_HOSTS_NAME,
    TORCHRUN_NAME,
    UUID_RE,
    UUIDS_NAME,
)
from ntp_opt.app.export.power import power_commands
from ntp_opt.app.export.rows import Export, RankRow, check_rows, gpu_hosts
from ntp_opt.model.instance import Instance
from ntp_opt.planners.megatron import (
    MegatronError,
)
from ntp_opt.rules.power import whole_watts
from ntp_opt.rules.validate import Violation


def torchrun_hosts(rows: list[RankRow]) -> tuple[list[tuple[int, str, int, int]] | None, str]:
    """Per host ``(node_rank, host, nproc, first_rank)`` if every host's ranks are contiguous.

    Otherwise ``None`` and why: the first host whose ranks have gaps, what it
    runs, and how many hosts are like it.
    """
    spans: dict[str, list[RankRow]] = {}
    for row in rows:
        spans.setdefault(row.host, []).append(row)
    broken = [h for h, rs in spans.items() if rs[-1].rank - rs[0].rank + 1 != len(rs)]
    if broken:
        host = broken[0]
        rs = spans[host]
        blocks = list(dict.fromkeys((row.dp, row.pp) for row in rs))
        inactive = list(dict.fromkeys((row.dp, row.pp) for row in rs if not row.active))
        named = ", ".join(f"dp={d} pp={p}" for d, p in blocks[:4])
        if inactive:
            why = (
                f"it runs ranks of {len(blocks)} TP groups ({named}"
                f"{', ...' if len(blocks) > 4 else ''}), "
                "inactive ranks among them: not enough free healthy GPUs next to their "
                "groups (on the host of the group's last active rank, the host of the next "
                "group's first rank, or a host running no rank) to keep every host's ranks "
                "in one run"
            )
        else:
            why = (
                f"its GPUs serve TP groups {named} that are not neighbours in the rank "
                "order (rank = tp + tp_base * (pp + PP * dp))"
            )
        more = f" ({len(broken) - 1} more hosts like it)" if len(broken) > 1 else ""
        return None, (
            f"no torchrun variant: host {host} holds ranks {rs[0].rank}..{rs[-1].rank} with "
            f"gaps{more}; {why}. torchrun numbers each host's ranks contiguously; launch with "
            "srun (slurm-hostfile)"
        )
    out = sorted((rs[0].rank, h, len(rs)) for h, rs in spans.items())
    return [(n, h, c, f) for n, (f, h, c) in enumerate(out)], ""


def _config_module(ex: Export) -> str:
    """The text of ``ntp_config.py``: integers only, each written by ``int``; no names.

    Nothing of the instance (its name, node ids, hosts) reaches the module, so
    no name can break out of a docstring or a literal and run when the
    training script imports it.
    """
    kw = ex.ntp_kwargs
    lines = [
        '"""Megatron-LM NonuniformTPConfig for an ntp-opt plan (see ntp-opt-extras.json).',
        "",
        "Written by ntp-opt; the training script calls ntp_config() (see LAUNCH.md).",
        '"""',
        "",
        "NTP_CONFIG_KWARGS = {",
        f'    "tp_base": {int(kw["tp_base"])},',
        f'    "tp_spares": {int(kw["tp_spares"])},',
        f'    "num_reduced_tp_dp_ranks": {int(kw["num_reduced_tp_dp_ranks"])},',
    ]
    if kw["non_active_ranks_per_dp"] is None:
        lines.append('    "non_active_ranks_per_dp": None,')
    else:
        lines.append('    "non_active_ranks_per_dp": {')
        for key, v in kw["non_active_ranks_per_dp"].items():
            tup = ", ".join(str(int(x)) for x in key)
            lst = ", ".join(str(int(x)) for x in v)
            lines.append(f"        ({tup}): [{lst}],")
        lines.append("    },")
    lines += [
        "}",
        "",
        "",
        "def ntp_config():",
        '    """The NonuniformTPConfig to pass to initialize_nonuniform_tp_process_groups."""',
        "    from megatron.core.distributed.nonuniform_tp import NonuniformTPConfig",
        "",
        "    return NonuniformTPConfig(**NTP_CONFIG_KWARGS)",
        "",
    ]
    return "\n".join(lines)


def md_code(text: str) -> str:
    """``text`` as one Markdown inline code span that nothing in it can leave.

    Characters that are not printable (line breaks, U+2028/U+2029, NUL, other
    controls and format characters) are written as ``\\uXXXX`` escapes, so
    the span stays on one line and cannot open or close a fence; the span's
    backtick run is longer than any run of backticks inside.

    Parameters
    ----------
    text
        Any string (a user's instance name).

    Returns
    -------
    str
        The code span, backticks included.
    """
    shown = "".join(
        c if c.isprintable() else (f"\\u{ord(c):04x}" if ord(c) <= 0xFFFF else f"\\U{ord(c):08x}")
        for c in text
    )
    runs = [len(m) for m in re.findall("`+", shown)]
    fence = "`" * (max(runs, default=0) + 1)
    pad = " " if shown.startswith("`") or shown.endswith("`") or not shown.strip() else ""
    return f"{fence}{pad}{shown}{pad}{fence}"


BIND_SCRIPT = r"""#!/bin/sh
# Written by ntp-opt. Per-rank wrapper: sets RANK, WORLD_SIZE, LOCAL_RANK=0 and the
# rank's GPU from ranks.txt next to this script, checks that the process runs on
# the planned host, then runs the command.
#   srun:     SLURM_HOSTFILE=slurm-hostfile srun --distribution=arbitrary -n WORLD ./bind.sh CMD
#   torchrun: torchrun ... --no-python ./bind.sh CMD   (via torchrun.sh)
# The host is SLURMD_NODENAME under srun (the node name slurm-hostfile uses, also
# when several nodes share one machine), else NTP_HOST (torchrun.sh sets it), else
# `hostname -s`. CUDA_VISIBLE_DEVICES is the GPU's UUID when gpu-uuids.txt names
# it, else its device index; CUDA_DEVICE_ORDER=PCI_BUS_ID makes an index mean
# what it means to nvidia-smi (CUDA's default order is fastest first).
set -e
dir="$(cd "$(dirname "$0")" && pwd)"
if [ -n "${SLURM_PROCID:-}" ] && [ -z "${TORCHELASTIC_RUN_ID:-}" ]; then
  rank="$SLURM_PROCID"
  host="${SLURMD_NODENAME:-}"
  if [ -z "$host" ]; then echo "bind.sh: srun set no SLURMD_NODENAME" >&2; exit 1; fi
else
  host="${NTP_HOST:-$(hostname -s)}"
  first="$(awk -v h="$host" '$2 == h {print $4; exit}' "$dir/torchrun-hosts.tsv")"
  if [ -z "$first" ]; then echo "bind.sh: host $host is not in torchrun-hosts.tsv" >&2; exit 1; fi
  rank=$((first + ${LOCAL_RANK:?LOCAL_RANK not set}))
fi
line="$(awk -v r="$rank" '$1 == r {print $2, $3; exit}' "$dir/ranks.txt")"
want="${line% *}"
dev="${line#* }"
if [ -z "$line" ]; then echo "bind.sh: rank $rank is not in ranks.txt" >&2; exit 1; fi
if [ "$want" != "$host" ]; then
  echo "bind.sh: rank $rank runs on $host but is planned on $want" >&2
  exit 1
fi
if [ -n "${RANK:-}" ] && [ "$RANK" != "$rank" ]; then
  echo "bind.sh: warning: the launcher set RANK=$RANK, the plan says $rank; using $rank" >&2
fi
gpu="$dev"
if [ -f "$dir/gpu-uuids.txt" ]; then
  uuid="$(awk -v h="$want" -v d="$dev" '$1 == h && $2 == d {print $3; exit}' "$dir/gpu-uuids.txt")"
  case "$uuid" in
    "") ;;
    *[!A-Za-z0-9/-]*) echo "bind.sh: gpu-uuids.txt: bad UUID for $want device $dev" >&2; exit 1 ;;
    GPU-* | MIG-*) gpu="$uuid" ;;
    *) echo "bind.sh: gpu-uuids.txt: bad UUID for $want device $dev" >&2; exit 1 ;;
  esac
fi
export RANK="$rank" WORLD_SIZE="$(($(grep -vc '^#' "$dir/ranks.txt")))" LOCAL_RANK=0
export CUDA_VISIBLE_DEVICES="$gpu" CUDA_DEVICE_ORDER=PCI_BUS_ID
exec "$@"
"""


def _uuid_file(instance: Instance, rows: Sequence[RankRow]) -> str | None:
    """``gpu-uuids.txt``: ``host device uuid`` per GPU of ``rows`` with a UUID, or ``None``.

    Raises
    ------
    MegatronError
        When a UUID is not of the form :data:`UUID_RE` (it would reach a shell).
    """
    g = instance.cluster
    lines = []
    for row in rows:
        uuid = None if row.gpu is None else g.nodes[row.gpu].get("uuid")
        if uuid is None:
            continue
        if not isinstance(uuid, str) or not UUID_RE.fullmatch(uuid):
            raise MegatronError(
                [
                    Violation(
                        "megatron-uuids",
                        f"GPU {row.gpu}: uuid {str(uuid)[:80]!r} is not a CUDA device UUID "
                        "(GPU-... or MIG-..., letters, digits and '-')",
                    )
                ]
            )
        lines.append(f"{row.host} {row.device} {uuid}\n")
    return "".join(["# host device uuid\n", *lines]) if lines else None


def _torchrun_script(hosts: list[tuple[int, str, int, int]], world: int) -> str:
    return "\n".join(
        [
            "#!/bin/sh",
            "# Written by ntp-opt. Run on every host of torchrun-hosts.tsv (one process per host):",
            "#   MASTER_ADDR=<host of rank 0> MASTER_PORT=29500 ./torchrun.sh CMD ARGS...",
            "# Each host starts its own number of processes; bind.sh sets RANK = first rank",
            f"# of the host + LOCAL_RANK and WORLD_SIZE = {world}, and the device.",
            "set -e",
            'dir="$(cd "$(dirname "$0")" && pwd)"',
            'host="${NTP_HOST:-$(hostname -s)}"',
            'set -- "$dir/bind.sh" "$@"',
            'line="$(awk -v h="$host" \'$2 == h {print $1, $3; exit}\' "$dir/torchrun-hosts.tsv")"',
            'if [ -z "$line" ]; then echo "torchrun.sh: $host runs no rank" >&2; exit 0; fi',
            'export NTP_HOST="$host"',
            f'exec torchrun --nnodes={len(hosts)} --node-rank="${{line% *}}" '
            '--nproc-per-node="${line#* }" \\',
            '  --master-addr="${MASTER_ADDR:?}" --master-port="${MASTER_PORT:-29500}" '
            '--no-python "$@"',
            "",
        ]
    )


def _launch_md(ex: Export, instance_name: str) -> str:
    e = ex.extras
    world = e["world_size"]
    args = " ".join(ex.megatron_args)
    tr = (
        "./torchrun.sh python pretrain_gpt_ntp.py $(cat megatron-args.txt) ...   # on every host"
        if ex.torchrun_hosts is not None
        else f"(not available: {ex.torchrun_note})"
    )
    world_line = (
        f"World: {world} ranks = DP {e['data_parallel_size']} x PP "
        f"{e['pipeline_model_parallel_size']} x tp_base {e['tensor_model_parallel_size']}; "
        f"{e['reduced_replicas']} reduced replicas at TP "
        f"{e['tensor_model_parallel_size'] - ex.ntp_kwargs['tp_spares']}; "
        f"{e['placeholder_ranks']} placeholder ranks that exit after the process groups "
        "are built."
    )
    return f"""# Launching the ntp-opt plan of {md_code(instance_name)} with Megatron-LM NTP

{world_line}
Rank order `{RANK_ORDER}`: rank = tp + tp_base * (pp + PP * dp).

1. Training script: a copy of `pretrain_gpt.py` that, after
   `initialize_model_parallel`, runs (Megatron-LM
   `megatron/core/distributed/README_NONUNIFORM_TP.md`):

   ```python
   from ntp_config import ntp_config   # this directory on PYTHONPATH
   from megatron.core.distributed.nonuniform_tp import (
       NonuniformTPDistributedDataParallel, initialize_nonuniform_tp_process_groups,
       ntp_init, ntp_map)
   cfg = ntp_config()
   initialize_nonuniform_tp_process_groups(cfg)   # placeholder ranks exit here
   # after building the model: ntp_init(layer, cfg) per TransformerLayer,
   # ntp_map(embedding / output layer, cfg, vocab_size); wrap with
   # NonuniformTPDistributedDataParallel(..., ntp_config=cfg)
   ```

2. Megatron flags (`megatron-args.txt`): `{args}`, plus the model's flags
   (local batch {e["local_batch"]}).

3. Power (as root, before the job; `power-restore.sh` after it):
   `srun --ntasks-per-node=1 sh power-limits.sh`

4. Launch, Slurm:

   ```sh
   SLURM_HOSTFILE=slurm-hostfile srun --distribution=arbitrary --ntasks={world} \\
       ./bind.sh python pretrain_gpt_ntp.py $(cat megatron-args.txt) ...
   ```

   torchrun: {tr}

`ntp-opt-extras.json` holds what Megatron does not read (local batch, power,
metrics); `ranks.txt` is the rank -> host, device, GPU table.
"""


def launch_files(instance: Instance, ex: Export) -> dict[str, str]:
    """Every file of the launch set of ``ex``, name to text (rows checked first)."""
    check_rows(ex.rows)
    a = instance.arrays
    hosts, device = gpu_hosts(instance)
    tdp = {(hosts[i], int(device[i])): whole_watts(float(a.tdp[i])) for i in range(a.n_gpus)}
    name = str(ex.extras["instance"])
    files = {
        CONFIG_NAME: _config_module(ex),
        ARGS_NAME: " ".join(ex.megatron_args) + "\n",
        RANKS_NAME: "\n".join(["# " + " ".join(COLUMNS), *(row.line() for row in ex.rows)]) + "\n",
        HOSTFILE_NAME: "".join(f"{row.host}\n" for row in ex.rows),
        BIND_NAME: BIND_SCRIPT,
        POWER_SET_NAME: power_commands(ex.rows, False, tdp),
        POWER_RESTORE_NAME: power_commands(ex.rows, True, tdp),
        EXTRAS_NAME: json.dumps(ex.extras, indent=1, allow_nan=False) + "\n",
        LAUNCH_NAME: _launch_md(ex, name),
    }
    if (uuids := _uuid_file(instance, ex.rows)) is not None:
        files[UUIDS_NAME] = uuids
    if ex.torchrun_hosts is not None:
        files[TORCHRUN_HOSTS_NAME] = "".join(
            ["# node_rank host nproc first_rank\n"]
            + [f"{n} {h} {c} {f}\n" for n, h, c, f in ex.torchrun_hosts]
        )
        files[TORCHRUN_NAME] = _torchrun_script(ex.torchrun_hosts, len(ex.rows))
    return files
