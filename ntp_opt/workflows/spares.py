"""Spare-domain search (docs/model.md, spec section 5): fewest spares a policy never stalls with.

* :func:`spares_search` finds the fewest spare domains for which a policy
  never stalls (pauses, or falls below a goodput threshold) on a trace drawn
  on the largest cluster and restricted (:func:`restrict_trace`) to smaller
  ones; :func:`spares_needed` draws the trace and asks it about pauses.

The search assumes that more spares never hurt (if ``k`` spares suffice, so
do ``k + 1``): from ``k = start`` it steps up (``start + 1, + 2, + 4, ...``,
at most ``max_spares``) until one suffices, or down (``start - 1, - 2, - 4,
...``) while they suffice, then bisects between the last ``k`` that stalls
and the first that does not, planning ``O(log |answer - start|)`` restricted
traces; a good guess for ``start`` (e.g. the peak count of domains with a GPU
down, for ``dp-drop``) makes it two probes. That more spares never hurt holds
for ``dp-drop`` and for exact planners proven optimal (more domains only add
plans, and, when ``dp_max`` grows with ``k``, more replicas); for the other
heuristics it is an assumption, checked against the linear scan in the
tests. A trace is planned state by state with early exit at the first stall,
states with the most GPUs down first, and ``prune`` skips states that cannot
stall when a state with more failures does not:

* ``"none"``: plan every distinct state;
* ``"maximal"``: plan only states whose set of GPUs down is maximal under
  inclusion (assumes failures never help: exact for ``dp-drop`` and proven
  optimal plans, an assumption for the other heuristics);
* ``"symmetric"``: with interchangeable domains
  (:func:`interchangeable_domains`), a state is its sorted per-domain counts
  of GPUs down, and only the counts that no other state dominates entry by
  entry are planned (same assumption as ``"maximal"``).

The choices the spec left open are recorded in ``docs/simulation.md``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from ntp_opt.model.instance import Instance
from ntp_opt.rules.tolerances import THRESHOLD_TOL
from ntp_opt.solve import POLICIES, Result, solve
from ntp_opt.workflows.traces import (
    Trace,
    check_trace,
    generate_trace,
    restrict_trace,
    state_instance,
    trace_states,
)

#: Ways :func:`spares_search` may skip states (see its docstring).
Prune = Literal["none", "maximal", "symmetric"]
PRUNES: tuple[str, ...] = ("none", "maximal", "symmetric")


def interchangeable_domains(instance: Instance) -> str | None:
    """Why the domains of ``instance`` are not interchangeable, or ``None`` if they are.

    Interchangeable: every domain has the same number of GPUs, is a rack of its
    own (one domain per rack, equal rack budgets), and every GPU is healthy with
    the same speed, TDP, ``max_power_w`` and ``p_fail`` (and every tray the same
    ``p_fail``).
    Then any permutation of the domains, and of the GPUs inside a domain, maps
    the cluster onto itself for every planner that sees a domain only through
    its count of healthy GPUs (every policy of :data:`ntp_opt.solve.POLICIES`),
    so a state of failures matters only through its sorted per-domain counts of
    down GPUs. The paper's NVL32 cluster is such a cluster.
    """
    a = instance.arrays
    if a.n_gpus == 0:
        return "the cluster has no GPU"
    if len({len(m) for m in a.domain_gpus}) > 1:
        return "domains differ in size"
    if not bool(a.healthy.all()):
        return "some GPUs are failed in the instance"
    for name, arr in (
        ("speed", a.speed),
        ("tdp_w", a.tdp),
        ("max_power_w", a.max_power),
        ("p_fail", a.p_fail),
    ):
        if not bool(np.all(arr == arr[0])):
            return f"GPUs differ in {name}"
    if len(a.tray_p_fail) and not bool(np.all(a.tray_p_fail == a.tray_p_fail[0])):
        return "trays differ in p_fail"
    pairs = {(int(d), int(r)) for d, r in zip(a.gpu_domain, a.gpu_rack, strict=True)}
    if len(pairs) != a.n_domains or len({r for _, r in pairs}) != a.n_domains:
        return "racks and domains are not one to one"
    if len(a.rack_ids) != a.n_domains or not bool(np.all(a.rack_budget == a.rack_budget[0])):
        return "racks differ in power budget (or some rack holds no domain)"
    return None


@dataclass(frozen=True)
class SparesResult:
    """Outcome of :func:`spares_search`.

    Attributes
    ----------
    policy
        The planner name.
    spares
        Fewest spare domains (``0 .. max_spares``) with which the policy never
        stalls on the trace; ``None`` when it stalls even with ``max_spares``.
    max_spares
        Largest number of spare domains tried.
    min_relative_goodput
        The stall threshold (0: only a paused job stalls).
    probes
        Every number of spares tried, and whether the policy ran the whole
        trace without a stall with it.
    binding
        ``(t_hours, relative_goodput)`` of a state that stalls with
        ``spares - 1`` spares (why one fewer is not enough), or with
        ``max_spares`` when ``spares`` is ``None``; ``None`` when ``spares``
        is 0.
    states
        Distinct states of failures in the trace (on ``build(max_spares)``).
    planned
        Calls to the planner (states of failures planned, all probes together).
    """

    policy: str
    spares: int | None
    max_spares: int
    min_relative_goodput: float
    probes: dict[int, bool]
    binding: tuple[float, float] | None
    states: int
    planned: int


def _signature(instance: Instance, down: frozenset[int]) -> tuple[int, ...]:
    """Per-domain counts of down GPUs, largest first, domains with none left out."""
    if not down:
        return ()
    counts = np.bincount(instance.arrays.gpu_domain[list(down)])
    return tuple(sorted((int(c) for c in counts if c > 0), reverse=True))


def _dominated(small: tuple[int, ...], big: tuple[int, ...]) -> bool:
    return len(small) <= len(big) and all(x <= y for x, y in zip(small, big, strict=False))


def _candidates(
    instance: Instance, states: list[tuple[float, frozenset[int]]], prune: str
) -> list[tuple[float, frozenset[int], Hashable]]:
    """The states to plan, as ``(time, down set, cache key)``, most GPUs down first."""
    out: list[tuple[float, frozenset[int], Hashable]] = []
    if prune == "symmetric":
        first: dict[tuple[int, ...], tuple[float, frozenset[int]]] = {}
        for t, down in states:
            first.setdefault(_signature(instance, down), (t, down))
        kept: list[tuple[int, ...]] = []
        for sig in sorted(first, key=lambda s: (-sum(s), s)):
            if not any(_dominated(sig, k) for k in kept):
                kept.append(sig)
        out = [(*first[sig], sig) for sig in kept]
    else:
        seen: dict[frozenset[int], float] = {}
        for i, (t, down) in enumerate(states):
            if prune == "maximal" and i + 1 < len(states) and down <= states[i + 1][1]:
                continue  # the next state has every failure of this one
            seen.setdefault(down, t)
        sets = sorted(seen, key=lambda d: (-len(d), seen[d]))
        if prune == "maximal":
            maximal: list[frozenset[int]] = []
            for d in sets:
                if not any(d < m for m in maximal):
                    maximal.append(d)
            sets = maximal
        out = [(seen[d], d, d) for d in sets]
    out.sort(key=lambda c: (-len(c[1]), c[0]))
    return out


def _check_search_args(
    policy: str, prune: str, max_spares: int, start: int, min_relative_goodput: float
) -> float:
    """Validate :func:`spares_search`'s arguments; return the goodput threshold."""
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}; known: {', '.join(POLICIES)}")
    if prune not in PRUNES:
        raise ValueError(f"prune must be one of {', '.join(PRUNES)}, got {prune!r}")
    if not (isinstance(max_spares, int) and max_spares >= 0):
        raise ValueError(f"max_spares must be an integer >= 0, got {max_spares!r}")
    if not (isinstance(start, int) and 0 <= start <= max_spares):
        raise ValueError(f"start must be an integer in [0, max_spares={max_spares}], got {start!r}")
    thr = float(min_relative_goodput)
    if not (math.isfinite(thr) and thr >= 0):
        raise ValueError(f"min_relative_goodput must be finite and >= 0, got {thr!r}")
    return thr


