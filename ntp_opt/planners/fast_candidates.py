"""The ``fast`` planner's candidates: built, scored with the exact batch split, improved.

Candidates (each packed by sorted grouping, see ``docs/milp.md``):

* ``dp-drop``: full-degree slots only (no resharding overhead);
* ``ntp``: the paper's slots (full slots plus one reduced slot per domain);
* ``speed-aware``: each domain cut greedily into the stages of largest
  ``f(t) * slowest speed``: a straggler is left out as a spare when a
  smaller degree on faster GPUs is worth more, which the paper's heuristic
  never does;
* ``count-fit`` and ``count-max`` (only when the paper's slots are too few for
  the replicas a ``fixed`` batch needs, or for as many as may run): domains
  cut into more, smaller stages (:func:`count_fit_table`), so that ``fast``
  does not pause a job that smaller stages can run;
* ``even`` (:func:`even_table`): each domain cut into as many stages as the
  paper's cut, all of one degree (two TP33 rather than TP36 and TP30);
* ``ntp-spread`` and ``even-spread`` (only when a rack could not feed all
  its GPUs at their largest multiplier, :func:`racks_bind`): the same cuts
  with each domain's GPUs and slots taken from every rack alike, so that the
  replicas leave each rack room to boost;

each also in a *degree-fit* variant when the budgets force replicas out
(:func:`~ntp_opt.planners.fast_cuts.fit_power_by_degree`: one replica fewer
dropped, degrees lowered instead, worst replica first) and a *level-fit* one
(the highest degrees lowered first), and each without power boost, with the
boost of :func:`ntp_opt.planners.heuristics.ntp_pw` (slow replicas lifted to nominal
speed, cheapest first) and with :func:`~ntp_opt.planners.fast_cuts.boost_floor`
(every replica lifted to the highest common speed).
From the best candidate (and the best spread one), two local steps when
power can be boosted: :func:`capped_boosted` (every degree capped at a lower
one, the watts freed spent on the floor boost) and :func:`fewer_boosted`
(the worst replicas dropped, their watts spent on the others' boost), each
kept only when it raises goodput; the same drop after :func:`rack_regrouped`
(the stages regrouped into whole replicas per rack, the slowest left over
last). Last, :func:`lead_boosted` spends the watts the floor boost leaves in
roomy racks on the replicas of the largest batch, from the best candidate
and the best regrouped one.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ntp_opt.model.instance import Instance
from ntp_opt.planners.fast_cuts import (
    boost_floor_packed,
    count_fit_table,
    even_table,
    fit_by_degree,
    paper_slots,
    replicas_needed,
    speed_aware_table,
)
from ntp_opt.planners.packing import (
    Packing,
    boost_slowest_packed,
    domain_slot_table,
    fit_packing,
    pack,
    replica_speeds,
    split_packing,
    used_mask,
)
from ntp_opt.rules.boost import boost_floor_stages
from ntp_opt.rules.power import can_boost, exceeds, gpu_draw, headroom, idle_draw
from ntp_opt.rules.tolerances import FLOAT_NOISE, IMPROVE_TOL


@dataclass(frozen=True, eq=False)
class Candidate:
    """A plan in array form (replicas, multipliers per stage), its goodput (exact split)."""

    name: str
    packing: Packing
    powers: np.ndarray
    batches: tuple[int, ...]
    goodput: float


def _names(name: str, kinds: tuple[str, ...]) -> list[str]:
    return [f"{name}+{b}" if b else name for b in kinds]


def _score(
    instance: Instance,
    name: str,
    packing: Packing,
    boost: str,
    unboosted: list[Candidate | None] | None = None,
) -> Candidate | None:
    """``packing`` (fitted to the budgets) with boost ``boost``, split exactly.

    ``unboosted``: the packing's candidate without boost, already scored (as
    a list of one); a boost that changes no multiplier takes its split.
    """
    if boost == "slow":
        powers = boost_slowest_packed(instance, packing)
    elif boost == "floor":
        powers = boost_floor_packed(instance, packing)
    else:
        powers = np.ones(packing.members.shape)
    if boost and unboosted and bool((powers == 1.0).all()):
        c = unboosted[0]
        return None if c is None else Candidate(name, packing, powers, c.batches, c.goodput)
    split = split_packing(instance, packing, powers)
    if split is None:
        return None
    return Candidate(name, packing, powers, split.batches, split.goodput)


def candidates(instance: Instance, *, cancel: threading.Event | None = None) -> list[Candidate]:
    """Score every candidate (see the module docstring), best first.

    Parameters
    ----------
    instance
        The instance.
    cancel
        Once set, no further packing is started after the first scored
        candidate: the best of those scored so far wins.

    Returns
    -------
    list of Candidate
        Sorted by goodput, best first; candidates with no feasible batch
        split (a paused ``fixed`` job) are left out.
    """
    scorer = _Scorer(instance, cancel)
    packs = _score_makers(scorer, _makers(instance, scorer.boost))
    for name, (packed, kept) in packs.items():  # tight budgets: lower degrees, not a replica
        if scorer.stop():
            break
        fitted = fit_by_degree(instance, packed, kept)
        if fitted is not None:
            scorer.score(f"{name}+degree-fit", fit_packing(instance, fitted))
        level = fit_by_degree(instance, packed, kept, level=True)
        if level is not None:  # even degrees: the floor boost is the one that fits them
            scorer.score(f"{name}+level-fit", fit_packing(instance, level), slow=False)
    out = scorer.out
    out.sort(key=lambda c: -c.goodput)
    if out and scorer.boost and not scorer.stop():
        out = _local_steps(instance, out)
    return out


class _Scorer:
    """The candidates scored so far, and the packings already scored (by their degrees
    and GPUs: a packing another maker already built scores the same, so its
    candidates are reused under the new name)."""

    def __init__(self, instance: Instance, cancel: threading.Event | None) -> None:
        self.instance = instance
        self.cancel = cancel
        self.boost = can_boost(instance)
        self.out: list[Candidate] = []
        self.seen: dict[tuple[bytes, bytes, int], list[Candidate | None]] = {}

    def score(self, name: str, packing: Packing, slow: bool = True) -> None:
        """Score ``packing`` without boost and with each boost (``slow``: also the
        boost of slow replicas to nominal speed)."""
        kinds = (("", "slow", "floor") if slow else ("", "floor")) if self.boost else ("",)
        key = (packing.tp.tobytes(), packing.stages().gpus.tobytes(), len(kinds))
        if key in self.seen:
            scored = [
                None if c is None else Candidate(n, packing, c.powers, c.batches, c.goodput)
                for c, n in zip(self.seen[key], _names(name, kinds), strict=True)
            ]
        else:
            scored = []
            for b, n in zip(kinds, _names(name, kinds), strict=True):
                if scored and scored[0] is None:
                    # no split without boost: too many replicas, too few for a
                    # fixed B, or a replica at speed 0; no multiplier changes that
                    scored.append(None)
                    continue
                scored.append(_score(self.instance, n, packing, b, unboosted=scored[:1]))
            self.seen[key] = scored
        self.out.extend(c for c in scored if c is not None)

    def stop(self) -> bool:
        """Cancelled, with a candidate scored."""
        return self.cancel is not None and self.cancel.is_set() and bool(self.out)


def _makers(instance: Instance, boost: bool) -> dict[str, Callable[[], Packing]]:
    """The packings to score, by name, in the order they are scored."""
    makers: dict[str, Callable[[], Packing]] = {
        "dp-drop": lambda: pack(instance, domain_slot_table(instance, reduced=False)),
        "ntp": lambda: pack(instance, domain_slot_table(instance, reduced=True)),
        "speed-aware": lambda: pack(instance, speed_aware_table(instance), by_value=True),
    }
    # too few slots for the replicas the batch needs, or for as many as may run
    job = instance.job
    recut = count_fit_table(instance)
    if recut is not None:
        makers["count-fit"] = lambda: pack(instance, recut)
    most = min(job.replicas_max, job.global_batch)
    if most > replicas_needed(instance):
        more = count_fit_table(instance, most)
        if more is not None:
            makers["count-max"] = lambda: pack(instance, more)
        # one replica more than the paper's slots hold, not as many as may run: the
        # domains cut less finely (six TP11 stages of 71 GPUs rather than seven TP10)
        one_more = paper_slots(instance) // job.pp + 1
        if replicas_needed(instance) < one_more < most:
            next_cut = count_fit_table(instance, one_more)
            if next_cut is not None:
                makers["count-next"] = lambda: pack(instance, next_cut)
    makers["even"] = lambda: pack(instance, even_table(instance), by_value=True)
    if boost and racks_bind(instance):
        makers["ntp-spread"] = lambda: pack(
            instance, domain_slot_table(instance, reduced=True, spread=True), spread=True
        )
        makers["even-spread"] = lambda: pack(
            instance, even_table(instance, spread=True), by_value=True, spread=True
        )
    return makers


def _score_makers(
    scorer: _Scorer, makers: dict[str, Callable[[], Packing]]
) -> dict[str, tuple[Packing, Packing]]:
    """Each maker's packing scored as fitted to the budgets; per name, the packing as
    packed and as fitted."""
    instance = scorer.instance
    packs: dict[str, tuple[Packing, Packing]] = {}
    # scored in the same order as ever, so that ties go the same way; a maker
    # whose packing an earlier one built (the paper's cut is often already even)
    # adds nothing, nor do its degree fits
    built: set[tuple[bytes, bytes]] = set()
    for name, make in makers.items():
        if scorer.stop():
            break
        packed = make()
        key = (packed.tp.tobytes(), packed.stages().gpus.tobytes())
        if key in built:
            continue
        built.add(key)
        packs[name] = (packed, fit_packing(instance, packed))
        scorer.score(name, packs[name][1])
    return packs


def _local_steps(instance: Instance, out: list[Candidate]) -> list[Candidate]:
    """``out`` (best first) with the local steps' candidates, best first."""
    # local steps from the best candidate, and from the best spread one (whose
    # racks have room for the boost a step frees watts for)
    starts = [out[0]]
    starts += [c for c in out if "-spread" in c.name and c is not out[0]][:1]
    better: list[Candidate] = []
    for c in starts:
        capped = capped_boosted(instance, c)
        fewer = fewer_boosted(instance, capped or c)
        better += [x for x in (capped, fewer) if x is not None]
        regrouped = rack_regrouped(instance, c)
        if regrouped is not None:  # replicas by rack: the roomy racks boost their own
            again = _score(instance, f"{c.name}+by-rack", regrouped, "floor")
            if again is not None:
                better += [again]
                better += [x for x in (fewer_boosted(instance, again),) if x is not None]
    out = sorted(out + better, key=lambda c: -c.goodput)  # stable: ties as before
    # the watts the floor boost leaves in roomy racks, spent on the replicas of
    # the largest batch: from the best candidate and the best regrouped one
    tops = [out[0], *[c for c in out if "+by-rack" in c.name and c is not out[0]][:1]]
    leads = [x for x in (lead_boosted(instance, c) for c in tops) if x is not None]
    return sorted(leads + out, key=lambda c: -c.goodput)


