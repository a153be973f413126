"""Domain classes and their training configurations, for the multi-workload program.

Domains whose healthy GPUs have the same speed profile form a
:class:`DomainClass`; each of its domains picks a :class:`Config`: a multiset of
training stage degrees on some of its GPUs, the GPUs left over forming serving
bins (:func:`sub_bins` cuts them where their speed drops). ``docs/workloads.md``
describes the program these feed (:mod:`ntp_opt.planners.multi.program`).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import numpy as np

from ntp_opt.model.workloads import MultiInstance
from ntp_opt.rules.tolerances import FLOAT_NOISE

#: Largest number of training configurations of one domain class.
MAX_CONFIGS = 5_000
#: Largest number of speed drops in a domain's leftover GPUs for which the planner
#: tries cutting the leftover into sub-bins of their own speed (more: one bin).
MAX_CUT_RUNS = 4

#: A serving bin: ``(first position, size, speed)`` in a domain's fastest-first GPU order.
Bin = tuple[int, int, float]


@dataclass(frozen=True)
class Config:
    """Training stages of one domain and the GPUs they leave to serving.

    Attributes
    ----------
    stages
        Per stage ``(degree, capability, first position)``.
    used
        GPUs the stages use.
    free
        Positions ``[lo, hi)`` left free for serving.
    needs
        Optimistic configurations: per stage, the slowest speed that still gives
        its capability (its GPUs are at least that fast).
    """

    stages: tuple[tuple[int, int, int], ...]
    used: int
    free: tuple[int, int]
    needs: tuple[float, ...] = ()


@dataclass(frozen=True)
class DomainClass:
    """Domains whose healthy GPUs have the same speeds.

    Attributes
    ----------
    domains
        Domain indices.
    gpus
        Per domain, its healthy GPU indices, fastest first.
    speed
        The speeds of those GPUs (the same for every domain of the class).
    """

    domains: tuple[int, ...]
    gpus: tuple[np.ndarray, ...]
    speed: np.ndarray


def domain_classes(multi: MultiInstance) -> list[DomainClass]:
    """The domains with a healthy GPU, grouped by their healthy GPUs' speeds.

    Parameters
    ----------
    multi
        The instance and its workloads.

    Returns
    -------
    list of DomainClass
        In the order of each class's first domain.
    """
    a = multi.instance.arrays
    groups: dict[tuple[float, ...], list[tuple[int, np.ndarray]]] = {}
    for d, members in enumerate(a.domain_gpus):
        ok = members[a.healthy[members]]
        if len(ok) == 0:
            continue
        ok = ok[np.argsort(-a.speed[ok], kind="stable")]
        groups.setdefault(tuple(a.speed[ok].tolist()), []).append((d, ok))
    return [
        DomainClass(tuple(d for d, _ in ms), tuple(g for _, g in ms), np.array(key))
        for key, ms in groups.items()
    ]


def capability(multi: MultiInstance, t: int, slowest: float, theta: float) -> int:
    """Sequences a stage of degree ``t`` carries at step time ``theta``.

    Parameters
    ----------
    multi
        The instance and its workloads.
    t
        The stage's TP degree.
    slowest
        Speed of its slowest GPU.
    theta
        The pre-overhead step time.

    Returns
    -------
    int
        ``min(max_local_batch, floor(theta f(t) s / c))`` (may be below 1).
    """
    job = multi.instance.job
    cap = min(job.local_batch_max, job.global_batch)
    b = math.floor(theta * job.tp_factor(t) * slowest / job.seq_time_s * (1 + FLOAT_NOISE))
    return min(cap, b)


@dataclass(frozen=True)
class _Listing:
    """What :func:`_extend` lists the configurations of one domain with."""

    multi: MultiInstance
    speed: np.ndarray
    desc: list[int]
    theta: float
    optimistic: bool


def _extend(
    lst: _Listing, out: list[Config], start: int, first: int, stages: list[tuple[int, int, int]]
) -> None:
    """Append every configuration that adds stages (degrees from ``desc[first]`` down)
    at position ``start`` to ``stages``."""
    h = len(lst.speed)
    for k in range(first, len(lst.desc)):
        t = lst.desc[k]
        if start + t > h:
            continue
        slowest = lst.speed[t - 1] if lst.optimistic else lst.speed[start + t - 1]
        b = capability(lst.multi, t, float(slowest), lst.theta)
        if b < 1:
            continue
        new = [*stages, (t, b, start)]
        out.append(Config(tuple(new), start + t, (start + t, h)))
        if len(out) > MAX_CONFIGS:
            raise ValueError(
                f"more than {MAX_CONFIGS} training configurations per domain: "
                "job.tp_allowed is too fine for the domain size"
            )
        _extend(lst, out, start + t, k, new)


def configs(
    multi: MultiInstance,
    speed: np.ndarray,
    degrees: tuple[int, ...],
    theta: float,
    optimistic: bool = False,
) -> list[Config]:
    """Every multiset of training stage degrees the domain holds (empty first).

    Stages sit on the domain's fastest GPUs, largest first; when speeds differ
    inside the domain, each multiset is also listed on its slowest GPUs (the
    fast ones left to serving).

    Parameters
    ----------
    multi
        The instance and its workloads.
    speed
        The domain's healthy GPU speeds, fastest first.
    degrees
        The training stage degrees.
    theta
        The pre-overhead step time.
    optimistic
        Give every stage of degree ``t`` the capability of the domain's ``t``
        fastest GPUs (an upper bound on where any plan can put it), and list it
        with every lower capability the domain's speeds give too, each needing
        GPUs at least as fast as the slowest speed giving it (:attr:`Config.needs`).

    Returns
    -------
    list of Config

    Raises
    ------
    ValueError
        More than :data:`MAX_CONFIGS` configurations.
    """
    h = len(speed)
    out = [Config((), 0, (0, h))]
    if degrees:
        lst = _Listing(multi, speed, sorted(degrees, reverse=True), theta, optimistic)
        _extend(lst, out, 0, 0, [])
    if speed[0] == speed[h - 1]:
        return out
    if optimistic:
        return [out[0], *capability_variants(multi, speed, out[1:], theta)]
    for cfg in out[1:]:
        shift = h - cfg.used
        back = [
            (t, capability(multi, t, float(speed[first + shift + t - 1]), theta), first + shift)
            for t, _, first in cfg.stages
        ]
        if all(b >= 1 for _, b, _ in back):
            out.append(Config(tuple(back), cfg.used, (0, shift)))
    return out


def _stage_choices(
    multi: MultiInstance, speed: np.ndarray, levels: list[float], t: int, theta: float
) -> list[tuple[int, int, float]]:
    """Every capability a stage of degree ``t`` may get, with the speed it needs."""
    caps: dict[int, float] = {}
    for v in levels:  # ascending: the first speed giving a capability is its need
        if v <= speed[t - 1]:
            b = capability(multi, t, v, theta)
            if b >= 1:
                caps.setdefault(b, v)
    return [(t, b, v) for b, v in caps.items()]


def capability_variants(
    multi: MultiInstance, speed: np.ndarray, configs: list[Config], theta: float
) -> list[Config]:
    """Optimistic configurations of a domain whose GPU speeds differ.

    Each stage at any capability the domain's speeds give (up to that of its
    ``t`` fastest GPUs), with the speeds it needs, as long as the domain has
    enough GPUs at least as fast for all stages together.

    Parameters
    ----------
    multi
        The instance and its workloads.
    speed
        The domain's healthy GPU speeds, fastest first.
    configs
        The configurations (their stage degrees) to vary.
    theta
        The pre-overhead step time.

    Returns
    -------
    list of Config
        With :attr:`Config.needs` set; each multiset of ``(degree, capability,
        need)`` once.
    """
    levels = sorted({float(v) for v in speed})
    at_least = {v: int(np.sum(speed >= v)) for v in levels}
    out: list[Config] = []
    seen: set[tuple[tuple[int, int, float], ...]] = set()
    for cfg in configs:
        choices = [_stage_choices(multi, speed, levels, t, theta) for t, _, _ in cfg.stages]
        for pick in itertools.product(*choices):
            key = tuple(sorted(pick))
            if key in seen:
                continue
            if any(sum(t for t, _, v in pick if v >= lv) > at_least[lv] for lv in levels):
                continue
            seen.add(key)
            stages = tuple((t, b, 0) for t, b, _ in key)
            out.append(Config(stages, cfg.used, cfg.free, tuple(v for _, _, v in key)))
    return out


@dataclass(frozen=True)
class _Leftover:
    """A domain's leftover GPUs ``speed[..:end]``, the positions where their speed drops
    and the serving degrees: what :func:`_cut` cuts."""

    speed: np.ndarray
    end: int
    drops: list[int]
    chain: tuple[int, ...]


def _cut(
    left: _Leftover, out: list[tuple[Bin, ...]], k: int, c: int, bins: tuple[Bin, ...]
) -> None:
    """Append every way to cut the leftover from position ``c``, at drops ``k`` on."""
    h, speed, drops = left.end, left.speed, left.drops
    if k == len(drops):
        out.append((*bins, (c, h - c, float(speed[h - 1]))) if c < h else bins)
        return
    e = drops[k]
    if e <= c:
        _cut(left, out, k + 1, c, bins)
        return
    for p in sorted({c, e, *(c + s * ((e - c) // s) for s in left.chain)}):
        _cut(left, out, k + 1, p, (*bins, (c, p - c, float(speed[p - 1]))) if p > c else bins)


def sub_bins(
    speed: np.ndarray, start: int, end: int, chain: tuple[int, ...]
) -> list[tuple[Bin, ...]]:
    """Ways to cut a domain's leftover GPUs into serving bins.

    One bin valued at the slowest leftover GPU is always a way. Where the
    leftover's speed drops, it may be cut at the drop or a little before it
    (at a multiple of a serving degree from the previous cut), so that replicas
    on the faster GPUs keep their speed (a latency target may depend on it).

    Parameters
    ----------
    speed
        The domain's healthy GPU speeds, fastest first.
    start, end
        The leftover: positions ``[start, end)``.
    chain
        The serving degrees.

    Returns
    -------
    list of tuple of Bin
        Each way: bins ``(first position, size, speed)``, each valued at its
        slowest GPU.
    """
    h = end
    if start >= h:
        return [()]
    drops = [e for e in range(start + 1, h) if speed[e] < speed[e - 1]]
    if not drops or len(drops) > MAX_CUT_RUNS:
        return [((start, h - start, float(speed[h - 1])),)]
    out: list[tuple[Bin, ...]] = []
    _cut(_Leftover(speed, h, drops, chain), out, 0, start, ())
    return out
