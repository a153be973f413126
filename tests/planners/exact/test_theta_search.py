"""The step-time search under ``elastic``: the level descent (``theta_search="descent"``)
against the interval branch and bound it replaced (``"bnb"``) and the brute force.

No wall-clock: the searches run without a time limit (the hang guard only) and
are compared by their results and the number of capacity programs solved.
"""

from __future__ import annotations

import pytest

from ntp_opt import Instance, Job, evaluate
from ntp_opt.model import topology
from ntp_opt.model.plan import Plan
from ntp_opt.planners.base import Outcome, RunOptions
from ntp_opt.planners.exact import oracle, search, steptime
from ntp_opt.planners.exact.search import solve_exact
from tests.bruteforce import brute_force
from tests.helpers import HANG_GUARD
from tests.planners.exact.test_milp import exact_instance


def _elastic(inst: Instance) -> Instance:
    job = inst.job.model_copy(update={"batch_policy": "elastic"})
    return Instance(inst.name, inst.cluster, job, copy_graph=False)


@pytest.mark.parametrize("seed", range(0, 24))
def test_descent_equals_branch_and_bound_and_brute_force(seed: int) -> None:
    inst = _elastic(exact_instance(seed))
    best, _ = brute_force(inst)
    new = solve_exact(inst, RunOptions(time_limit=HANG_GUARD), theta_search="descent")
    old = solve_exact(inst, RunOptions(time_limit=HANG_GUARD), theta_search="bnb")
    assert new.proven and old.proven
    g_new, g_old = float(new.stats["goodput"]), float(old.stats["goodput"])
    assert g_new == pytest.approx(best, rel=1e-5, abs=1e-9)
    assert g_new == pytest.approx(g_old, rel=2e-6, abs=1e-12)
    assert new.bound is not None and new.bound >= g_new
    assert new.bound >= best * (1 - 1e-9)  # a bound, never below the optimum
    assert evaluate(inst, new.plan).feasible


def test_top_of_the_range_not_solved_keeps_the_optimum() -> None:
    # where the incumbent already reaches min(B, dp_max M) / (theta_hi F), the
    # descent solves no program at the top of a case's range; the optimum and the
    # bound stay the brute force's, and the shortcut is taken on several seeds
    skipped = _seeds_against_brute_force("top of the range not solved")
    assert skipped >= 5  # (11 of the 24 when written)


def _seeds_against_brute_force(marker: str) -> int:
    """Elastic ``exact_instance`` seeds 0-23 solved with a log: each proven at the
    brute force's optimum, with a bound no lower and a feasible plan. Returns how
    many logs have a line containing ``marker``."""
    hits = 0
    for seed in range(24):
        inst = _elastic(exact_instance(seed))
        best, _ = brute_force(inst)
        res = solve_exact(inst, RunOptions(time_limit=HANG_GUARD, log=True))
        assert res.proven
        hits += any(marker in line for line in res.log)
        assert float(res.stats["goodput"]) == pytest.approx(best, rel=1e-5, abs=1e-9)
        assert res.bound is not None and res.bound >= best * (1 - 1e-9)
        assert evaluate(inst, res.plan).feasible
    return hits


