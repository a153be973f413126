"""The names of the launch-set files, the rank table's columns, grammars and caps."""

from __future__ import annotations

import re

#: ``format`` of the sidecar file.
EXTRAS_FORMAT = "ntp-opt/megatron-extras@1"


#: Megatron-LM's rank order (``initialize_model_parallel(order=...)``) the export follows.
RANK_ORDER = "tp-cp-ep-pp-dp"


#: File names written by :func:`export_megatron`.
CONFIG_NAME = "ntp_config.py"


EXTRAS_NAME = "ntp-opt-extras.json"


ARGS_NAME = "megatron-args.txt"


RANKS_NAME = "ranks.txt"


HOSTFILE_NAME = "slurm-hostfile"


BIND_NAME = "bind.sh"


TORCHRUN_HOSTS_NAME = "torchrun-hosts.tsv"


TORCHRUN_NAME = "torchrun.sh"


POWER_SET_NAME = "power-limits.sh"


POWER_RESTORE_NAME = "power-restore.sh"


LAUNCH_NAME = "LAUNCH.md"


#: Columns of the rank file, in order.
COLUMNS = (
    "rank",
    "host",
    "device",
    "gpu",
    "domain",
    "dp",
    "pp",
    "tp",
    "active",
    "power",
    "power_w",
)


#: Names a host may have in the generated files (no shell or file-format metacharacters).
HOST_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


#: Node ids (GPUs, domains) the rank file may name: also ``host:gpu0`` and ``block/nvlink``
#: as ``ntp-opt import`` writes them; no whitespace, quotes or shell metacharacters.
ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/@-]*")


#: The data file of ``bind.sh``: ``host device uuid`` of every GPU of the rank file whose
#: UUID the instance knows (written only when there is one).
UUIDS_NAME = "gpu-uuids.txt"


#: What ``bind.sh`` accepts as a CUDA device UUID (``nvidia-smi -L``): ``GPU-<hex groups>``,
#: ``MIG-<hex groups>`` or the older ``MIG-GPU-<uuid>/<gi>/<ci>``; nothing a shell or
#: ``CUDA_VISIBLE_DEVICES`` (commas) would read otherwise.
UUID_RE = re.compile(r"(?:GPU|MIG)-[0-9A-Za-z-]+(?:/[0-9]+/[0-9]+)?")


#: Every name :func:`export_megatron` may write (a directory holding the sidecar of an
#: export made before the manifest existed owns these).
LAUNCH_NAMES = (
    CONFIG_NAME,
    ARGS_NAME,
    RANKS_NAME,
    HOSTFILE_NAME,
    BIND_NAME,
    TORCHRUN_HOSTS_NAME,
    TORCHRUN_NAME,
    POWER_SET_NAME,
    POWER_RESTORE_NAME,
    EXTRAS_NAME,
    LAUNCH_NAME,
)


#: The manifest :func:`write_launch_set` leaves in the directory: the names it wrote.
MANIFEST_NAME = ".ntp-opt-export.json"


MANIFEST_FORMAT = "ntp-opt/launch-set@1"


#: A file name of a launch set: one plain name, no path, not hidden or special.
FILE_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


#: Caps on the export's counts (checked before anything is built).
MAX_WORLD = 1 << 20


MAX_PLACEHOLDER_GPUS = 1024


MAX_PLACEHOLDER_HOSTS = 1 << 14