def racks_bind(instance: Instance) -> bool:
    """Would some rack exceed its budget with all its healthy GPUs at their largest multiplier?

    Only then does it matter which racks a plan's stages draw on
    (``spread`` candidates).
    """
    a = instance.arrays
    draw = gpu_draw(instance, np.where(a.healthy, instance.max_multiplier, 0.0))
    per_rack = np.bincount(a.gpu_rack, weights=draw, minlength=len(a.rack_ids))
    return bool(exceeds(per_rack, a.rack_budget, tol=0.0, slack=0.0).any())


def capped_boosted(instance: Instance, best: Candidate) -> Candidate | None:
    """Lower degrees, more boost: ``best`` with every replica's degree capped at one of
    its smaller degrees, the watts freed spent on the floor boost; the best cap
    that raises goodput, or ``None``.

    Under a tight budget and the ``fixed`` policy, replicas of a degree above
    the slowest one's draw watts that raise no goodput: at one degree, every
    replica can be boosted instead (ten TP68 and six TP72 replicas become
    sixteen TP68 ones at 1.02).
    """
    tp = best.packing.tp
    found: Candidate | None = None
    value = best.goodput
    for t in sorted(set(tp.tolist()), reverse=True)[1:]:
        c = _score(
            instance, f"{best.name}+cap{t}", best.packing.with_tp(np.minimum(tp, t)), "floor"
        )
        if c is not None and c.goodput > value * (1 + IMPROVE_TOL):
            found, value = c, c.goodput
    return found


