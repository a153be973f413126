"""Conformance with Megatron-LM's own NTP code (runs only with ``MEGATRON_LM_SRC``).

Set ``MEGATRON_LM_SRC`` to a Megatron-LM checkout that has
``megatron/core/distributed/nonuniform_tp.py`` (its ``dev`` branch from the
merge of PR #4585 on) and run::

    MEGATRON_LM_SRC=/path/to/Megatron-LM python -m pytest -q \
        tests/planners/test_megatron_conformance.py

The test loads Megatron's ``nonuniform_tp.py`` and its ``parallel_state.py``
(torch and the other heavy imports replaced by stubs: the planning functions
use them only as types, plus ``torch.distributed.get_rank`` / ``new_group``,
which the stub answers per simulated rank). For every export it then plays
every global rank through Megatron's functions:

* Megatron's ``RankGenerator`` (with the order ``initialize_model_parallel``
  gets from the exported flags) gives the rank's TP, DP and PP coordinates;
* ``initialize_nonuniform_tp_process_groups(config, exit_spares=False)``
  says whether the rank stays active and which TP group it ends up in;
* ``_ntp_current_rank_is_reduced_dp`` and ``get_active_ranks_for_dp`` say
  whether the rank's replica is reduced and which local ranks are active;

and checks against the plan: the active ranks of DP rank ``r``, PP rank ``k``
form one TP group of ``t_r`` ranks that sit (``ranks.txt``) on exactly the
GPUs of the plan's replica ``r``, stage ``k``; the reduced flag is ``t_r < T``.

Extra cases: ``NTP_CONFORMANCE_CASES=instance.json:plan.json,...`` exports
and checks those plans too (``--equal-batch`` applied when needed).
"""

from __future__ import annotations

import importlib.util
import math
import os
import sys
import types
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from ntp_opt.app.export import equal_batch, export_megatron, import_megatron
from ntp_opt.model import topology
from ntp_opt.model.files import load_instance, load_plan
from ntp_opt.model.instance import Instance
from ntp_opt.model.job import Job
from ntp_opt.model.plan import Plan
from ntp_opt.solve import solve

ROOT = Path(__file__).resolve().parents[2]
SRC = os.environ.get("MEGATRON_LM_SRC", "")
HOW = (
    "set MEGATRON_LM_SRC to a Megatron-LM checkout (dev branch, with "
    "megatron/core/distributed/nonuniform_tp.py) to run the conformance test; see docs/export.md"
)
pytestmark = pytest.mark.skipif(not SRC, reason=HOW)


# --- stubs ----------------------------------------------------------------------------


class _StubMeta(type):
    """A class whose every attribute is another stub class (``torch.nn.Parameter``...)."""

    def __getattr__(cls, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        sub = _StubMeta(name, (_Stub,), {})
        type.__setattr__(cls, name, sub)
        return sub

    def __getitem__(cls, item: Any) -> Any:
        return cls


class _Stub(metaclass=_StubMeta):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return args[0] if len(args) == 1 and callable(args[0]) else self


class _StubModule(types.ModuleType):
    """A module whose missing attributes are stub classes."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        value = _StubMeta(name, (_Stub,), {})
        setattr(self, name, value)
        return value


class _Dist(_StubModule):
    """``torch.distributed``: the rank being simulated and group creation."""

    rank = 0

    def is_available(self) -> bool:
        return True

    def is_initialized(self) -> bool:
        return True

    def get_rank(self, group: Any = None) -> int:
        return self.rank

    def new_group(self, ranks: list[int] | None = None, **kwargs: Any) -> tuple[int, ...]:
        return tuple(ranks or ())


class _ParallelState(_StubModule):
    """``megatron.core.parallel_state`` as seen by one simulated rank."""

    tp_size = tp_rank = dp_rank = pp_rank = cp_rank = 0
    cp_size = 1

    def get_tensor_model_parallel_world_size(self) -> int:
        return self.tp_size

    def get_tensor_model_parallel_rank(self) -> int:
        return self.tp_rank

    def get_data_parallel_rank(self, *args: Any, **kwargs: Any) -> int:
        return self.dp_rank

    def get_context_parallel_rank(self) -> int:
        return self.cp_rank

    def get_context_parallel_world_size(self) -> int:
        return self.cp_size

    def get_pipeline_model_parallel_rank(self) -> int:
        return self.pp_rank


@contextmanager
def _stubbed() -> Iterator[dict[str, types.ModuleType]]:
    """Install the stub modules in ``sys.modules``; restore everything afterwards."""
    saved = dict(sys.modules)
    mods: dict[str, types.ModuleType] = {}

    def add(name: str, mod: types.ModuleType, package: bool = False) -> None:
        if package:
            mod.__path__ = []  # type: ignore[attr-defined]
        mods[name] = sys.modules[name] = mod
        parent, _, child = name.rpartition(".")
        if parent in mods:
            setattr(mods[parent], child, mod)

    try:
        torch = _StubModule("torch")
        add("torch", torch, package=True)
        dist = _Dist("torch.distributed")
        add("torch.distributed", dist)
        torch.distributed = dist  # type: ignore[attr-defined]
        for name in ("megatron", "megatron.core", "megatron.core.distributed"):
            add(name, _StubModule(name), package=True)
        for name in (
            "megatron.core.transformer",
            "megatron.core.inference",
        ):
            add(name, _StubModule(name), package=True)
        for name in (
            "megatron.core.process_groups_config",
            "megatron.core.transformer.cuda_graphs",
            "megatron.core.transformer.transformer_config",
            "megatron.core.utils",
            "megatron.core.inference.symmetric_memory",
            "megatron.core.distributed.distributed_data_parallel",
            "megatron.core.distributed.distributed_data_parallel_config",
            "megatron.core.distributed.param_and_grad_buffer",
        ):
            add(name, _StubModule(name))
        add("megatron.core.parallel_state", _ParallelState("megatron.core.parallel_state"))
        yield mods
    finally:
        sys.modules.clear()
        sys.modules.update(saved)


def _load(path: Path, name: str) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


class Megatron:
    """Megatron-LM's NTP planning functions and rank generator, loaded from ``src``."""

    def __init__(self, src: Path):
        ntp_path = src / "megatron/core/distributed/nonuniform_tp.py"
        ps_path = src / "megatron/core/parallel_state.py"
        if not ntp_path.is_file():
            pytest.fail(f"MEGATRON_LM_SRC={src}: no {ntp_path} (need the dev branch)")
        with _stubbed() as mods:
            self.ps = mods["megatron.core.parallel_state"]
            self.dist = mods["torch.distributed"]
            self.ntp = _load(ntp_path, "megatron.core.distributed.nonuniform_tp")
            self.real_ps = _load(ps_path, "megatron.core._real_parallel_state")

    def rank_groups(self, world: int, tp: int, pp: int, order: str) -> dict[str, list[list[int]]]:
        """TP, DP and PP groups from Megatron's ``RankGenerator``."""
        dp = world // (tp * pp)
        gen = self.real_ps.RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=1, order=order)
        return {k: gen.get_ranks(k) for k in ("tp", "dp", "pp")}