def _fewest_that_run(runs: Callable[[int], bool], start: int, max_spares: int) -> int | None:
    """Fewest k in [0, max_spares] for which ``runs(k)`` (monotone in k), or None."""
    # Exponential search from `start` (start, start + 1, start + 2, start + 4,
    # ... up to max_spares, or downwards when `start` already suffices), then
    # bisection between the last k that stalls and the first that runs. Probes
    # that stall stop at their first stalling state, so they are cheap.
    lo, hi = -1, None  # lo: a k that stalls (-1: none); hi: a k that runs
    if runs(start):
        hi, step = start, 1
        while hi - lo > 1:
            k = max(lo, hi - step)
            if k <= lo or k < 0:
                break
            if runs(k):
                hi, step = k, 2 * step
            else:
                lo = k
                break
    else:
        lo, step = start, 1
        while lo < max_spares:
            k = min(max_spares, lo + step)
            if runs(k):
                hi = k
                break
            lo, step = k, 2 * step
    if hi is None:
        return None
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if runs(mid):
            hi = mid
        else:
            lo = mid
    return hi


def spares_search(
    build: Callable[[int], Instance],
    trace: Trace,
    policy: str,
    *,
    max_spares: int,
    min_relative_goodput: float = 0.0,
    time_limit: float = 5.0,
    prune: Prune = "none",
    start: int = 0,
    solver: Callable[..., Result] = solve,
) -> SparesResult:
    """Fewest spare domains for which ``policy`` never stalls on ``trace``.

    ``build(k)`` returns the instance with ``k`` spare domains (for example a
    cluster of ``dp * pp + k`` domains for the same job); its GPU ids must be
    among those of ``build(max_spares)``, on which ``trace`` is drawn. With
    ``k`` spares the policy sees :func:`restrict_trace` of ``trace`` to
    ``build(k)``, so every ``k`` faces the same failures on the GPUs it shares
    with the others (spares fail too).

    A state *stalls* when the planner's relative goodput is 0 (the job pauses,
    or there is no plan) or below ``min_relative_goodput``; the policy never
    stalls with ``k`` spares when no state of the restricted trace stalls.

    The search from ``start`` and ``prune`` are described in the module docstring.

    Parameters
    ----------
    build
        ``k -> Instance`` with ``k`` spare domains.
    trace
        Failure trace on ``build(max_spares)``.
    policy
        A name of :data:`ntp_opt.solve.POLICIES`.
    max_spares
        Largest number of spare domains to try (>= 0).
    min_relative_goodput
        Stall threshold in ``[0, inf)``; 0 (default) counts only pauses.
    time_limit
        Seconds per exact solve.
    prune
        ``"none"``, ``"maximal"`` or ``"symmetric"`` (above).
    start
        First number of spares to try (``0 .. max_spares``); any value gives
        the same answer when more spares never hurt, a close guess is faster.
    solver
        Replaces :func:`ntp_opt.solve` (same signature).

    Returns
    -------
    SparesResult

    Raises
    ------
    ValueError
        On an unknown policy or prune, a negative ``max_spares`` or threshold,
        ``start`` outside ``0 .. max_spares``,
        a trace naming GPUs unknown to (or failed in) ``build(max_spares)``,
        ``build(k)`` holding GPUs that ``build(max_spares)`` lacks, or
        ``prune="symmetric"`` on a cluster whose domains are not
        interchangeable.
    """
    thr = _check_search_args(policy, prune, max_spares, start, min_relative_goodput)
    big = build(max_spares)
    check_trace(big, trace)
    probe = _Probe(build, trace, policy, max_spares, thr, time_limit, prune, solver, big)
    n_states = len({d for _, d in trace_states(big, trace)})
    answer = _fewest_that_run(probe.runs, start, max_spares)
    binding = probe.stall_at.get(max_spares if answer is None else answer - 1)
    return SparesResult(
        policy=policy,
        spares=answer,
        max_spares=max_spares,
        min_relative_goodput=thr,
        probes=dict(sorted(probe.probes.items())),
        binding=binding,
        states=n_states,
        planned=len(probe.cache),
    )