def fewer_boosted(instance: Instance, best: Candidate) -> Candidate | None:
    """Fewer replicas, more boost: ``best`` without its last replicas, the watts they
    drew spent on boosting the others, while goodput grows.

    Where a budget caps the boost, a replica dropped may be worth less than
    the boost its watts buy the others (a slow or reduced replica, ``alpha``
    near 1, no idle draw). Replicas are dropped one at a time, last (worst)
    first, each packing boosted both ways; the first drop that gains nothing
    stops it. ``None`` when no drop gains. A drop is only tried when the watts it
    frees (and the site's room), spread evenly over the others' GPUs, would
    raise their speed by more than the share of speed dropped: with hundreds
    of alike replicas (32k-131k GPUs) one replica's watts buy less than the
    replica, and nothing is scored.
    """
    a = instance.arrays
    job = instance.job
    packing = best.packing
    st = packing.stages()
    sizes = np.diff(st.start)
    per_gpu = np.repeat(best.powers.ravel(), sizes)
    power_of = np.zeros(a.n_gpus)
    power_of[st.gpus] = per_gpu
    draw = gpu_draw(instance, power_of, at=st.gpus)
    watts = np.bincount(np.repeat(st.replica, sizes), weights=draw, minlength=len(packing))
    idle = idle_draw(instance)[st.gpus]  # the stages' GPUs are healthy
    freed = watts - np.bincount(np.repeat(st.replica, sizes), weights=idle, minlength=len(packing))
    room = max(float(headroom(instance, power_of)[1]), 0.0)
    speeds = replica_speeds(instance, packing, best.powers)
    found: Candidate | None = None
    value = best.goodput
    total = float(speeds.sum())
    for k in range(len(packing) - 1, 0, -1):
        rest = float(watts[:k].sum())
        spare = room + float(freed[k:].sum())
        if rest <= 0 or total <= 0:
            break
        gain = (1.0 + spare / rest) ** job.power_exponent * float(speeds[:k].sum()) / total
        if gain <= 1 + IMPROVE_TOL:
            break
        head = packing.head(k)
        scored = [
            _score(instance, f"{best.name}+drop{len(best.packing) - k}", head, b)
            for b in ("floor", "slow")
        ]
        top = max((c for c in scored if c is not None), key=lambda c: c.goodput, default=None)
        if top is None or top.goodput <= value * (1 + IMPROVE_TOL):
            break
        found, value = top, top.goodput
    return found