@pytest.fixture(scope="module")
def megatron() -> Megatron:
    return Megatron(Path(SRC))


# --- the check --------------------------------------------------------------------------


def _ranks_txt(path: Path) -> dict[int, dict[str, str]]:
    """``ranks.txt`` read with its own header (no exporter code)."""
    lines = path.read_text().splitlines()
    cols = lines[0].lstrip("# ").split()
    return {int(c[0]): dict(zip(cols, c, strict=True)) for c in (ln.split() for ln in lines[1:])}


def conformance(meg: Megatron, instance: Instance, plan: Plan, out: Path) -> dict[str, Any]:
    """Export ``plan`` into ``out`` and check it through Megatron's functions."""
    big_t, n_pp = instance.job.tp, instance.job.pp
    hosts = [f"placeholder{i}" for i in range(len(plan.replicas) * n_pp)]
    export_megatron(instance, plan, out, placeholder_hosts=hosts, placeholder_gpus=big_t)
    # the configuration module, run as the training script runs it
    with _stubbed() as mods:
        mods["megatron.core.distributed"].nonuniform_tp = meg.ntp  # type: ignore[attr-defined]
        sys.modules["megatron.core.distributed.nonuniform_tp"] = meg.ntp
        cfg = _load(out / "ntp_config.py", "ntp_config").ntp_config()
    assert isinstance(cfg, meg.ntp.NonuniformTPConfig)
    args = (out / "megatron-args.txt").read_text().split()
    assert int(args[args.index("--tensor-model-parallel-size") + 1]) == big_t
    assert int(args[args.index("--pipeline-model-parallel-size") + 1]) == n_pp
    # the order initialize_model_parallel gets from these flags (megatron/training/initialize.py)
    order = "tp-cp-ep-pp-dp" if "--use-tp-pp-dp-mapping" in args else "tp-cp-ep-dp-pp"
    rows = _ranks_txt(out / "ranks.txt")
    world = len(rows)
    assert world == len(plan.replicas) * n_pp * big_t
    groups = meg.rank_groups(world, big_t, n_pp, order)
    coord: dict[int, dict[str, int]] = {}
    for kind, gs in groups.items():
        for g in gs:
            for i, r in enumerate(g):
                coord.setdefault(r, {})[kind] = i
                coord[r][kind + "_group"] = id(g)
    tp_group_of = {r: g for g in groups["tp"] for r in g}
    ps, dist, ntp = meg.ps, meg.dist, meg.ntp
    active: dict[tuple[int, int], list[int]] = {}
    final_group: dict[int, tuple[int, ...]] = {}
    reduced_flag: dict[int, bool] = {}
    for rank in range(world):
        c = coord[rank]
        dist.rank = rank
        ps.dp_rank, ps.pp_rank, ps.cp_rank, ps.cp_size = c["dp"], c["pp"], 0, 1
        for attr in ("_TENSOR_MODEL_PARALLEL_GLOBAL_RANKS",):
            ps.__dict__.pop(attr, None)
        stays = ntp.initialize_nonuniform_tp_process_groups(cfg, exit_spares=False)
        group = tuple(ps.__dict__.get("_TENSOR_MODEL_PARALLEL_GLOBAL_RANKS", tp_group_of[rank]))
        if stays:
            active.setdefault((c["dp"], c["pp"]), []).append(rank)
            final_group[rank] = group
            ps.tp_size, ps.tp_rank = len(group), group.index(rank)
            reduced_flag[rank] = bool(ntp._ntp_current_rank_is_reduced_dp(cfg))
    checked = {"ranks": world, "active": 0, "reduced_stages": 0}
    for r, rep in enumerate(plan.replicas):
        for k, st in enumerate(rep.stages):
            ranks = sorted(active.get((r, k), []))
            assert len(ranks) == rep.tp, (r, k, len(ranks), rep.tp)
            for rank in ranks:
                assert sorted(final_group[rank]) == ranks, (r, k, rank)
                assert reduced_flag[rank] == (rep.tp < big_t), (r, k, rank)
            if rep.tp < big_t:  # Megatron asks this only for reduced replicas
                want = ntp.get_active_ranks_for_dp(r, big_t, cfg, cp_rank=0, pp_rank=k)
                assert [coord[x]["tp"] for x in ranks] == want
            assert {rows[x]["gpu"] for x in ranks} == {str(g) for g in st.gpus}, (r, k)
            assert all(rows[x]["active"] == "1" for x in ranks)
            checked["active"] += len(ranks)
            checked["reduced_stages"] += rep.tp < big_t
    inactive = {x for x, row in rows.items() if row["active"] == "0"}
    assert inactive == set(range(world)) - {x for v in active.values() for x in v}
    # and the export reads back as the same plan
    back = import_megatron(out, instance)
    assert [(x.tp, x.local_batch, x.stages) for x in back.replicas] == [
        (x.tp, x.local_batch, x.stages) for x in plan.replicas
    ]
    return checked


