"""Failure traces and their replay (ntp_opt.workflows.simulate, docs/model.md, spec section 5)."""

from __future__ import annotations

import math

import networkx as nx
import numpy as np
import pytest

from ntp_opt import solve
from ntp_opt.model import topology
from ntp_opt.model.failures import failed_instance
from ntp_opt.model.instance import Instance
from ntp_opt.model.job import Job
from ntp_opt.rules.validate import check
from ntp_opt.workflows.simulate import (
    Event,
    Trace,
    generate_trace,
    interchangeable_domains,
    restrict_trace,
    simulate,
    spares_needed,
    spares_search,
)
from tests.helpers import HANG_GUARD

RHO = 1.01  # 1 + default reshard overhead


def three_domains(policy: str = "fixed", spares: int = 0, **job) -> Instance:
    """3 (+ spares) NVL8 domains of two 4-GPU trays, one rack each; TP8, one stage, R = 3."""
    g = topology.build_cluster(3 + spares, 8, 4, 2)
    spec = {"tp": 8, "pp": 1, "dp": 3, "global_batch": 24, "batch_policy": policy}
    spec.update(job)
    return Instance("three", g, Job(**spec))


def one_failure(gpus=("d0.t0.g0",), cause="software") -> Trace:
    """One failure at hour 10, repaired at hour 13, 24-hour horizon."""
    return Trace(
        (Event(10.0, "fail", tuple(gpus), cause), Event(13.0, "repair", tuple(gpus), cause)),
        24.0,
    )


def big() -> Instance:
    g = topology.build_cluster(64, 8, 4, 2)
    topology.fail_gpus(g, ["d5.t0.g1", "d9.t1.g3"])
    return Instance("big", g, Job(tp=8, pp=2, dp=32, global_batch=256))


# ---------------------------------------------------------------- traces


def exposure_gpu_hours(inst: Instance, trace: Trace) -> float:
    """Integral over time of the number of up GPUs."""
    n_up = int(inst.arrays.healthy.sum())
    t, area = 0.0, 0.0
    for e in trace.events:
        area += n_up * (e.t_hours - t)
        t = e.t_hours
        n_up += -len(e.gpu_ids) if e.kind == "fail" else len(e.gpu_ids)
    return area + n_up * (trace.horizon_hours - t)


@pytest.fixture(scope="module")
def big_trace():
    inst = big()
    return inst, generate_trace(inst, days=100, seed=3, multiplier=10.0)


def test_failure_count_matches_rate(big_trace):
    inst, trace = big_trace
    n = len(trace.failures)
    rate_h = 4.7e-4 * 10.0 / 24.0
    # Naive: rate x GPUs x days (down time is ~1.5 % of exposure: within the band).
    naive = 4.7e-4 * 10.0 * 510 * 100
    assert abs(n - naive) < 4 * math.sqrt(naive)
    # Exact compensator: rate x GPU-hours actually up.
    expected = rate_h * exposure_gpu_hours(inst, trace)
    assert abs(n - expected) < 4 * math.sqrt(expected)
    assert expected < naive


def test_hardware_share(big_trace):
    _, trace = big_trace
    fails = trace.failures
    n = len(fails)
    hw = sum(e.cause == "hardware" for e in fails)
    assert abs(hw - 0.78 * n) < 4 * math.sqrt(n * 0.78 * 0.22)


def test_repairs_follow_their_durations(big_trace):
    _, trace = big_trace
    started: dict[tuple, Event] = {}
    matched = 0
    for e in trace.events:
        if e.kind == "fail":
            started[e.gpu_ids] = e
        else:
            f = started.pop(e.gpu_ids)
            assert f.cause == e.cause
            d = e.t_hours - f.t_hours
            if e.cause == "hardware":
                assert 72.0 <= d <= 120.0
            else:
                assert d == pytest.approx(3.0)
            matched += 1
    assert matched > 100
    # Failures still open at the end would be repaired after the horizon.
    for f in started.values():
        assert f.t_hours + (120.0 if f.cause == "hardware" else 3.0) > trace.horizon_hours


def test_never_fails_a_down_gpu(big_trace):
    _, trace = big_trace
    # Trace() itself rejects failing a GPU that is down; check initial failures too.
    seen = {g for e in trace.events for g in e.gpu_ids}
    assert "d5.t0.g1" not in seen and "d9.t1.g3" not in seen
    assert all(len(e.gpu_ids) == 1 for e in trace.events)


