"""A planning instance: a cluster graph and a job, validated and immutable.

NetworkX stays at the edge: :class:`Instance` keeps the (frozen) graph for
users and files, and compiles it once into :class:`ClusterArrays`, the
flat numpy view that planners and the validator work on.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import InitVar, dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Any

import numpy as np

from ntp_opt.model.job import Job
from ntp_opt.model.topology import DEFAULT_TDP_W, FAILED, HEALTHY, TopologyError, check_topology

if TYPE_CHECKING:
    import networkx as nx


@dataclass(frozen=True, eq=False)
class ClusterArrays:
    """Flat, index-based view of a cluster graph.

    GPUs, trays, domains and racks are numbered in graph order. Every array
    indexed by GPU has one entry per GPU. ``max_power`` is each GPU's
    ``max_power_w``, ``inf`` where the graph gives none (then only the job's
    ``max_boost`` caps its boost: :attr:`Instance.max_multiplier`).
    """

    gpu_ids: tuple[Hashable, ...]
    gpu_index: dict[Hashable, int]
    gpu_tray: np.ndarray
    gpu_domain: np.ndarray
    gpu_rack: np.ndarray
    healthy: np.ndarray
    speed: np.ndarray
    p_fail: np.ndarray
    tdp: np.ndarray
    max_power: np.ndarray
    tray_ids: tuple[Hashable, ...]
    tray_p_fail: np.ndarray
    domain_ids: tuple[Hashable, ...]
    domain_index: dict[Hashable, int]
    domain_gpus: tuple[np.ndarray, ...]
    rack_ids: tuple[Hashable, ...]
    rack_index: dict[Hashable, int]
    rack_budget: np.ndarray
    site_budget: float

    def __post_init__(self) -> None:
        """Make the per-GPU, per-tray and per-rack arrays read-only."""
        for arr in self.__dict__.values():
            if isinstance(arr, np.ndarray):
                arr.setflags(write=False)

    @property
    def n_gpus(self) -> int:
        """Number of GPUs."""
        return len(self.gpu_ids)

    @property
    def n_domains(self) -> int:
        """Number of NVLink domains."""
        return len(self.domain_ids)

    def healthy_in_domain(self) -> np.ndarray:
        """Healthy GPU count of every domain."""
        return np.bincount(self.gpu_domain[self.healthy], minlength=self.n_domains).astype(np.int64)


def _tray_links(
    graph: nx.Graph,
    tray_ids: tuple[Hashable, ...],
    domain_index: dict[Hashable, int],
    rack_index: dict[Hashable, int],
) -> tuple[np.ndarray, np.ndarray]:
    """Each tray's domain and rack (positions in ``domain_index`` and ``rack_index``)."""
    tray_domain = np.empty(len(tray_ids), dtype=np.int64)
    tray_rack = np.empty(len(tray_ids), dtype=np.int64)
    for i, t in enumerate(tray_ids):
        for nb in graph.adj[t]:
            kind = graph.nodes[nb].get("kind")
            if kind == "domain":
                tray_domain[i] = domain_index[nb]
            elif kind == "rack":
                tray_rack[i] = rack_index[nb]
    return tray_domain, tray_rack


def _gpu_columns(
    graph: nx.Graph, gpu_ids: tuple[Hashable, ...], tray_ids: tuple[Hashable, ...]
) -> tuple[np.ndarray, ...]:
    """``gpu_tray, healthy, speed, p_fail, tdp, max_power`` of the GPU nodes."""
    tray_index = {t: i for i, t in enumerate(tray_ids)}
    n = len(gpu_ids)
    gpu_tray = np.empty(n, dtype=np.int64)
    healthy = np.empty(n, dtype=bool)
    speed = np.empty(n, dtype=float)
    p_fail = np.empty(n, dtype=float)
    tdp = np.empty(n, dtype=float)
    max_power = np.full(n, np.inf)
    nodes = graph.nodes
    for i, g in enumerate(gpu_ids):
        attrs = nodes[g]
        for nb in graph.adj[g]:
            if nodes[nb].get("kind") == "tray":
                gpu_tray[i] = tray_index[nb]
                break
        healthy[i] = attrs.get("state", "healthy") == "healthy"
        speed[i] = attrs.get("speed", 1.0)
        p_fail[i] = attrs.get("p_fail", 0.0)
        tdp[i] = attrs.get("tdp_w", DEFAULT_TDP_W)
        mx = attrs.get("max_power_w")
        if mx is not None:
            max_power[i] = mx
    return gpu_tray, healthy, speed, p_fail, tdp, max_power