def rack_regrouped(instance: Instance, best: Candidate) -> Packing | None:
    """``best``'s stages regrouped rack by rack: each replica drawn from one rack where it can.

    Each rack's fastest stages form as many whole replicas as they can, the
    rack with the most watts left (at power 1) first; the stages left over
    (the slowest of each rack) form the last replicas, fastest first. A
    replica whose stages share a rack with room is one that rack can boost
    alone, and dropping the last replica (:func:`fewer_boosted`) drops the
    slow leftovers rather than leaving one rack more stages to feed than
    another. A stage counts in the rack of its first GPU (a domain across
    racks: its fastest). Only where every replica runs at one degree (the
    stages are then interchangeable); ``None`` when nothing moves.
    """
    packing = best.packing
    if len(packing) < 2 or len(set(packing.tp.tolist())) != 1:
        return None
    a = instance.arrays
    t = int(packing.tp[0])
    flat = packing.members.ravel()
    rack = a.gpu_rack[packing.slots.gpus[flat, 0]]
    room, _ = headroom(instance, used_mask(instance, packing).astype(float))
    order_of_rack = np.empty(len(a.rack_budget), dtype=np.int64)
    racks_by_room = np.argsort(-room, kind="stable")
    order_of_rack[racks_by_room] = np.arange(len(racks_by_room))
    speed = packing.slots.prefix[flat, t - 1]
    pp = packing.members.shape[1]
    by_rack = np.lexsort((np.arange(len(flat)), -speed, order_of_rack[rack]))
    start = np.searchsorted(order_of_rack[rack][by_rack], order_of_rack[rack][by_rack])
    within = np.empty(len(flat), dtype=np.int64)
    within[by_rack] = np.arange(len(flat)) - start  # rank of the stage in its rack
    whole = np.bincount(rack, minlength=len(room))[rack] // pp * pp
    left = within >= whole  # the stages no whole replica of their rack takes: last
    order = np.lexsort((np.arange(len(flat)), -speed, np.where(left, 0, order_of_rack[rack]), left))
    members = flat[order].reshape(packing.members.shape)
    if np.array_equal(members, packing.members):
        return None
    return Packing(packing.slots, members, packing.tp)


