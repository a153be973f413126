"""Export a plan to Megatron-LM's nonuniform TP runtime, its launchers and power limits.

Megatron-LM's NTP code (``megatron/core/distributed/nonuniform_tp.py`` on its
``dev`` branch) reads one object, ``NonuniformTPConfig(tp_base, tp_spares,
num_reduced_tp_dp_ranks, non_active_ranks_per_dp)``, with
``non_active_ranks_per_dp`` keyed by ``(dp, cp, pp)`` tuples, and its
process-group helper ``initialize_nonuniform_tp_process_groups`` assumes that
global ranks form blocks of ``tp_base`` consecutive ranks, that block ``b =
rank // tp_base`` (no context parallelism) is rebuilt when ``b <
num_reduced_tp_dp_ranks``, and that the active local ranks of block ``b`` are
those of key ``(b, 0, 0)`` (or, without that key, the first ``tp_base -
tp_spares``). :func:`export_megatron` writes what those functions read, in
their types, and the files a launcher needs (``docs/export.md``):

``ntp_config.py``
    Builds the ``NonuniformTPConfig`` (tuple keys); nothing else.
``megatron-args.txt``
    The Megatron-LM flags the layout needs (parallel sizes, rank order,
    global batch).
``ranks.txt``
    One line per global rank: host, device index, GPU, coordinates, power.
``slurm-hostfile``, ``bind.sh``, ``gpu-uuids.txt``
    ``SLURM_HOSTFILE`` for ``srun --distribution=arbitrary`` and the per-rank
    wrapper that sets ``CUDA_VISIBLE_DEVICES`` (also used under torchrun): the
    GPU's UUID from ``gpu-uuids.txt`` (written when the instance has UUIDs), else
    its index with ``CUDA_DEVICE_ORDER=PCI_BUS_ID``.
``torchrun-hosts.tsv``, ``torchrun.sh``
    Per-host node rank, process count and first rank (only when every host's
    ranks are contiguous; otherwise :attr:`Export.torchrun_note` says why).
``power-limits.sh``, ``power-restore.sh``
    Per host, ``nvidia-smi -i INDEX -pl WATTS`` for the boosted GPUs and back.
``ntp-opt-extras.json``
    Everything Megatron does not read (local batch, power, sizes, metrics).
``LAUNCH.md``
    The launch recipe with this export's numbers.

:func:`write_launch_set` writes such a set all at once (staged and
fsynced, then committed by renames that are undone on any error; the user's
own files in the target are left alone). Only whitelisted
names (:data:`HOST_RE`, :data:`ID_RE`) reach the scripts and tables;
``ntp_config.py`` holds integers only and ``LAUNCH.md`` shows the instance
name through :func:`md_code`.

Layout. The rank order is Megatron's ``tp-cp-ep-pp-dp`` (``--use-tp-pp-dp-mapping``;
for PP = 1 it equals the default ``tp-cp-ep-dp-pp``): ``rank = tp + T * (pp +
PP * dp)``. Replica ``r`` of the plan is DP rank ``r`` (reduced replicas first),
its stage ``k`` is PP rank ``k`` and occupies block ``k + PP * r``; the stage's
GPUs are its local ranks ``0 .. t-1`` and ``t .. T-1`` are inactive. So the
reduced stages are exactly blocks ``0 .. PP * n_reduced - 1``, which is what
the helper rebuilds when ``num_reduced_tp_dp_ranks = PP * n_reduced``; every
reduced ``(dp, 0, pp)`` is a key of ``non_active_ranks_per_dp`` (the runtime's
per-rank checks use the real coordinates), and the inactive local ranks are
always the last ``tp_spares``, so blocks whose ``(b, 0, 0)`` key names another
replica's stage still get the right active ranks.

Inactive ranks must be launched (the world is ``DP * PP * T`` ranks; they exit
once the groups exist). Each gets a healthy GPU of its own that no active rank
uses, on any host of the cluster; the ``placeholder_hosts`` the caller names
only when those are too few or when they keep every host's ranks contiguous;
without enough of them the export is refused. The placement keeps each host's
ranks contiguous whenever it can (torchrun); otherwise
:attr:`Export.torchrun_note` says which host breaks it and why.

The package, one module per responsibility: :mod:`~ntp_opt.app.export.names`
(file names, grammars, caps), :mod:`~ntp_opt.app.export.rows` (the rank table),
:mod:`~ntp_opt.app.export.ranks` (placeholder placement),
:mod:`~ntp_opt.app.export.megatron` (the export), :mod:`~ntp_opt.app.export.launchers`
(the files' text), :mod:`~ntp_opt.app.export.power` (power scripts),
:mod:`~ntp_opt.app.export.writing` (the atomic writer),
:mod:`~ntp_opt.app.export.importing` (:func:`import_megatron`),
:mod:`~ntp_opt.app.export.rebatch` (:func:`equal_batch`) and
:mod:`~ntp_opt.app.export.k8s` / :mod:`~ntp_opt.app.export.k8s_manifest` (``--to k8s``).
"""