def compile_cluster(graph: nx.Graph) -> ClusterArrays:
    """Compile a checked cluster graph into :class:`ClusterArrays`.

    Parameters
    ----------
    graph
        A cluster that passes :func:`ntp_opt.model.topology.check_topology`.

    Returns
    -------
    ClusterArrays
    """
    kinds: dict[str, list[Hashable]] = {k: [] for k in ("gpu", "tray", "domain", "rack")}
    for node, kind in graph.nodes(data="kind"):
        if kind in kinds:
            kinds[kind].append(node)
    gpu_ids = tuple(kinds["gpu"])
    tray_ids = tuple(kinds["tray"])
    domain_ids = tuple(kinds["domain"])
    rack_ids = tuple(kinds["rack"])
    domain_index = {d: i for i, d in enumerate(domain_ids)}
    rack_index = {r: i for i, r in enumerate(rack_ids)}
    tray_domain, tray_rack = _tray_links(graph, tray_ids, domain_index, rack_index)
    gpu_tray, healthy, speed, p_fail, tdp, max_power = _gpu_columns(graph, gpu_ids, tray_ids)
    n = len(gpu_ids)
    nodes = graph.nodes
    gpu_domain = tray_domain[gpu_tray] if n else np.empty(0, dtype=np.int64)
    gpu_rack = tray_rack[gpu_tray] if n else np.empty(0, dtype=np.int64)
    order = np.argsort(gpu_domain, kind="stable")
    bounds = np.searchsorted(gpu_domain[order], np.arange(len(domain_ids) + 1))
    domain_gpus = tuple(order[bounds[i] : bounds[i + 1]] for i in range(len(domain_ids)))
    rack_tdp = np.bincount(gpu_rack, weights=tdp, minlength=len(rack_ids))
    budgets = [nodes[r].get("power_budget_w") for r in rack_ids]
    rack_budget = np.array(
        [float(rack_tdp[i]) if b is None else float(b) for i, b in enumerate(budgets)],
        dtype=float,
    )
    site = graph.graph.get("power_budget_w")
    site_budget = float(tdp.sum()) if site is None else float(site)
    tray_p = np.array([float(nodes[t].get("p_fail", 0.0)) for t in tray_ids], dtype=float)
    return ClusterArrays(
        gpu_ids=gpu_ids,
        gpu_index={g: i for i, g in enumerate(gpu_ids)},
        gpu_tray=gpu_tray,
        gpu_domain=gpu_domain,
        gpu_rack=gpu_rack,
        healthy=healthy,
        speed=speed,
        p_fail=p_fail,
        tdp=tdp,
        max_power=max_power,
        tray_ids=tray_ids,
        tray_p_fail=tray_p,
        domain_ids=domain_ids,
        domain_index=domain_index,
        domain_gpus=domain_gpus,
        rack_ids=rack_ids,
        rack_index=rack_index,
        rack_budget=rack_budget,
        site_budget=site_budget,
    )