def lead_boosted(instance: Instance, best: Candidate, most: int = 8) -> Candidate | None:
    """``best`` with the watts its racks have left spent on its replicas of the largest
    batch, each raised as far as its own racks allow; ``None`` when goodput does not grow.

    The floor boost (:func:`boost_floor_packed`) raises every replica to one
    speed, as far as the tightest rack allows: racks with room keep it. Under
    the ``fixed`` policy the replica given the larger share of the batch sets
    the pace; under ``elastic`` any faster replica carries more. The replicas
    are taken largest batch first (then fastest, at most ``most`` of them),
    each boosted (:func:`ntp_opt.rules.boost.boost_floor_stages`, the
    replica alone) within the rooms the others leave, and the batch split again.
    """
    packing = best.packing
    if len(packing) == 0 or best.goodput <= 0:
        return None
    a = instance.arrays
    powers = best.powers.copy()
    st = packing.stages()
    sizes = np.diff(st.start)
    speeds = replica_speeds(instance, packing, powers)
    batches = np.array(best.batches, dtype=np.int64)
    order = np.lexsort((np.arange(len(packing)), -speeds, -batches))[:most]
    pp = packing.members.shape[1]
    base = packing.stage_speeds()
    alpha = instance.job.power_exponent
    changed = False
    for r in order.tolist():
        if batches[r] <= 0:
            break
        power_of = np.zeros(a.n_gpus)
        power_of[st.gpus] = np.repeat(powers.ravel(), sizes)
        lo, hi = st.start[r * pp], st.start[(r + 1) * pp]
        power_of[st.gpus[lo:hi]] = 1.0
        rack_room, site_room = headroom(instance, power_of)
        one = Packing(packing.slots, packing.members[r : r + 1], packing.tp[r : r + 1])
        up = boost_floor_stages(instance, one.stages(), one.tp, rack_room, site_room)
        if (up**alpha * base[r]).min() > (powers[r] ** alpha * base[r]).min() * (1 + FLOAT_NOISE):
            powers[r] = up  # faster than before (the stages at a limit kept within the rooms)
            changed = True
    if not changed:
        return None
    split = split_packing(instance, packing, powers)
    if split is None or split.goodput <= best.goodput * (1 + IMPROVE_TOL):
        return None
    return Candidate(f"{best.name}+lead", packing, powers, split.batches, split.goodput)