def test_deterministic_by_seed():
    inst = three_domains()
    a = generate_trace(inst, days=365, seed=7, multiplier=20.0)
    b = generate_trace(inst, days=365, seed=7, multiplier=20.0)
    c = generate_trace(inst, days=365, seed=8, multiplier=20.0)
    assert a == b and a.events
    assert a != c


def test_tray_unit_takes_the_up_gpus_of_the_tray():
    inst = three_domains()
    trace = generate_trace(inst, days=365, seed=1, multiplier=50.0, unit="tray")
    a = inst.arrays
    down: set = set()
    for e in trace.events:
        trays = {int(a.gpu_tray[a.gpu_index[g]]) for g in e.gpu_ids}
        assert len(trays) == 1
        if e.kind == "fail":
            tray = trays.pop()
            members = {a.gpu_ids[i] for i in np.flatnonzero(a.gpu_tray == tray)}
            assert set(e.gpu_ids) == members - down
            down |= set(e.gpu_ids)
        else:
            down -= set(e.gpu_ids)


def test_zero_rate_and_bad_arguments():
    inst = three_domains()
    assert generate_trace(inst, days=10, multiplier=0.0).events == ()
    with pytest.raises(ValueError):
        generate_trace(inst, days=0)
    with pytest.raises(ValueError):
        generate_trace(inst, days=1, unit="domain")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        Trace((Event(1.0, "repair", ("d0.t0.g0",), "software"),), 5.0)
    with pytest.raises(ValueError):
        Trace((Event(6.0, "fail", ("d0.t0.g0",), "software"),), 5.0)


# ---------------------------------------------------------------- replay


def test_hand_ntp_reduced_replica():
    """docs/model.md: one GPU out of d0 -> TP7 replica, speed 7/8; fixed B = 24 as (8, 8, 8)."""
    inst = three_domains()
    res = simulate(inst, one_failure(), "ntp")
    g1 = (7 / 8) / RHO  # theta = 8 / (7/8) * (1 + rho); goodput 24 / theta; relative / 3
    assert [s.relative_goodput for s in res.steps] == pytest.approx([1.0, g1, 1.0])
    assert [s.failed_gpus for s in res.steps] == [0, 1, 0]
    assert res.mean_relative_goodput == pytest.approx((21 * 1.0 + 3 * g1) / 24)
    assert res.paused_hours == 0.0
    assert res.replans == 3 and res.solves == 2  # the repaired state is the cached start


def test_hand_dp_drop_pauses_under_fixed():
    inst = three_domains()
    res = simulate(inst, one_failure(), "dp-drop")
    assert res.relative_goodputs.tolist() == pytest.approx([1.0, 0.0, 1.0])
    assert res.paused_hours == pytest.approx(3.0)
    assert res.mean_relative_goodput == pytest.approx(21 / 24)
    # Elastic: two replicas carry 16 sequences at full speed, relative 2/3; no pause.
    el = simulate(three_domains("elastic"), one_failure(), "dp-drop")
    assert el.paused_hours == 0.0
    assert el.mean_relative_goodput == pytest.approx((21 + 3 * 2 / 3) / 24)
    # A spare domain is swapped in: no loss at all.
    sp = simulate(three_domains(spares=1), one_failure(), "dp-drop")
    assert sp.mean_relative_goodput == pytest.approx(1.0)


@pytest.mark.parametrize("policy", ["dp-drop", "ntp", "ntp-pw", "optimal", "optimal-nopower"])
@pytest.mark.parametrize("batch", ["fixed", "elastic"])
def test_time_average_against_solve(policy, batch):
    inst = three_domains(batch)
    trace = one_failure(("d1.t0.g0", "d1.t0.g1"), "hardware")
    mask = np.zeros(inst.arrays.n_gpus, dtype=bool)
    mask[[inst.arrays.gpu_index["d1.t0.g0"], inst.arrays.gpu_index["d1.t0.g1"]]] = True
    g0 = solve(inst, policy, time_limit=HANG_GUARD).relative_objective
    g1 = solve(failed_instance(inst, mask), policy, time_limit=HANG_GUARD).relative_objective
    assert g0 is not None and g1 is not None
    res = simulate(inst, trace, policy, time_limit=HANG_GUARD)
    assert res.mean_relative_goodput == pytest.approx((21 * g0 + 3 * g1) / 24)
    assert res.paused_hours == pytest.approx(3.0 if g1 == 0 else 0.0)