@dataclass(frozen=True, eq=False)
class Instance:
    """A cluster and a job: the input of every planner.

    Construction checks the topology and the job against it and raises
    :class:`ntp_opt.model.topology.TopologyError` with every problem found. The
    graph is copied and frozen, so later changes to the caller's graph do not
    leak in.

    Parameters
    ----------
    name
        Instance name (plans refer to it).
    cluster
        Cluster graph (docs/model.md, spec section 1).
    job
        The job (docs/model.md, spec section 2).
    meta
        Free-form description (builder, failure settings, source); stored in
        files as ``"meta"``.
    copy_graph
        Copy ``cluster`` before freezing it (default). Pass ``False`` only for
        a graph nobody else holds, to save the copy on large clusters.
    """

    name: str
    cluster: nx.Graph
    job: Job
    meta: dict[str, Any] = field(default_factory=dict)
    copy_graph: InitVar[bool] = True

    def __post_init__(self, copy_graph: bool) -> None:
        import networkx as nx  # here, not at import: an instance loaded from a file has no graph

        graph = nx.freeze(self.cluster.copy() if copy_graph else self.cluster)
        object.__setattr__(self, "cluster", graph)
        check_topology(graph)
        sizes = {d: s for d, s in graph.nodes(data="size") if graph.nodes[d]["kind"] == "domain"}
        _check_job_fits(self.job, sizes)

    if not TYPE_CHECKING:  # mypy sees ``cluster`` as the plain field it is to callers

        def __getattr__(self, name: str) -> Any:
            # Only reached when ``cluster`` is not built yet (``from_arrays``).
            if name == "cluster":
                source = self.__dict__.get("_graph_source")
                if source is not None:
                    import networkx as nx

                    graph = nx.freeze(source())
                    self.__dict__["cluster"] = graph
                    self.__dict__.pop("_graph_source", None)
                    return graph
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def __repr__(self) -> str:
        # The dataclass's repr, without building a lazy graph to show it.
        graph = self.__dict__.get("cluster")
        shown = "<graph not built yet>" if graph is None else repr(graph)
        return (
            f"Instance(name={self.name!r}, cluster={shown}, job={self.job!r}, meta={self.meta!r})"
        )

    def __getstate__(self) -> dict[str, Any]:
        """Pickled state: the graph is built first (its lazy source is a closure)."""
        state = dict(self.__dict__)
        if "cluster" not in state:
            state["cluster"] = self.cluster
        state.pop("_graph_source", None)
        return state

    @classmethod
    def from_arrays(
        cls,
        name: str,
        arrays: ClusterArrays,
        job: Job,
        meta: dict[str, Any],
        graph: Callable[[], nx.Graph],
    ) -> Instance:
        """An instance from its compiled cluster, its graph built on first read of ``cluster``.

        The fast path of :func:`ntp_opt.model.files.load_instance`: planners and
        the validator work on :attr:`arrays` only, so the NetworkX graph is
        built only if someone asks for it.

        Parameters
        ----------
        name, job, meta
            As for the constructor.
        arrays
            The compiled cluster, equal to ``compile_cluster(graph())``.
        graph
            Builds the cluster graph (called at most once); it must pass
            :func:`ntp_opt.model.topology.check_topology` (the caller's proof).

        Returns
        -------
        Instance

        Raises
        ------
        TopologyError
            If a domain is smaller than ``job.tp`` (as on construction).
        """
        _check_job_fits(job, _domain_sizes(arrays))
        new = object.__new__(cls)
        object.__setattr__(new, "name", name)
        object.__setattr__(new, "job", job)
        object.__setattr__(new, "meta", meta)
        new.__dict__["_graph_source"] = graph
        return new._sharing(arrays)

    @cached_property
    def arrays(self) -> ClusterArrays:
        """The compiled cluster (computed once)."""
        return compile_cluster(self.cluster)

    @cached_property
    def max_multiplier(self) -> np.ndarray:
        """Per GPU, the largest power multiplier job and board allow (computed once).

        ``min(1 + job.max_boost, max_power_w / tdp_w)``, never below 1 (read-only):
        the board's limit is data of the instance, so it is compiled here; the
        power rules that use it are in :mod:`ntp_opt.rules.power`.
        """
        a = self.arrays
        caps = np.minimum(1.0 + self.job.max_boost, a.max_power / a.tdp)
        caps = np.maximum(caps, 1.0)  # max_power >= tdp is checked; guards rounding only
        caps.setflags(write=False)
        return caps

    def with_job(self, job: Job) -> Instance:
        """The same cluster with another job, sharing the compiled cluster.

        Parameters
        ----------
        job
            The new job (checked against the cluster as on construction).

        Returns
        -------
        Instance
            A new instance (same name, graph and meta); :attr:`arrays` is
            shared, since it does not depend on the job.
        """
        if "cluster" not in self.__dict__:  # not built yet: neither is the new one's
            return Instance.from_arrays(
                self.name, self.arrays, job, self.meta, lambda: self.cluster
            )
        new = Instance(self.name, self.cluster, job, self.meta, copy_graph=False)
        return new._sharing(self.arrays)

    def with_health(
        self, healthy: np.ndarray | None = None, speed: np.ndarray | None = None
    ) -> Instance:
        """The same instance with other failed/healthy GPUs or speeds (copy-on-write).

        Parameters
        ----------
        healthy
            Per GPU (``arrays`` order), whether it is healthy (``None``: unchanged).
        speed
            Per GPU, its speed (``None``: unchanged).

        Returns
        -------
        Instance
            A new instance (same name, job and meta) whose graph shares the
            unchanged structure and node attributes; only the nodes of GPUs
            whose health or speed differ are copied (with only the changed
            attribute, ``state`` or ``speed``, set), and the compiled arrays
            other than ``healthy`` and ``speed`` are shared, as is
            :attr:`max_multiplier`.
        """
        a = self.arrays
        new_healthy = np.array(a.healthy if healthy is None else healthy, dtype=bool)
        new_speed = np.array(a.speed if speed is None else speed, dtype=float)
        if new_healthy.shape != a.healthy.shape or new_speed.shape != a.speed.shape:
            raise ValueError(f"healthy and speed need one entry per GPU ({a.n_gpus})")
        changed = np.flatnonzero((new_healthy != a.healthy) | (new_speed != a.speed))
        arrays = ClusterArrays(**{**a.__dict__, "healthy": new_healthy, "speed": new_speed})

        source = self.__dict__.get("_graph_source")
        if "cluster" not in self.__dict__ and source is not None:  # lazy: so is the new one
            lazy = _HealthGraph.after(source, a, new_healthy, new_speed)
            new = object.__new__(Instance)  # from_arrays without its check: the same domains
            object.__setattr__(new, "name", self.name)
            object.__setattr__(new, "job", self.job)
            object.__setattr__(new, "meta", self.meta)
            new.__dict__["_graph_source"] = lazy
            new._sharing(arrays)
        else:
            import networkx as nx

            graph = _graph_with_health(
                self.cluster,
                a.gpu_ids,
                changed,
                new_healthy != a.healthy,
                new_speed != a.speed,
                new_healthy,
                new_speed,
            )
            new = object.__new__(Instance)
            object.__setattr__(new, "name", self.name)
            object.__setattr__(new, "cluster", nx.freeze(graph))
            object.__setattr__(new, "job", self.job)
            object.__setattr__(new, "meta", self.meta)
            new._sharing(arrays)
        if "max_multiplier" in self.__dict__:  # boards and job unchanged: the same caps
            new.__dict__["max_multiplier"] = self.__dict__["max_multiplier"]
        return new

    def _sharing(self, arrays: ClusterArrays) -> Instance:
        """``self`` with its compiled cluster set to ``arrays`` (the fast path of the variants).

        Only :meth:`from_arrays`, :meth:`with_job` and :meth:`with_health` call
        it, on an instance they just made, with arrays that match its graph.
        """
        self.__dict__["arrays"] = arrays  # fills the cached_property
        return self

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Instance):
            return NotImplemented
        return (
            self.name == other.name
            and self.job == other.job
            and self.meta == other.meta
            and self.cluster.graph == other.cluster.graph
            and list(self.cluster.nodes(data=True)) == list(other.cluster.nodes(data=True))
            and _edge_set(self.cluster) == _edge_set(other.cluster)
        )

    __hash__ = None  # type: ignore[assignment]

    def summary(self) -> dict[str, Any]:
        """Counts that describe the instance (GPUs, failed, domains, racks, ...)."""
        a = self.arrays
        return {
            "name": self.name,
            "gpus": a.n_gpus,
            "failed": int((~a.healthy).sum()),
            "stragglers": int((a.healthy & (a.speed < 1.0)).sum()),
            "domains": a.n_domains,
            "racks": len(a.rack_ids),
            "tp": self.job.tp,
            "pp": self.job.pp,
            "dp": self.job.dp,
            "global_batch": self.job.global_batch,
            "batch_policy": self.job.batch_policy,
        }