# --- cases ------------------------------------------------------------------------------


def _small(pp: int) -> Instance:
    """4 domains of 8 GPUs (trays of 4): d0 has 1 failed GPU, d1 has 2; TP8 allowing 6, 7."""
    g = topology.build_cluster(4, 8, 4, 2)
    topology.fail_gpus(g, ["d0.t0.g1", "d1.t1.g0", "d1.t1.g3"])
    job = Job(
        tp=8,
        tp_min=6,
        tp_allowed=(6, 7, 8),
        pp=pp,
        dp=4 // pp,
        global_batch=8 // pp,
        max_local_batch=2,
        batch_policy="elastic",
    )
    return Instance(f"small-pp{pp}", g, job)


def _cases() -> list[tuple[str, str]]:
    return [
        ("small-pp1", "optimal-megatron"),
        ("small-pp2", "optimal-megatron"),
        ("default.json", "optimal-megatron"),
        ("default.json", "megatron-ntp-reordered"),
        ("paper-nvl32-32k-0.1pct.json.gz", "megatron-ntp-reordered"),
        ("gb200-nvl72-9k-trays.json.gz", "megatron-ntp-reordered"),
        ("dgx-64-healthy-fixed.json.gz", "megatron-ntp-reordered"),
    ]


def _instance(name: str) -> Instance:
    if name.startswith("small-pp"):
        return _small(int(name[-1]))
    return load_instance(ROOT / "instances" / name)


@pytest.mark.parametrize(("name", "policy"), _cases())
def test_megatron_derives_the_plan(
    megatron: Megatron, name: str, policy: str, tmp_path: Path
) -> None:
    inst = _instance(name)
    res = solve(inst, policy, time_limit=30.0)
    assert res.plan is not None and res.plan.replicas
    plan = res.plan
    if len({r.local_batch for r in plan.replicas}) > 1:
        plan = equal_batch(inst, plan)
    got = conformance(megatron, inst, plan, tmp_path / "out")
    n_reduced = sum(r.tp < inst.job.tp for r in plan.replicas)
    assert got["reduced_stages"] == n_reduced * inst.job.pp
    if name.startswith("small"):
        assert n_reduced >= 1 and n_reduced < len(plan.replicas)  # reduced and healthy replicas
    print(f"{name} {policy}: {got}, reduced replicas {n_reduced}")


def _extra_cases() -> list[tuple[str, str]]:
    spec = os.environ.get("NTP_CONFORMANCE_CASES", "")
    return [tuple(x.split(":", 1)) for x in spec.split(",") if x]  # type: ignore[misc]


@pytest.mark.parametrize(("instance_path", "plan_path"), _extra_cases())
def test_megatron_derives_given_plans(
    megatron: Megatron, instance_path: str, plan_path: str, tmp_path: Path
) -> None:
    inst = load_instance(instance_path)
    plan = load_plan(plan_path)
    if len({r.local_batch for r in plan.replicas}) > 1:
        plan = equal_batch(inst, plan)
    got = conformance(megatron, inst, plan, tmp_path / "out")
    rel = plan.metrics.get("relative_goodput")
    assert rel is None or math.isfinite(float(rel))
    print(f"{instance_path} {plan_path}: {got}, relative goodput {rel}")
