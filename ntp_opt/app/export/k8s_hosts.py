"""The options and hosts of a k8s export.

:class:`K8sOptions`, :class:`K8sHost` and :func:`k8s_hosts`.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from typing import Any

from ntp_opt.app.export.rows import Export, RankRow, gpu_hosts
from ntp_opt.model.instance import Instance
from ntp_opt.planners.megatron import (
    MegatronError,
)
from ntp_opt.rules.validate import Violation

#: File names written next to the Megatron-LM export.
K8S_NAME = "k8s.json"


K8S_RANKS_NAME = "k8s-ranks.tsv"


K8S_LAUNCH_NAME = "k8s-launch.sh"


#: Kubernetes refuses objects above 1 MiB; a ConfigMap's data must leave room for its metadata.
CONFIGMAP_LIMIT = 1_000_000


#: A DNS-1123 label (object names, pod host names, namespaces), at most 63 characters.
LABEL_RE = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")


#: A DNS-1123 subdomain (node names), at most 253 characters.
SUBDOMAIN_RE = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")


#: Labels every object carries (plus ``app.kubernetes.io/instance`` = the export's name).
APP_LABEL = {"app.kubernetes.io/name": "ntp-opt"}


@dataclass(frozen=True)
class K8sOptions:
    """What the Kubernetes objects need beyond the plan.

    Attributes
    ----------
    image
        Container image with PyTorch, Megatron-LM and the NTP training script.
    name
        Prefix of every object's name (a DNS-1123 label of at most 40 characters).
    namespace
        Namespace written into every object (``None``: the one ``kubectl`` uses).
    command
        The training command; the wrapper appends the flags of ``megatron-args.txt``.
    master_port
        The rendezvous port (``MASTER_PORT``) on the pod of node rank 0.
    configmap_bytes
        Most bytes of files one ConfigMap holds; larger rank tables are split
        over several (:func:`configmap_parts`).

    Raises
    ------
    ValueError
        On an unusable value, naming the option.
    """

    image: str
    name: str = "ntp"
    namespace: str | None = None
    command: tuple[str, ...] = ("python", "pretrain_gpt_ntp.py")
    master_port: int = 29500
    configmap_bytes: int = CONFIGMAP_LIMIT

    def __post_init__(self) -> None:
        if not self.image or any(c.isspace() for c in self.image):
            raise ValueError(f"--image: {self.image!r} is not a container image reference")
        if len(self.name) > 40 or not LABEL_RE.fullmatch(self.name):
            raise ValueError(
                f"--name: {self.name!r} is not a DNS-1123 label of at most 40 characters "
                "([a-z0-9-], starting and ending alphanumeric)"
            )
        if self.namespace is not None and not LABEL_RE.fullmatch(self.namespace):
            raise ValueError(f"--namespace: {self.namespace!r} is not a DNS-1123 label")
        if not self.command or not all(isinstance(c, str) and c for c in self.command):
            raise ValueError("--command: the training command is empty")
        if not 1 <= self.master_port <= 65535:
            raise ValueError(f"--master-port: {self.master_port} is not a TCP port")

    @classmethod
    def from_cli(
        cls,
        image: str | None,
        name: str,
        namespace: str | None,
        command: str | None,
        master_port: int,
    ) -> K8sOptions:
        """The options from command-line strings (``command`` split as a shell would, not run).

        Raises
        ------
        ValueError
            On a missing image or an unusable value, naming the option.
        """
        if image is None:
            raise ValueError("--image is required with --to k8s")
        try:
            argv = tuple(shlex.split(command)) if command is not None else cls.command
        except ValueError as err:
            raise ValueError(f"--command: {err}") from None
        return cls(image, name, namespace, argv, master_port)


@dataclass(frozen=True)
class K8sHost:
    """One planned host: its Job, its pod and its ranks.

    Attributes
    ----------
    node_rank
        Position of the host by its first rank (0 holds rank 0: the rendezvous).
    node
        The Kubernetes node name (the instance's host name).
    job
        Name of the Job, the pod's ``hostname`` too (a DNS-1123 label).
    gpus
        ``nvidia.com/gpu`` the pod requests.
    rows
        The host's rank rows, in rank order.
    visible
        ``CUDA_VISIBLE_DEVICES`` of each row (a UUID or an index among the pod's GPUs).
    """

    node_rank: int
    node: str
    job: str
    gpus: int
    rows: tuple[RankRow, ...]
    visible: tuple[str, ...]

    @property
    def by_uuid(self) -> bool:
        """Whether the ranks are bound by GPU UUID (else by index, PCI bus order)."""
        return all(v.startswith("GPU-") for v in self.visible)


def _slug(host: str, room: int) -> str:
    """``host`` as label characters (lower case, ``-`` for the rest), at most ``room`` long."""
    s = re.sub(r"[^a-z0-9]+", "-", host.lower())[:room].strip("-")
    return s or "host"


def pod_gpus(instance: Instance, ex: Export) -> dict[str, list[int]]:
    """The device indices each planned host's pod asks for, in index order.

    A cluster host's pod asks for all its healthy GPUs: the device plugin,
    not the pod, chooses which boards a container gets, so asking for fewer
    than all could leave a planned board out. A host outside the cluster
    (``--placeholder-hosts``) asks for the devices its placeholder ranks use.

    Parameters
    ----------
    instance
        The instance.
    ex
        The export of a plan of ``instance``.

    Returns
    -------
    dict
        Host name -> device indices, for every host that runs a rank.
    """
    a = instance.arrays
    hosts, device = gpu_hosts(instance)
    healthy: dict[str, list[int]] = {}
    for i, h in enumerate(hosts):
        if a.healthy[i]:
            healthy.setdefault(h, []).append(int(device[i]))
    out: dict[str, list[int]] = {}
    for row in ex.rows:
        if row.host not in out:
            out[row.host] = sorted(healthy.get(row.host, []))
        if row.device not in out[row.host]:  # a placeholder host outside the cluster
            out[row.host] = sorted([*out[row.host], row.device])
    return out


def k8s_hosts(instance: Instance, ex: Export, options: K8sOptions) -> list[K8sHost]:
    """The planned hosts, by node rank, with their Job names, GPU counts and bindings.

    Parameters
    ----------
    instance
        The instance.
    ex
        The export of a plan of ``instance``.
    options
        The Kubernetes options (the name prefix).

    Returns
    -------
    list of K8sHost
        One per host that runs a rank (active or placeholder).

    Raises
    ------
    MegatronError
        When a host name is not a Kubernetes node name (``k8s-hosts``). A
        GPU's ``uuid`` attribute is checked by the export itself
        (``megatron-uuids``, :data:`ntp_opt.app.export.UUID_RE`).
    """
    problems: list[Violation] = []
    by_host: dict[str, list[RankRow]] = {}
    for row in ex.rows:
        by_host.setdefault(row.host, []).append(row)
    for h in by_host:
        if len(h) > 253 or not SUBDOMAIN_RE.fullmatch(h):
            problems.append(
                Violation(
                    "k8s-hosts",
                    f"host {h!r} is not a Kubernetes node name (a DNS-1123 subdomain: "
                    "lower case [a-z0-9.-], at most 253 characters)",
                )
            )
    nodes = instance.cluster.nodes
    uuid: dict[Any, str | None] = {}
    for row in ex.rows:
        if row.gpu is None:
            continue
        u = nodes[row.gpu].get("uuid")  # checked by the export (megatron-uuids)
        uuid[row.gpu] = u if isinstance(u, str) else None
    if problems:
        raise MegatronError(problems)
    gpus = pod_gpus(instance, ex)
    out: list[K8sHost] = []
    order = sorted(by_host, key=lambda h: by_host[h][0].rank)
    for n, h in enumerate(order):
        rows = by_host[h]
        prefix = f"{options.name}-{n}-"
        job = prefix + _slug(h, 63 - len(prefix))
        uuids = [None if r.gpu is None else uuid[r.gpu] for r in rows]
        if all(u is not None for u in uuids):
            visible = tuple(str(u) for u in uuids)
        else:
            visible = tuple(str(gpus[h].index(r.device)) for r in rows)
        out.append(K8sHost(n, h, job, len(gpus[h]), tuple(rows), visible))
    return out
