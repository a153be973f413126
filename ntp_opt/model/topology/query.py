"""Cluster queries: the node ids of each kind, in graph order."""

from __future__ import annotations

from collections.abc import Hashable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import networkx as nx


def _of_kind(G: nx.Graph, kind: str) -> list[Hashable]:
    return [n for n, k in G.nodes(data="kind") if k == kind]


def gpus(G: nx.Graph) -> list[Hashable]:
    """Return the GPU node ids in graph order.

    Parameters
    ----------
    G : networkx.Graph
        The cluster.

    Returns
    -------
    list of Hashable
        Ids of all nodes with ``kind == "gpu"`` (healthy and failed).
    """
    return _of_kind(G, "gpu")


def trays(G: nx.Graph) -> list[Hashable]:
    """Return the tray node ids (``kind == "tray"``) in graph order."""
    return _of_kind(G, "tray")


def domains(G: nx.Graph) -> list[Hashable]:
    """Return the NVLink domain node ids (``kind == "domain"``) in graph order."""
    return _of_kind(G, "domain")


def racks(G: nx.Graph) -> list[Hashable]:
    """Return the rack node ids (``kind == "rack"``) in graph order."""
    return _of_kind(G, "rack")


# --------------------------------------------------------------------------------------------


def tray_gpus(G: nx.Graph, tray: Hashable) -> list[Hashable]:
    """Return the GPU node ids of one tray, in adjacency order.

    Parameters
    ----------
    G : networkx.Graph
        The cluster.
    tray : Hashable
        A tray id.

    Returns
    -------
    list of Hashable
        The tray's neighbours with ``kind == "gpu"``.
    """
    nodes = G.nodes
    return [g for g in G.adj[tray] if nodes[g].get("kind") == "gpu"]
