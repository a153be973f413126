"""Planner limits that hold: huge batches, deadlines, memory budgets (issue 18, item 2).

No test here measures wall-clock time: they count enumerated batch levels,
use deadlines that have already passed, or check refusals.
"""

from __future__ import annotations

import random
import time
from pathlib import Path

import numpy as np
import pytest

from ntp_opt.app.cli import main
from ntp_opt.model.files import load_instance
from ntp_opt.model.instance import Instance
from ntp_opt.planners.base import RunOptions
from ntp_opt.planners.exact import capacity, model
from ntp_opt.planners.exact import configs as exact_configs
from ntp_opt.planners.exact.search import solve_exact
from ntp_opt.rules import goodput as gp
from ntp_opt.rules.validate import evaluate
from ntp_opt.solve import Limit, solve

ROOT = Path(__file__).resolve().parents[2]


def _tiny(batch: int) -> Instance:
    inst = load_instance(ROOT / "instances" / "tiny.json")
    job = inst.job.model_copy(update={"global_batch": batch, "max_local_batch": batch})
    return Instance(inst.name, inst.cluster, job, inst.meta, copy_graph=False)


@pytest.mark.parametrize("batch", [8, 100_000, 10**9])
def test_batch_levels_listed_do_not_grow_with_the_batch(batch: int) -> None:
    # tiny: domain d0 has 3 healthy GPUs of speed 1 (TP4 cannot fit), so only
    # degree 3 stages: f(3) = 3/4, boost 1.3 ** 0.65. At theta' = 10 a stage
    # carries b <= 10 * 0.75 * 1.3 ** 0.65 = 8.89: levels 1..8 (when B, M >= 8).
    prep = model.prepare(_tiny(batch))
    d0 = prep.domains[0]
    assert len(d0.gpus) == 3
    configs = exact_configs.domain_configs(prep, d0, 1, 10.0, (3, 4))
    assert [c.stages[0].b for c in configs[1:]] == [8, 7, 6, 5, 4, 3, 2, 1]
    assert exact_configs.max_level(prep, 3, 1.0, 10.0) in (8, 9)  # exact, or one above


def test_too_many_levels_refused_before_listing() -> None:
    # theta' = 1e6: about 889,000 levels for one stage, far above MAX_CONFIGS
    prep = model.prepare(_tiny(10**7))
    calls = 0
    real = exact_configs.stage_power

    def counting(*args: object) -> float | None:
        nonlocal calls
        calls += 1
        return real(*args)  # type: ignore[arg-type]

    exact_configs.stage_power = counting  # type: ignore[assignment]
    try:
        with pytest.raises(model.ModelTooLarge):
            exact_configs.domain_configs(prep, prep.domains[0], 1, 1e6, (3, 4))
    finally:
        exact_configs.stage_power = real  # type: ignore[assignment]
    assert calls == 0  # refused without trying a single level


def test_a_passed_deadline_stops_building() -> None:
    prep = model.prepare(_tiny(8))
    with pytest.raises(model.DeadlineReached):
        capacity.build_capacity(prep, 10.0, (3, 4), deadline=time.perf_counter() - 1.0)


def test_exact_search_with_no_time_left_returns_a_valid_plan() -> None:
    inst = _tiny(8)
    out = solve_exact(inst, RunOptions(time_limit=1e-9))
    assert out.time_limit_hit and not out.proven
    assert out.plan is not None
    ev = evaluate(inst, out.plan)
    assert ev.feasible and ev.goodput == pytest.approx(out.stats["goodput"])
    res = solve(inst, "optimal", time_limit=1e-9)
    assert res.limit == Limit.TIME and res.plan is not None and res.evaluation is not None
    assert res.evaluation.feasible


def test_large_batch_solve_returns_a_validated_plan() -> None:
    # B = M = 100,000 on tiny: the exact cases are too large to list, so the
    # search keeps its warm starts (fast among them) and does not claim optimality.
    inst = _tiny(100_000)
    res = solve(inst, "optimal", time_limit=5)
    assert res.plan is not None and res.evaluation is not None and res.evaluation.feasible
    assert res.objective is not None
    # not proven by the search; optimal only where the warm start meets the bound
    closed = res.bound is not None and res.bound <= res.objective * (1 + 1e-6)
    assert res.status == ("optimal" if closed else "feasible")
    fast = solve(inst, "fast")
    assert res.objective is not None and fast.objective is not None
    assert res.objective >= fast.objective * (1 - 1e-12)
    assert sum(r.local_batch for r in res.plan.replicas) <= 100_000