def _domain_sizes(arrays: ClusterArrays) -> dict[Hashable, int]:
    """Each domain's GPU count (its ``size``, on a checked cluster)."""
    counts = np.bincount(arrays.gpu_domain, minlength=arrays.n_domains)
    return dict(zip(arrays.domain_ids, counts.tolist(), strict=True))


def _check_job_fits(job: Job, sizes: dict[Hashable, int]) -> None:
    """Raise :class:`TopologyError` if a domain is smaller than ``job.tp``."""
    small = [d for d, s in sizes.items() if s < job.tp]
    if small:
        listed = ", ".join(map(str, small[:5])) + (" ..." if len(small) > 5 else "")
        raise TopologyError(
            [
                f"job.tp={job.tp} is larger than {len(small)} NVLink domain(s) "
                f"({listed}; smallest size {min(sizes[d] for d in small)}): "
                "a TP group never leaves its domain"
            ]
        )


def _graph_with_health(
    old: nx.Graph,
    gpu_ids: tuple[Hashable, ...],
    changed: np.ndarray,
    state_changed: np.ndarray,
    speed_changed: np.ndarray,
    healthy: np.ndarray,
    speed: np.ndarray,
) -> nx.Graph:
    """``old`` sharing its structure; the ``changed`` GPUs' nodes copied with their
    ``state`` (where ``state_changed``) and ``speed`` (where ``speed_changed``) set."""
    import networkx as nx

    graph = nx.Graph()
    graph._adj = old._adj  # frozen or private, shared: the structure does not change
    graph._node = dict(old._node)
    graph.graph = dict(old.graph)
    for i in changed.tolist():
        attrs = dict(old._node[gpu_ids[i]])
        if state_changed[i]:
            attrs["state"] = HEALTHY if healthy[i] else FAILED
        if speed_changed[i]:
            attrs["speed"] = float(speed[i])
        graph._node[gpu_ids[i]] = attrs
    return graph