def _pause_warm_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every warm start pauses the job: the descent raises the incumbent itself."""

    def paused(instance: Instance, *_: object) -> Outcome:
        return Outcome(Plan(instance.name, ()))

    for name in ("ntp_pw", "ntp", "dp_drop"):
        monkeypatch.setattr(search.baselines, name, paused)


def test_mixed_relaxation_equals_brute_force(monkeypatch: pytest.MonkeyPatch) -> None:
    # the mixed relaxation (integer replica counts, continuous configurations),
    # forced here onto every program the LP does not decide and stopped after one
    # node, keeps the brute force's optimum and a valid bound
    _pause_warm_starts(monkeypatch)
    monkeypatch.setattr(oracle, "MIXED_MIN_VARS", 0)
    monkeypatch.setattr(oracle, "MIXED_NODES", 1)
    mixed = _seeds_against_brute_force("mixed=")
    assert mixed >= 3  # (4 of the 24 when written)


def _boosted(domains: int, fail: int, seed: int) -> Instance:
    g = topology.nvl32(domains, rack_power_factor=1.3)
    topology.fail_random(g, count=fail, seed=seed)
    topology.add_stragglers(g, count=1, speed=(0.8, 0.95), seed=seed + 1)
    dp = domains // 4
    job = Job(tp=32, pp=4, dp=dp, global_batch=16 * dp, batch_policy="elastic")
    return Instance(f"nvl32-{domains}-boost", g, job)


def test_look_ahead_keeps_the_optimum(monkeypatch: pytest.MonkeyPatch) -> None:
    # NVL32 with boost from a paused incumbent: the descent's look-ahead (a program
    # for a level ahead of its turn) finds better plans; with it and without it
    # the searches end at the same proven optimum
    _pause_warm_starts(monkeypatch)
    real = steptime.look_ahead
    asked = found = 0

    def spy(s, case, window, level, best, caps, stride):  # type: ignore[no-untyped-def]
        nonlocal asked, found
        before = s.evaluations
        out = real(s, case, window, level, best, caps, stride)
        asked += s.evaluations > before
        found += out[1] == 2 * stride
        return out

    def off(s, case, window, level, best, caps, stride):  # type: ignore[no-untyped-def]
        return best, steptime.LOOK_AHEAD

    for seed in range(6):
        inst = _boosted(8, 2, seed)
        monkeypatch.setattr(steptime, "look_ahead", spy)
        on = solve_exact(inst, RunOptions(time_limit=HANG_GUARD))
        monkeypatch.setattr(steptime, "look_ahead", off)
        without = solve_exact(inst, RunOptions(time_limit=HANG_GUARD))
        assert on.proven and without.proven
        g_on, g_off = float(on.stats["goodput"]), float(without.stats["goodput"])
        assert g_on == pytest.approx(g_off, rel=2e-6)
        assert on.bound is not None and on.bound >= g_off * (1 - 1e-9)
        assert evaluate(inst, on.plan).feasible
    assert asked >= 2 and found >= 1, (asked, found)


@pytest.mark.parametrize("seed", [1])  # each seed costs about 9 CPU s
def test_descent_solves_fewer_programs_with_boost(seed: int) -> None:
    # NVL32 with boost and stragglers: C(theta') jumps at continuous step times;
    # the descent solves one program per level of C, the branch and bound
    # several per jump it locates
    inst = _boosted(16, 3, seed)
    new = solve_exact(inst, RunOptions(time_limit=HANG_GUARD), theta_search="descent")
    old = solve_exact(inst, RunOptions(time_limit=HANG_GUARD), theta_search="bnb")
    assert new.proven and old.proven
    assert float(new.stats["goodput"]) >= float(old.stats["goodput"]) * (1 - 2e-6)
    assert float(old.stats["goodput"]) >= float(new.stats["goodput"]) * (1 - 2e-6)
    assert int(new.stats["evaluations"]) < int(old.stats["evaluations"])


def test_unknown_theta_search_is_refused() -> None:
    with pytest.raises(ValueError, match="theta_search"):
        solve_exact(exact_instance(0), theta_search="golden")


def test_a_case_whose_bound_is_reached_is_not_searched() -> None:
    # no failed GPU, no straggler, nominal batch: the warm start reaches the
    # capacity bound of both cases, which proves the optimum without a program
    g = topology.nvl32(4, rack_power_factor=1.3)
    job = Job(tp=32, pp=2, dp=2, global_batch=32, batch_policy="elastic", max_boost=0.0)
    inst = Instance("healthy", g, job)
    out = solve_exact(inst, RunOptions(time_limit=HANG_GUARD, log=True))
    best, _ = brute_force(inst)
    assert out.proven
    assert float(out.stats["goodput"]) == pytest.approx(best, rel=1e-6)
    assert out.bound is not None and out.bound >= best * (1 - 1e-9)
    log = "\n".join(out.log)
    assert "reached, not searched" in log
    assert int(out.stats["evaluations"]) == 0


@pytest.mark.parametrize("seed", range(0, 12))
def test_descent_from_a_paused_incumbent_finds_the_optimum(
    seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Every warm start pauses the job (goodput 0): the descent starts at the top
    # of the step-time range with no incumbent (it solves there first), walks the
    # levels of C down to the doubling cut, answering "C < level" by the LP where
    # it can, and must still end at the brute force's optimum with a valid bound.
    inst = _elastic(exact_instance(seed))
    best, _ = brute_force(inst)
    _pause_warm_starts(monkeypatch)
    out = solve_exact(inst, RunOptions(time_limit=HANG_GUARD))
    assert out.proven
    assert float(out.stats["goodput"]) == pytest.approx(best, rel=1e-5, abs=1e-9)
    assert out.bound is not None and out.bound >= best * (1 - 1e-9)
    assert evaluate(inst, out.plan).feasible