def replay_and_check(inst: Instance, trace: Trace, res) -> None:
    """Rebuild the state of every step from the trace and validate its plan."""
    a = inst.arrays
    down: set[int] = set()
    events = iter(trace.events)
    pending = next(events, None)
    for step in res.steps:
        while pending is not None and pending.t_hours <= step.t_hours:
            ids = {a.gpu_index[g] for g in pending.gpu_ids}
            down = down | ids if pending.kind == "fail" else down - ids
            pending = next(events, None)
        mask = np.zeros(a.n_gpus, dtype=bool)
        mask[list(down)] = True
        assert step.failed_gpus == len(down)
        assert step.plan is not None
        ev = check(failed_instance(inst, mask), step.plan)
        assert ev.relative_goodput == pytest.approx(step.relative_goodput)
    assert res.solves <= res.replans == len({e.t_hours for e in trace.events}) + 1


@pytest.mark.parametrize("policy", ["dp-drop", "ntp", "ntp-pw"])
def test_every_plan_passes_the_validator(policy):
    inst = three_domains("elastic", spares=1)
    trace = generate_trace(inst, days=60, seed=2, multiplier=40.0, unit="tray")
    assert len(trace.events) > 5
    res = simulate(inst, trace, policy)
    replay_and_check(inst, trace, res)
    assert res.solves < res.replans  # repeated states come from the cache


def test_exact_policies_validate_and_dominate():
    inst = three_domains("elastic", spares=1)
    trace = generate_trace(inst, days=5, seed=4, multiplier=100.0)
    assert len(trace.events) >= 3
    res = {
        p: simulate(inst, trace, p, time_limit=HANG_GUARD) for p in ["optimal", "optimal-nopower"]
    }
    for p in ["dp-drop", "ntp", "ntp-pw"]:
        res[p] = simulate(inst, trace, p)
    for r in res.values():
        replay_and_check(inst, trace, r)
    for exact, heuristics in [("optimal", ["ntp-pw", "ntp"]), ("optimal-nopower", ["ntp"])]:
        if {s.status for s in res[exact].steps} != {"optimal"}:
            continue  # stopped by the time limit on a slow machine: no claim
        for h in [*heuristics, "dp-drop"]:
            for se, sh in zip(res[exact].steps, res[h].steps, strict=True):
                assert se.relative_goodput >= sh.relative_goodput - 1e-9


def test_simultaneous_events_are_one_replan():
    tr = Trace(
        (
            Event(5.0, "fail", ("d0.t0.g0",), "software"),
            Event(5.0, "fail", ("d1.t0.g0",), "software"),
            Event(8.0, "repair", ("d0.t0.g0",), "software"),
            Event(8.0, "repair", ("d1.t0.g0",), "software"),
        ),
        10.0,
    )
    res = simulate(three_domains(), tr, "dp-drop")
    assert res.replans == 3 and res.paused_hours == pytest.approx(3.0)


def test_unknown_policy_and_gpus():
    with pytest.raises(ValueError):
        simulate(three_domains(), one_failure(), "megatron")
    with pytest.raises(ValueError, match="unknown or failed"):
        simulate(three_domains(), one_failure(("d7.t0.g0",)), "ntp")
    inst = big()
    with pytest.raises(ValueError, match="unknown or failed"):
        simulate(inst, one_failure(("d5.t0.g1",)), "ntp")  # failed in the instance


# ---------------------------------------------------------------- spares


def worst_goodputs(build, trace, policy, max_spares):
    """Reference: the lowest relative goodput of a full simulation of every k (restricted trace)."""
    worst = []
    for k in range(max_spares + 1):
        inst = build(k)
        res = simulate(inst, restrict_trace(trace, inst.arrays.gpu_ids), policy)
        worst.append(float(res.relative_goodputs.min()))
    return worst


def first_without_stall(worst, threshold=0.0):
    """First k whose worst goodput neither pauses nor falls below ``threshold``; all oks."""
    ok = [w > 0 and w >= threshold * (1 - 1e-9) for w in worst]
    return (ok.index(True) if True in ok else None), ok