@dataclass(frozen=True, eq=False)
class _HealthGraph:
    """The lazy graph of a :meth:`Instance.with_health` variant of a lazy instance.

    It keeps the first lazy instance's graph source and, per GPU, whether any
    variant on the way changed its health or speed, instead of a chain of
    variants: many events (re-planning, simulation) neither grow a chain nor
    deepen the build. The graph built is the one the variants would have
    built one after another: the source's, with ``state`` and ``speed`` set
    to their last values on the GPUs whose health or speed ever changed.
    """

    root: Callable[[], nx.Graph]
    gpu_ids: tuple[Hashable, ...]
    state_changed: np.ndarray
    speed_changed: np.ndarray
    healthy: np.ndarray
    speed: np.ndarray

    @classmethod
    def after(
        cls,
        source: Callable[[], nx.Graph],
        a: ClusterArrays,
        healthy: np.ndarray,
        speed: np.ndarray,
    ) -> _HealthGraph:
        """The lazy graph after setting ``healthy`` and ``speed`` on an instance (arrays ``a``)
        whose lazy graph is ``source``."""
        state_changed, speed_changed = healthy != a.healthy, speed != a.speed
        root = source
        if isinstance(source, _HealthGraph):
            root = source.root
            state_changed |= source.state_changed
            speed_changed |= source.speed_changed
        return cls(root, a.gpu_ids, state_changed, speed_changed, healthy, speed)

    def __call__(self) -> nx.Graph:
        changed = np.flatnonzero(self.state_changed | self.speed_changed)
        return _graph_with_health(
            self.root(),
            self.gpu_ids,
            changed,
            self.state_changed,
            self.speed_changed,
            self.healthy,
            self.speed,
        )


def _edge_set(graph: nx.Graph) -> set[tuple[frozenset[Hashable], tuple[tuple[str, Any], ...]]]:
    return {(frozenset((u, v)), tuple(sorted(d.items()))) for u, v, d in graph.edges(data=True)}
