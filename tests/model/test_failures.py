"""Failure scenarios: sampling statistics, blast radius, enumeration (docs/model.md)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from ntp_opt.model import topology
from ntp_opt.model.failures import (
    MAX_EXACT_UNITS,
    enumerate_scenarios,
    failed_instance,
    failure_units,
    sample_failure_events,
    sample_failures,
)
from ntp_opt.model.instance import Instance
from ntp_opt.model.job import Job


def _instance(domains=8, size=8, tray=4, gpu_p=0.0, tray_p=0.0, failed=(), name="f"):
    g = topology.build_cluster(domains, size, tray, size // tray)
    if gpu_p:
        topology.set_p_fail(g, gpu_p)
    if tray_p:
        topology.set_p_fail(g, tray_p, topology.trays(g))
    topology.fail_gpus(g, list(failed))
    job = Job(tp=size, pp=1, dp=max(1, domains // 2), global_batch=2 * domains)
    return Instance(name, g, job)


def _within(count: float, mean: float, var: float) -> bool:
    return abs(count - mean) <= 4 * math.sqrt(var) + 1e-9


@pytest.mark.parametrize("p", [0.002, 0.02, 0.3])  # sparse, sparse, dense sampler
def test_mean_failures_match_sum_of_p(p):
    inst = _instance(gpu_p=p)
    n = 5000
    mask = sample_failures(inst, n, seed=1)
    assert mask.shape == (n, inst.arrays.n_gpus) and mask.dtype == bool
    total = n * inst.arrays.n_gpus
    assert _within(mask.sum(), total * p, total * p * (1 - p))
    # every GPU separately as well (Bonferroni-ish: 4.5 sigma over 64 GPUs)
    per = mask.sum(axis=0)
    assert np.all(np.abs(per - n * p) <= 4.5 * math.sqrt(n * p * (1 - p)) + 1)


def test_heterogeneous_probabilities_thinning():
    g = topology.build_cluster(4, 8, 4, 2)
    gpus = topology.gpus(g)
    probs = np.linspace(0.001, 0.04, len(gpus))
    for gid, p in zip(gpus, probs, strict=True):
        topology.set_p_fail(g, float(p), [gid])
    inst = Instance("h", g, Job(tp=8, pp=1, dp=2, global_batch=4))
    n = 20000
    per = sample_failures(inst, n, seed=5).sum(axis=0)
    sd = np.sqrt(n * probs * (1 - probs))
    assert np.all(np.abs(per - n * probs) <= 4.5 * sd + 1)
    lo, hi = per[: len(gpus) // 2].sum(), per[len(gpus) // 2 :].sum()
    assert lo < hi


def test_tray_failures_take_whole_trays():
    inst = _instance(tray_p=0.05)
    a = inst.arrays
    n = 4000
    mask = sample_failures(inst, n, seed=2)
    n_trays = len(a.tray_ids)
    per_tray = np.stack([mask[:, a.gpu_tray == t].sum(axis=1) for t in range(n_trays)], axis=1)
    assert np.all((per_tray == 0) | (per_tray == 4))
    hits = (per_tray == 4).sum()
    total = n * n_trays
    assert _within(hits, total * 0.05, total * 0.05 * 0.95)


@pytest.mark.parametrize(("radius", "key"), [("tray", "gpu_tray"), ("domain", "gpu_domain")])
def test_blast_radius_widens_gpu_failures(radius, key):
    inst = _instance(gpu_p=0.01)
    a = inst.arrays
    group = getattr(a, key)
    n = 3000
    mask = sample_failures(inst, n, seed=3, blast_radius=radius)
    n_groups = int(group.max()) + 1
    size = np.bincount(group)
    per = np.stack([mask[:, group == k].sum(axis=1) for k in range(n_groups)], axis=1)
    assert np.all((per == 0) | (per == size[None, :]))
    # a group fails when any of its GPUs does
    q = 1 - (1 - 0.01) ** size[0]
    hits = (per > 0).sum()
    assert _within(hits, n * n_groups * q, n * n_groups * q * (1 - q))


def test_determinism_by_seed_and_events_match_dense():
    inst = _instance(gpu_p=0.01, tray_p=0.01)
    m1 = sample_failures(inst, 500, seed=7)
    m2 = sample_failures(inst, 500, seed=7)
    m3 = sample_failures(inst, 500, seed=8)
    assert np.array_equal(m1, m2)
    assert not np.array_equal(m1, m3)
    rows, gpus = sample_failure_events(inst, 500, seed=7)
    dense = np.zeros_like(m1)
    dense[rows, gpus] = True
    assert np.array_equal(dense, m1)
    assert len(rows) == m1.sum()  # no duplicates


def test_already_failed_gpus_are_not_new_failures():
    failed = ["d0.t0.g0", "d1.t1.g3"]
    inst = _instance(gpu_p=0.5, tray_p=0.5, failed=failed)
    a = inst.arrays
    for radius in ("gpu", "tray", "domain"):
        mask = sample_failures(inst, 200, seed=0, blast_radius=radius)
        for gid in failed:
            assert not mask[:, a.gpu_index[gid]].any()
        # the rest of tray d0.t0 still fails with the tray
        others = [a.gpu_index[f"d0.t0.g{k}"] for k in (1, 2, 3)]
        assert mask[:, others].any()


def test_scale_and_zero_probability():
    inst = _instance(gpu_p=0.01)
    assert not sample_failures(inst, 100, seed=0, scale=0.0).any()
    assert sample_failures(inst, 10, seed=0, scale=1000.0).all()  # clipped to 1
    assert not sample_failures(_instance(), 100, seed=0).any()
    with pytest.raises(ValueError, match="blast_radius"):
        sample_failures(inst, 1, blast_radius="rack")


def test_enumeration_sums_to_one_and_matches_marginals():
    g = topology.build_cluster(2, 4, 2, 2)
    gpus = topology.gpus(g)
    topology.set_p_fail(g, 0.1, gpus[:3])
    topology.set_p_fail(g, 0.2, topology.trays(g)[:2])
    topology.fail_gpus(g, [gpus[7]])
    inst = Instance("e", g, Job(tp=4, pp=1, dp=1, global_batch=1))
    assert failure_units(inst) == 5
    scen = list(enumerate_scenarios(inst))
    assert math.isclose(sum(p for _, p in scen), 1.0)
    marginal = sum(p * m.astype(float) for m, p in scen)
    # GPU 0 is in tray 0: fails unless neither its own unit nor its tray fails
    assert marginal[0] == pytest.approx(1 - 0.9 * 0.8)
    assert marginal[3] == pytest.approx(0.2)  # tray 1, no GPU p
    assert marginal[4] == 0.0 and marginal[7] == 0.0
    # MC agrees on the marginals
    mc = sample_failures(inst, 20000, seed=1).mean(axis=0)
    assert np.all(np.abs(mc - marginal) <= 4 * np.sqrt(marginal * (1 - marginal) / 20000) + 1e-12)
    # domain radius: fewer distinct scenarios, same total
    dom = list(enumerate_scenarios(inst, blast_radius="domain"))
    assert len(dom) <= 2 and math.isclose(sum(p for _, p in dom), 1.0)


def test_enumeration_refuses_large_instances():
    inst = _instance(gpu_p=0.01)
    assert failure_units(inst) > MAX_EXACT_UNITS
    with pytest.raises(ValueError, match="exact enumeration is limited"):
        next(iter(enumerate_scenarios(inst)))


def test_failed_instance():
    inst = _instance(failed=["d0.t0.g0"])
    a = inst.arrays
    mask = np.zeros(a.n_gpus, dtype=bool)
    mask[[a.gpu_index["d0.t0.g0"], a.gpu_index["d2.t1.g2"]]] = True
    after = failed_instance(inst, mask)
    assert after.name == inst.name and after.job == inst.job
    assert after.cluster.nodes["d2.t1.g2"]["state"] == "failed"
    assert inst.cluster.nodes["d2.t1.g2"]["state"] == "healthy"
    assert int((~after.arrays.healthy).sum()) == 2
    with pytest.raises(ValueError, match="shape"):
        failed_instance(inst, mask[:-1])


def test_failed_instance_equals_a_rebuilt_copy():
    # failed_instance goes through Instance.with_health (copies only the failed
    # GPUs' nodes); it must equal the instance rebuilt from a graph copy with
    # the GPUs failed, attributes included (no attribute added, e.g. "speed")
    g = topology.build_cluster(4, 8, 4, 2)
    for n in topology.gpus(g)[:10]:
        del g.nodes[n]["speed"]  # speed is optional (default 1.0)
    topology.fail_gpus(g, ["d0.t0.g0"])
    inst = Instance("f", g, Job(tp=8, pp=1, dp=2, global_batch=8), {"source": "test"})
    a = inst.arrays
    mask = np.zeros(a.n_gpus, dtype=bool)
    mask[[a.gpu_index[x] for x in ("d0.t0.g0", "d0.t0.g1", "d3.t1.g3")]] = True
    after = failed_instance(inst, mask)
    ref = g.copy()
    topology.fail_gpus(ref, ["d0.t0.g1", "d3.t1.g3"])
    rebuilt = Instance("f", ref, inst.job, {"source": "test"})
    assert after == rebuilt
    assert "speed" not in after.cluster.nodes["d0.t0.g1"]
    for field in ("healthy", "speed", "gpu_domain", "tdp"):
        assert np.array_equal(getattr(after.arrays, field), getattr(rebuilt.arrays, field))
    assert after.arrays.gpu_domain is a.gpu_domain  # the structure's arrays are shared
    assert inst.cluster.nodes["d0.t0.g1"]["state"] == "healthy"  # the original is unchanged