def test_restrict_trace_keeps_the_sub_cluster_events():
    tr = Trace(
        (
            Event(1.0, "fail", ("d0.t0.g0", "d3.t0.g0"), "hardware"),
            Event(2.0, "fail", ("d4.t1.g1",), "software"),
            Event(5.0, "repair", ("d4.t1.g1",), "software"),
            Event(9.0, "repair", ("d0.t0.g0", "d3.t0.g0"), "hardware"),
        ),
        24.0,
        {"seed": 1},
    )
    sub = restrict_trace(tr, three_domains(spares=1).arrays.gpu_ids)  # d0 .. d3
    assert sub.events == (
        Event(1.0, "fail", ("d0.t0.g0", "d3.t0.g0"), "hardware"),
        Event(9.0, "repair", ("d0.t0.g0", "d3.t0.g0"), "hardware"),
    )
    assert sub.horizon_hours == 24.0 and sub.meta == {"seed": 1, "restricted_to": 32}
    only_d0 = restrict_trace(tr, ["d0.t0.g0"])
    assert [e.gpu_ids for e in only_d0.events] == [("d0.t0.g0",), ("d0.t0.g0",)]


def test_restricted_trace_has_the_sub_cluster_rate(big_trace):
    """Every GPU fails independently: half of the cluster sees the rate of its own GPUs."""
    inst, trace = big_trace
    a = inst.arrays
    half = [g for i, g in enumerate(a.gpu_ids) if a.gpu_domain[i] < a.n_domains // 2]
    sub = restrict_trace(trace, half)
    n_up = int(sum(a.healthy[a.gpu_index[g]] for g in half))
    t, area = 0.0, 0.0  # exposure: up GPUs of the half over time
    for e in sub.events:
        area += n_up * (e.t_hours - t)
        t = e.t_hours
        n_up += -len(e.gpu_ids) if e.kind == "fail" else len(e.gpu_ids)
    area += n_up * (sub.horizon_hours - t)
    expect = trace.meta["rate_per_gpu_day"] * trace.meta["multiplier"] / 24.0 * area
    assert abs(len(sub.failures) - expect) <= 4 * math.sqrt(expect)
    assert 0.3 * len(trace.failures) < len(sub.failures) < 0.7 * len(trace.failures)


def test_interchangeable_domains():
    assert interchangeable_domains(three_domains()) is None  # one rack per domain
    g = topology.dgx_h100(8)  # four NVL8 pods per rack
    assert "one to one" in interchangeable_domains(
        Instance("dgx", g, Job(tp=8, pp=1, dp=8, global_batch=8))
    )
    assert "failed" in interchangeable_domains(big())
    g = topology.build_cluster(3, 8, 4, 2)
    topology.set_speed(g, ["d1.t0.g0"], 0.5)
    inst = Instance("slow", g, Job(tp=8, pp=1, dp=3, global_batch=24))
    assert "speed" in interchangeable_domains(inst)


def hand_trace() -> Trace:
    """d0 fails at 1 h, the spare d3 at 2 h, d1 at 3 h; all repaired at 5 h (on 6 domains)."""
    ids = ("d0.t0.g0", "d3.t0.g0", "d1.t0.g0")
    return Trace(
        (
            Event(1.0, "fail", ids[:1], "hardware"),
            Event(2.0, "fail", ids[1:2], "hardware"),
            Event(3.0, "fail", ids[2:], "hardware"),
            Event(5.0, "repair", ids, "hardware"),
        ),
        24.0,
    )


@pytest.mark.parametrize("prune", ["none", "maximal", "symmetric"])
@pytest.mark.parametrize("start", [0, 2, 3])
def test_spares_search_hand(prune, start):
    """Three working domains (R = 3, PP1, TP8, b0 = 8, fixed), spares d3, d4, d5.

    dp-drop needs 3 healthy domains: at 3 h d0, d1 and (with k >= 1 spares) d3 are
    down, so k spares leave 3 + k - 2 - [k >= 1] healthy: k = 3 is the first
    that runs. ntp never pauses (a TP7 replica carries b0 = 8 more slowly) but
    it is slower than nominal: TP7 takes only floor(8 * 7/8) = 7 sequences per
    nominal step, so without a spare replica (dp_max = 3 + k) the step grows to
    8 / (7/8) and relative goodput is (7/8) / 1.01 < 1 / 1.01; with one spare
    domain the extra replica takes the missing sequences.
    """

    def build(k: int) -> Instance:
        return three_domains(spares=k, dp_max=3 + k)

    kw = {"max_spares": 3, "prune": prune, "start": start}
    r = spares_search(build, hand_trace(), "dp-drop", **kw)
    assert r.spares == 3 and r.probes[2] is False and r.probes[3] is True
    assert r.binding == (3.0, 0.0) and r.states == 4  # {}, {d0}, {d0, d3}, {d0, d3, d1}
    nominal = 1 / RHO
    assert spares_search(build, hand_trace(), "ntp", **kw).spares == 0
    slow = spares_search(build, hand_trace(), "ntp", min_relative_goodput=nominal, **kw)
    assert slow.spares == 1
    assert slow.binding is not None and slow.binding[1] == pytest.approx((7 / 8) / RHO)
    assert spares_search(build, hand_trace(), "dp-drop", max_spares=2).spares is None


def test_spares_search_matches_the_linear_scan():
    """Search and pruning give the first k of the full simulation of every k.

    NVL8 domains (one rack each, rack budget 1.3 x TDP), TP8 reducible to 6, PP2,
    R = 4, fixed B = 32, spare domains may host extra replicas. The scan also
    shows that more spares never hurt on these traces (the search's assumption).
    """

    def build(k: int) -> Instance:
        g = topology.build_cluster(8 + k, 8, 4, 2, rack_power_factor=1.3)
        job = Job(tp=8, tp_min=6, pp=2, dp=4, global_batch=32, dp_max=4 + k // 2)
        return Instance(f"spares-{k}", g, job)

    max_spares = 6
    seen = set()
    for seed, multiplier in [(5, 40.0), (2, 8.0)]:
        trace = generate_trace(build(max_spares), days=20, seed=seed, multiplier=multiplier)
        for policy in ("dp-drop", "ntp", "ntp-pw"):
            worst = worst_goodputs(build, trace, policy, max_spares)
            for threshold in (0.0, 1 / RHO):
                want, ok = first_without_stall(worst, threshold)
                if want is not None:
                    assert all(ok[want:]), (seed, policy, threshold, ok)
                seen.add(want)
                for prune in ("none", "maximal", "symmetric"):
                    got = spares_search(
                        build,
                        trace,
                        policy,
                        max_spares=max_spares,
                        min_relative_goodput=threshold,
                        prune=prune,
                    )
                    assert got.spares == want, (seed, policy, threshold, prune)
    assert seen == {0, 1, 2, 3, 4, 6}  # the cases differ (values read off the scan)


def test_spares_search_bad_input():
    def build(k: int) -> Instance:
        return three_domains(spares=k)

    tr = hand_trace()
    with pytest.raises(ValueError, match="unknown policy"):
        spares_search(build, tr, "megatron", max_spares=3)
    with pytest.raises(ValueError, match="prune"):
        spares_search(build, tr, "ntp", max_spares=3, prune="some")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_spares"):
        spares_search(build, tr, "ntp", max_spares=-1)
    with pytest.raises(ValueError, match="start"):
        spares_search(build, tr, "ntp", max_spares=3, start=4)
    with pytest.raises(ValueError, match="min_relative_goodput"):
        spares_search(build, tr, "ntp", max_spares=3, min_relative_goodput=-0.5)
    with pytest.raises(ValueError, match="unknown or failed"):
        spares_search(build, tr, "ntp", max_spares=0)  # d3 is not in build(0)

    def renamed(k: int) -> Instance:
        g = topology.build_cluster(3 + k, 8, 4, 2)
        if k < 3:
            g = nx.relabel_nodes(g, {"d0.t0.g0": "extra"})
        return Instance("r", g, Job(tp=8, pp=1, dp=3, global_batch=24))

    with pytest.raises(ValueError, match="lacks: extra"):
        spares_search(renamed, tr, "dp-drop", max_spares=3)

    def pods(k: int) -> Instance:
        return Instance("dgx", topology.dgx_h100(4 + k), Job(tp=8, pp=1, dp=3, global_batch=24))

    with pytest.raises(ValueError, match="interchangeable"):
        spares_search(pods, Trace((), 1.0), "ntp", max_spares=4, prune="symmetric")


def test_spares_needed_dp_drop():
    kw = {"days": 30, "seed": 0, "multiplier": 30.0, "unit": "tray"}

    def build(k: int) -> Instance:
        return three_domains(spares=k)

    k = spares_needed(build, "dp-drop", max_spares=4, **kw)
    assert k is not None and k > 0
    trace = generate_trace(build(4), **kw)
    want, _ = first_without_stall(worst_goodputs(build, trace, "dp-drop", 4))
    assert k == want