def test_huge_batch_refused_up_front() -> None:
    with pytest.raises(gp.SizeLimitError, match=r"job\.global_batch"):
        solve(_tiny(10**9), "ntp")


def test_huge_batch_cli_is_one_line_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    import json

    data = json.loads((ROOT / "instances" / "tiny.json").read_text())
    data["job"]["global_batch"] = data["job"]["max_local_batch"] = 10**9
    path = tmp_path / "huge.json"
    path.write_text(json.dumps(data))
    assert main(["solve", str(path), "--policy", "optimal", "--time-limit", "5"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("ntp-opt: error: job.global_batch:")


def _brute_split(job, speeds, policy):  # type: ignore[no-untyped-def]
    """Every integer batch vector (small cases): best goodput, as split_batch defines it."""
    import itertools

    best = -1.0
    cap = min(job.local_batch_max, job.global_batch)
    for bs in itertools.product(range(1, cap + 1), repeat=len(speeds)):
        total = sum(bs)
        if total > job.global_batch or (policy == "fixed" and total != job.global_batch):
            continue
        theta = max(b / v for b, v in zip(bs, speeds, strict=True))
        best = max(best, total / theta)
    return best


def test_bounded_split_matches_the_full_one(monkeypatch: pytest.MonkeyPatch) -> None:
    # The split lists only the candidates up to the step time where B are
    # admitted; with the threshold at 0 that path runs on every case, and its
    # goodput must equal brute force (small cases) and its batches the full
    # listing's (larger ones).
    from ntp_opt.model.job import Job

    rng = random.Random(7)
    for _ in range(120):
        n = rng.randint(1, 3)
        big_b = rng.randint(n, 12)
        cap = rng.randint(1, 12)
        policy = rng.choice(["fixed", "elastic"])
        job = Job(tp=4, pp=1, dp=n, global_batch=big_b, max_local_batch=cap, batch_policy=policy)
        speeds = [rng.choice([0.5, 1.0, 1 / 3, 0.7]) for _ in range(n)]
        monkeypatch.setattr(gp, "_FULL_BELOW", 0)
        got = gp.split_batch(job, speeds, [4] * n)
        if got is None:
            assert policy == "fixed" and n * cap < big_b
            continue
        assert got.goodput == pytest.approx(_brute_split(job, speeds, policy), rel=1e-12)
    for _ in range(60):
        n = rng.randint(2, 8)
        big_b = rng.randint(n, 5000)
        cap = rng.randint(1, 5000)
        policy = rng.choice(["fixed", "elastic"])
        job = Job(tp=4, pp=1, dp=n, global_batch=big_b, max_local_batch=cap, batch_policy=policy)
        speeds = [rng.uniform(0.05, 2.0) for _ in range(n)]
        monkeypatch.setattr(gp, "_FULL_BELOW", 10**12)
        full = gp.split_batch(job, speeds, [4] * n)
        monkeypatch.setattr(gp, "_FULL_BELOW", 0)
        bounded = gp.split_batch(job, speeds, [4] * n)
        assert full == bounded


def test_bounded_split_memory_follows_b_not_m() -> None:
    # 4 replicas, M = 10**7, B = 1000: at most B + 2n candidates are listed
    counts = gp._candidate_counts(np.array([1.0, 0.5, 0.25, 2.0]), 10**7, 1000, 4)
    assert counts.sum() <= 1000 + 2 * 4 + 4


@pytest.mark.parametrize("planner", ["risk-aware", "optimal-megatron", "highs", "optimal-nopower"])
def test_every_time_limited_planner_stops_with_a_valid_plan(planner: str) -> None:
    # a limit that has passed before the first check: every phase must notice
    from ntp_opt.planners.riskaware import risk_instance

    inst = risk_instance("pack")
    res = solve(inst, planner, time_limit=1e-9)
    assert res.limit == Limit.TIME, planner
    assert res.plan is not None and res.evaluation is not None and res.evaluation.feasible
    assert res.objective is not None
    # not proven by the search; optimal only where the warm start meets the bound
    closed = res.bound is not None and res.bound <= res.objective * (1 + 1e-6)
    if planner == "risk-aware":  # its bound is on the expected goodput (docs/risk.md)
        closed = res.gap is not None and res.gap <= 1e-6
    assert res.status == ("optimal" if closed else "feasible")
