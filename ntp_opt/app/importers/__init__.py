"""Read real clusters: Slurm, Kubernetes and ``nvidia-smi -q -x`` (``docs/import.md``).

:func:`import_slurm` and :func:`import_k8s` return a cluster graph whose node
ids keep the real names (tray = host name, GPU = ``<host>:gpu<index>``);
``ntp-opt import slurm|k8s`` wraps them and writes an instance file.
"""

from ntp_opt.app.importers.compose import Host, SmiGpu, SmiHost, compose_cluster
from ntp_opt.app.importers.hostlist import HostlistError, expand
from ntp_opt.app.importers.k8s import import_k8s
from ntp_opt.app.importers.nvidia_smi import read_xml
from ntp_opt.app.importers.slurm import import_slurm
from ntp_opt.app.importers.slurm_nodes import read_nodes
from ntp_opt.app.importers.slurm_topology import read_topology

__all__ = [
    "Host",
    "HostlistError",
    "SmiGpu",
    "SmiHost",
    "compose_cluster",
    "expand",
    "import_k8s",
    "import_slurm",
    "read_nodes",
    "read_topology",
    "read_xml",
]
