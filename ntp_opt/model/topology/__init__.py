"""Cluster topology model: builders, failure/straggler/risk helpers and consistency checks.

The package's modules: :mod:`.build` (builders), :mod:`.edit` (in-place failure, repair,
straggler and risk edits), :mod:`.query` (node ids by kind), :mod:`.check` (consistency
check), :mod:`.attrs` (attribute values and defaults).

A cluster is an undirected :class:`networkx.Graph` whose nodes all carry a ``kind`` attribute:

==========  ===================================================================================
kind        attributes (defaults)
==========  ===================================================================================
``gpu``     ``state`` ("healthy" / "failed", default "healthy"), ``speed`` (relative
            throughput, 1.0; < 1 is a straggler), ``p_fail`` (probability of failing within the
            planning horizon, 0.0), ``tdp_w`` (``DEFAULT_TDP_W``), ``max_power_w`` (largest
            power limit the board accepts, >= ``tdp_w``; absent: ``tdp_w * (1 + max_boost)``
            of the job), optional ``uuid``, ``host`` (strings) and ``index`` (int >= 0)
``tray``    compute tray / host, the usual failure unit: ``p_fail`` (0.0), optional ``host``
``domain``  NVLink scale-up domain: ``size`` (number of GPUs in it, required)
``rack``    power unit: ``power_budget_w`` (default: sum of its GPUs' ``tdp_w``)
``switch``  scale-out fabric: ``tier`` ("leaf" or "spine")
==========  ===================================================================================

``G.graph["power_budget_w"]`` is the site power budget (default: sum of all GPUs' ``tdp_w``) and
``G.graph["name"]`` a human-readable name.

The only edges are containment edges: gpu-tray, tray-domain, tray-rack, domain-leaf switch and
switch-switch (leaf-spine). A domain may span several racks (NVL36x2) and a rack may hold several
domains (DGX / NVL8).

Node ids built by :mod:`.build` are strings: domains ``d{i}``, trays ``d{i}.t{j}``, GPUs
``d{i}.t{j}.g{k}``, racks ``r{i}``, leaf switches ``leaf{i}``, spine switches ``spine{i}``.
"""

from __future__ import annotations

from ntp_opt.model.topology.attrs import (
    DEFAULT_TDP_W,
    FAILED,
    HEALTHY,
    NIC_GBPS_PER_GPU,
)
from ntp_opt.model.topology.build import (
    BUILDERS,
    DOMAIN_SIZE,
    build,
    build_cluster,
    dgx_h100,
    gb200_nvl72,
    nvl32,
    nvl36x2,
)
from ntp_opt.model.topology.check import TopologyError, check_topology
from ntp_opt.model.topology.edit import (
    add_stragglers,
    fail_gpus,
    fail_random,
    fail_trays,
    repair_gpus,
    set_p_fail,
    set_speed,
)
from ntp_opt.model.topology.query import domains, gpus, racks, trays

__all__ = [
    "BUILDERS",
    "DEFAULT_TDP_W",
    "DOMAIN_SIZE",
    "FAILED",
    "HEALTHY",
    "NIC_GBPS_PER_GPU",
    "TopologyError",
    "add_stragglers",
    "build",
    "build_cluster",
    "check_topology",
    "dgx_h100",
    "domains",
    "fail_gpus",
    "fail_random",
    "fail_trays",
    "gb200_nvl72",
    "gpus",
    "nvl32",
    "nvl36x2",
    "racks",
    "repair_gpus",
    "set_p_fail",
    "set_speed",
    "trays",
]