def _require_interchangeable(instance: Instance) -> None:
    """Raise ``ValueError`` unless the domains of ``instance`` are interchangeable."""
    why = interchangeable_domains(instance)
    if why is not None:
        raise ValueError(f"prune='symmetric' needs interchangeable domains: {why}")


@dataclass
class _Probe:
    """:func:`spares_search`'s probes: whether the policy runs the trace with ``k`` spares."""

    build: Callable[[int], Instance]
    trace: Trace
    policy: str
    max_spares: int
    thr: float
    time_limit: float
    prune: str
    solver: Callable[..., Result]
    big: Instance
    instances: dict[int, Instance] = field(default_factory=dict)
    cache: dict[tuple[int, Hashable], float] = field(default_factory=dict)
    probes: dict[int, bool] = field(default_factory=dict)
    stall_at: dict[int, tuple[float, float]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.instances[self.max_spares] = self.big
        if self.prune == "symmetric":
            _require_interchangeable(self.big)

    def instance_for(self, k: int) -> Instance:
        """``build(k)``, checked against ``build(max_spares)`` (built once)."""
        if k not in self.instances:
            inst = self.build(k)
            extra = [g for g in inst.arrays.gpu_ids if g not in self.big.arrays.gpu_index]
            if extra:
                raise ValueError(
                    f"build({k}) has GPUs that build({self.max_spares}) lacks: "
                    f"{', '.join(map(str, extra[:5]))}"
                )
            if self.prune == "symmetric":
                _require_interchangeable(inst)
            self.instances[k] = inst
        return self.instances[k]

    def runs(self, k: int) -> bool:
        """Whether no state of the trace restricted to ``build(k)`` stalls."""
        if k in self.probes:
            return self.probes[k]
        inst = self.instance_for(k)
        trace = self.trace
        sub = trace if k == self.max_spares else restrict_trace(trace, inst.arrays.gpu_ids)
        check_trace(inst, sub)
        for t, down, key in _candidates(inst, trace_states(inst, sub), self.prune):
            if (k, key) not in self.cache:
                res = self.solver(
                    state_instance(inst, down), self.policy, time_limit=self.time_limit
                )
                if res.limit == "interrupted":  # Ctrl-C: stop the whole simulation
                    raise KeyboardInterrupt
                g = res.relative_objective if res.plan is not None else None
                self.cache[k, key] = float(g) if g is not None else 0.0
            g = self.cache[k, key]
            if g <= 0.0 or g < self.thr * (1.0 - THRESHOLD_TOL):
                self.probes[k] = False
                self.stall_at[k] = (t, g)
                return False
        self.probes[k] = True
        return True


def spares_needed(
    build: Callable[[int], Instance],
    policy: str,
    *,
    days: float,
    seed: int = 0,
    max_spares: int = 8,
    time_limit: float = 5.0,
    **trace_kw: Any,
) -> int | None:
    """Fewest spare domains for which ``policy`` never pauses.

    ``build(k)`` must return the instance with ``k`` spare domains (for
    example a cluster of ``dp * pp + k`` domains for the same job, whose GPU
    ids are among those of ``build(max_spares)``). One trace is drawn on
    ``build(max_spares)`` with ``seed`` and ``trace_kw`` (spares fail too) and
    every ``k`` sees its restriction (:func:`restrict_trace`); the fewest
    ``k`` in ``0 .. max_spares`` with no paused state is returned, ``None`` if
    there is none. This is :func:`spares_search` with its defaults (search
    on ``k``, every distinct state planned); use it directly for a stall
    threshold, pruning or the details. Pausing is only possible under the
    ``fixed`` batch policy (or with power budgets below the idle draw).
    """
    trace = generate_trace(build(max_spares), days=days, seed=seed, **trace_kw)
    return spares_search(build, trace, policy, max_spares=max_spares, time_limit=time_limit).spares