from ntp_opt.app.export.importing import import_megatron, read_config_module
from ntp_opt.app.export.k8s import export_k8s, k8s_files, k8s_notes
from ntp_opt.app.export.k8s_hosts import (
    CONFIGMAP_LIMIT,
    K8S_LAUNCH_NAME,
    K8S_NAME,
    K8S_RANKS_NAME,
    K8sHost,
    K8sOptions,
    k8s_hosts,
    pod_gpus,
)
from ntp_opt.app.export.k8s_manifest import (
    LAUNCH_SCRIPT,
    configmap_parts,
    k8s_manifest,
)
from ntp_opt.app.export.launchers import md_code
from ntp_opt.app.export.megatron import export_megatron, megatron_export
from ntp_opt.app.export.names import (
    ARGS_NAME,
    BIND_NAME,
    COLUMNS,
    CONFIG_NAME,
    EXTRAS_FORMAT,
    EXTRAS_NAME,
    HOSTFILE_NAME,
    LAUNCH_NAME,
    MANIFEST_NAME,
    POWER_RESTORE_NAME,
    POWER_SET_NAME,
    RANKS_NAME,
    TORCHRUN_HOSTS_NAME,
    TORCHRUN_NAME,
    UUID_RE,
    UUIDS_NAME,
)
from ntp_opt.app.export.power import power_commands, power_only
from ntp_opt.app.export.rebatch import equal_batch
from ntp_opt.app.export.rows import Export, RankRow, gpu_hosts
from ntp_opt.app.export.writing import write_launch_set
from ntp_opt.planners.megatron import MegatronError, megatron_compatible, megatron_order

__all__ = [
    "ARGS_NAME",
    "BIND_NAME",
    "COLUMNS",
    "CONFIGMAP_LIMIT",
    "CONFIG_NAME",
    "EXTRAS_FORMAT",
    "EXTRAS_NAME",
    "HOSTFILE_NAME",
    "K8S_LAUNCH_NAME",
    "K8S_NAME",
    "K8S_RANKS_NAME",
    "LAUNCH_NAME",
    "LAUNCH_SCRIPT",
    "MANIFEST_NAME",
    "POWER_RESTORE_NAME",
    "POWER_SET_NAME",
    "RANKS_NAME",
    "TORCHRUN_HOSTS_NAME",
    "TORCHRUN_NAME",
    "UUIDS_NAME",
    "UUID_RE",
    "Export",
    "K8sHost",
    "K8sOptions",
    "MegatronError",
    "RankRow",
    "configmap_parts",
    "equal_batch",
    "export_k8s",
    "export_megatron",
    "gpu_hosts",
    "import_megatron",
    "k8s_files",
    "k8s_hosts",
    "k8s_manifest",
    "k8s_notes",
    "md_code",
    "megatron_compatible",
    "megatron_export",
    "megatron_order",
    "pod_gpus",
    "power_commands",
    "power_only",
    "read_config_module",
    "write_launch_set",
]
