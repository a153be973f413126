"""Regenerate the bundled instance files (seeded, deterministic).

Usage::

    python instances/generate.py                 # write every committed instance
    python instances/generate.py --large         # ... and the large ones (instances/large/)
    python instances/generate.py --check         # exit 1 if a committed file differs
    python instances/generate.py --check --large # ... also check the large files present
    python instances/generate.py NAME...         # only these files

Every instance here is built from a preset of :mod:`ntp_opt.model.topology`, with
failures and stragglers drawn from fixed seeds, so the files can be rebuilt
byte for byte. Library instances of :data:`LARGE_GPUS` GPUs or more are not
committed: ``--large`` (or ``make instances``) writes them into
``instances/large/`` (gitignored). See ``instances/README.md`` for what each
one is for.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import networkx as nx
import numpy as np

from ntp_opt.model import topology
from ntp_opt.model.files import save_instance
from ntp_opt.model.instance import Instance
from ntp_opt.model.job import Job

HERE = Path(__file__).resolve().parent


def tiny() -> Instance:
    """Hand-checkable: 3 domains of 4 GPUs; one failed GPU, one straggler."""
    g = topology.build_cluster(3, 4, 2, 2, name="tiny")
    topology.fail_gpus(g, ["d0.t0.g0"])
    topology.set_speed(g, ["d1.t1.g1"], 0.5)
    job = Job(tp=4, tp_min=3, pp=1, dp=2, global_batch=8, batch_policy="elastic")
    return Instance("tiny", g, job, {"builder": "build_cluster(3, 4, 2, 2)"})


def default() -> Instance:
    """The `make run` instance: 4,096 GPUs in NVL32 domains, failures, stragglers."""
    g = topology.nvl32(128, rack_power_factor=1.3)
    topology.fail_random(g, fraction=0.003, seed=7)
    topology.add_stragglers(g, count=6, speed=(0.7, 0.95), seed=8)
    job = Job(tp=32, pp=8, dp=16, global_batch=256, batch_policy="fixed")
    return Instance(
        "default",
        g,
        job,
        {"builder": "nvl32", "failed_fraction": 0.003, "stragglers": 6, "seed": 7},
    )


#: NVL32 domains of the paper's simulated cluster (1,024 x 32 = 32,768 GPUs).
PAPER_DOMAINS = 1024


def paper_cluster(num_domains: int = PAPER_DOMAINS) -> nx.Graph:
    """The paper's B200 cluster: ``num_domains`` NVL32 domains, rack power factor 1.3."""
    return topology.nvl32(num_domains, rack_power_factor=1.3)


def paper_job(**overrides: Any) -> Job:
    """The paper's job: TP32 (30, 28), PP8, DP128, 2,048 sequences, elastic by default.

    480B model, 16M-token batch of 8k-token sequences: 2,048 sequences.
    ``overrides`` replace fields (e.g. ``batch_policy="fixed"``, ``dp_max``).
    """
    spec: dict[str, Any] = {
        "tp": 32,
        "tp_allowed": (28, 30, 32),
        "pp": 8,
        "dp": 128,
        "global_batch": 2048,
        "batch_policy": "elastic",
    }
    spec.update(overrides)
    return Job(**spec)


def paper(fraction: float) -> Callable[[], Instance]:
    """The paper's simulated cluster: 32,768 B200 GPUs, NVL32, TP32 (30, 28), PP8."""

    def make() -> Instance:
        g = paper_cluster()
        topology.fail_random(g, fraction=fraction, seed=2504)
        job = paper_job()
        pct = f"{fraction * 100:g}pct"
        return Instance(
            f"paper-nvl32-32k-{pct}",
            g,
            job,
            {
                "builder": "nvl32",
                "failed_fraction": fraction,
                "seed": 2504,
                "source": "arXiv 2504.06095, simulated 32k B200 cluster",
            },
        )

    return make


def gb200() -> Instance:
    """GB200 NVL72 racks, TP64 (one stage per rack, 8 spare GPUs), tray failures."""
    g = topology.gb200_nvl72(128)
    topology.fail_random(g, count=60, unit="tray", seed=72)
    topology.fail_random(g, fraction=0.01, seed=74)
    topology.add_stragglers(g, count=20, speed=0.85, seed=73)
    job = Job(tp=64, pp=2, dp=64, global_batch=1024, batch_policy="fixed")
    return Instance(
        "gb200-nvl72-9k-trays",
        g,
        job,
        {
            "builder": "nvl72",
            "failed_trays": 60,
            "failed_gpu_fraction": 0.01,
            "stragglers": 20,
            "seed": 72,
        },
    )


# ---------------------------------------------------------------------------
# The instance library: 64 to 131,072 GPUs (see instances/README.md)
# ---------------------------------------------------------------------------

STRAGGLER_SPEED = (0.7, 0.95)
"""Speed range stragglers are drawn from (uniformly)."""

TIGHT_SITE_FACTOR = 0.97
"""``tight`` power: site budget = this x the sum of all GPUs' TDP (racks at 1x)."""

GENEROUS_RACK_FACTOR = 1.3
"""``generous`` power: rack budgets = this x their GPUs' TDP (site at 1x), as the paper's racks."""

LARGE_GPUS = 32_768
"""Library instances at least this large are generated on demand (``--large``), not committed."""

LARGE_DIR = "large"
"""Folder (inside ``instances/``, gitignored) that ``--large`` writes into."""


@dataclass(frozen=True)
class Spec:
    """Recipe of one library instance; every field ends up in the instance's ``meta``.

    Attributes
    ----------
    name
        Instance name and file stem.
    kind
        :data:`ntp_opt.model.topology.BUILDERS` key: ``dgx-h100`` (NVL8), ``nvl32``, ``nvl72``,
        ``nvl36x2``.
    domains
        Number of NVLink domains (DGX nodes for ``dgx-h100``, racks for ``nvl72``).
    job
        Fields of :class:`ntp_opt.Job`.
    fail_fraction
        Fraction of all GPUs failed singly (``fail_random(fraction=...)``).
    fail_count
        Number of GPUs failed singly (for small clusters where a fraction rounds to 0).
    failed_trays
        Number of whole trays failed (drawn before single GPUs).
    stragglers
        Number of healthy GPUs slowed to a speed drawn from :data:`STRAGGLER_SPEED`.
    power
        ``nominal`` (racks and site at their GPUs' TDP), ``generous`` (racks at
        :data:`GENEROUS_RACK_FACTOR` x TDP) or ``tight`` (site at :data:`TIGHT_SITE_FACTOR` x TDP).
    p_fail
        Per-GPU failure probability over the planning horizon (0: no risk data).
    risky_tray_fraction, risky_tray_p
        Share of trays given a tray ``p_fail`` of ``risky_tray_p`` (whole-tray failures).
    seed
        Base seed: trays ``seed``, GPUs ``seed + 1``, stragglers ``seed + 2``, risk ``seed + 3``.
    """

    name: str
    kind: str
    domains: int
    job: dict[str, Any]
    fail_fraction: float = 0.0
    fail_count: int = 0
    failed_trays: int = 0
    stragglers: int = 0
    power: str = "nominal"
    p_fail: float = 0.0
    risky_tray_fraction: float = 0.0
    risky_tray_p: float = 0.0
    seed: int = 0

    @property
    def gpus(self) -> int:
        """Number of GPUs of the cluster."""
        return self.domains * DOMAIN_SIZE[self.kind]

    @property
    def file(self) -> str:
        """File name (inside ``instances/``, or ``instances/large/`` for large ones)."""
        return (
            f"{LARGE_DIR}/{self.name}.json.gz"
            if self.gpus >= LARGE_GPUS
            else f"{self.name}.json.gz"
        )

    def build(self) -> Instance:
        """Build the instance (deterministic)."""
        kw: dict[str, Any] = {"name": self.name}
        if self.power == "generous":
            kw["rack_power_factor"] = GENEROUS_RACK_FACTOR
        elif self.power not in ("nominal", "tight"):
            raise ValueError(f"{self.name}: power must be nominal, generous or tight")
        g = topology.BUILDERS[self.kind](self.domains, **kw)
        if self.power == "tight":
            g.graph["power_budget_w"] = TIGHT_SITE_FACTOR * g.graph["power_budget_w"]
        if self.failed_trays:
            topology.fail_random(g, count=self.failed_trays, unit="tray", seed=self.seed)
        if self.fail_fraction:
            topology.fail_random(g, fraction=self.fail_fraction, seed=self.seed + 1)
        if self.fail_count:
            topology.fail_random(g, count=self.fail_count, seed=self.seed + 1)
        if self.stragglers:
            topology.add_stragglers(
                g, count=self.stragglers, speed=STRAGGLER_SPEED, seed=self.seed + 2
            )
        if self.p_fail:
            topology.set_p_fail(g, self.p_fail)
        if self.risky_tray_fraction:
            all_trays = topology.trays(g)
            rng = np.random.default_rng(self.seed + 3)
            n = round(self.risky_tray_fraction * len(all_trays))
            idx = np.sort(rng.choice(len(all_trays), size=n, replace=False))
            topology.set_p_fail(g, self.risky_tray_p, [all_trays[i] for i in idx.tolist()])
        job = Job(**self.job)
        meta: dict[str, Any] = {"generator": "instances/generate.py", "library": 1}
        meta.update({k: v for k, v in asdict(self).items() if k not in ("name", "job") and v})
        meta["gpus"] = self.gpus
        if self.power == "generous":
            meta["rack_power_factor"] = GENEROUS_RACK_FACTOR
        if self.power == "tight":
            meta["site_power_factor"] = TIGHT_SITE_FACTOR
        if self.stragglers:
            meta["straggler_speed"] = list(STRAGGLER_SPEED)
        meta["seed"] = self.seed
        return Instance(self.name, g, job, meta)


DOMAIN_SIZE = {"dgx-h100": 8, "nvl32": 32, "nvl72": 72, "nvl36x2": 72}


def _job(tp: int, pp: int, dp: int, policy: str, b0: int = 16, **extra: Any) -> dict[str, Any]:
    """Job fields: ``global_batch = b0 * dp`` (b0 sequences per replica)."""
    return {"tp": tp, "pp": pp, "dp": dp, "global_batch": b0 * dp, "batch_policy": policy, **extra}


LIBRARY: tuple[Spec, ...] = (
    # --- NVL8: DGX H100 nodes (8 GPUs = 1 tray = 1 domain, 4 nodes per rack, 700 W)
    Spec("dgx-64-healthy-fixed", "dgx-h100", 8, _job(8, 2, 4, "fixed"), seed=100),
    Spec(
        "dgx-256-2gpu-elastic",
        "dgx-h100",
        32,
        _job(8, 4, 8, "elastic"),
        fail_count=2,
        power="generous",
        seed=110,
    ),
    Spec(
        "dgx-1k-0.4pct-fixed",
        "dgx-h100",
        128,
        _job(8, 8, 16, "fixed"),
        fail_fraction=0.004,
        stragglers=3,
        seed=120,
    ),
    Spec(
        "dgx-2k-tp4-0.1pct-elastic",
        "dgx-h100",
        256,
        _job(4, 8, 64, "elastic", tp_min=3, tp_allowed=(3, 4)),
        fail_fraction=0.001,
        power="generous",
        seed=130,
    ),
    Spec(
        "dgx-4k-trays-fixed",
        "dgx-h100",
        512,
        _job(8, 16, 32, "fixed"),
        failed_trays=3,
        fail_fraction=0.001,
        power="generous",
        seed=140,
    ),
    Spec(
        "dgx-8k-0.1pct-tight-elastic",
        "dgx-h100",
        1024,
        _job(8, 8, 128, "elastic"),
        fail_fraction=0.001,
        power="tight",
        seed=150,
    ),
    Spec(
        "dgx-16k-0.4pct-stragglers-fixed",
        "dgx-h100",
        2048,
        _job(8, 16, 128, "fixed", max_local_batch=24),
        fail_fraction=0.004,
        stragglers=16,
        power="generous",
        seed=160,
    ),
    # --- NVL32: the paper's B200 domains (8 trays of 4, one rack each, 1000 W)
    Spec(
        "nvl32-64-1gpu-elastic",
        "nvl32",
        2,
        _job(32, 1, 2, "elastic"),
        fail_count=1,
        power="generous",
        seed=200,
    ),
    Spec(
        "nvl32-256-healthy-tight-fixed",
        "nvl32",
        8,
        _job(32, 4, 2, "fixed", b0=8, max_local_batch=16),
        power="tight",
        seed=210,
    ),
    Spec(
        "nvl32-1k-0.1pct-fixed",
        "nvl32",
        32,
        _job(32, 8, 4, "fixed"),
        fail_fraction=0.001,
        power="generous",
        seed=220,
    ),
    Spec(
        "nvl32-1k-0.4pct-elastic",
        "nvl32",
        32,
        _job(32, 8, 4, "elastic"),
        fail_fraction=0.004,
        seed=230,
    ),
    Spec(
        "nvl32-2k-tp16-0.4pct-elastic",
        "nvl32",
        64,
        _job(16, 4, 32, "elastic", tp_allowed=(14, 15, 16)),
        fail_fraction=0.004,
        power="generous",
        seed=240,
    ),
    Spec(
        "nvl32-4k-healthy-stragglers-elastic",
        "nvl32",
        128,
        _job(32, 8, 16, "elastic"),
        stragglers=20,
        power="generous",
        seed=250,
    ),
    Spec(
        "nvl32-4k-trays-fixed",
        "nvl32",
        128,
        _job(32, 8, 16, "fixed"),
        failed_trays=4,
        fail_fraction=0.001,
        seed=260,
    ),
    Spec(
        "nvl32-8k-0.4pct-tight-elastic",
        "nvl32",
        256,
        _job(32, 8, 32, "elastic", tp_allowed=(28, 30, 32)),
        fail_fraction=0.004,
        power="tight",
        seed=270,
    ),
    Spec(
        "nvl32-16k-0.1pct-fixed",
        "nvl32",
        512,
        _job(32, 8, 64, "fixed", tp_allowed=(28, 30, 32)),
        fail_fraction=0.001,
        stragglers=16,
        power="generous",
        seed=280,
    ),
    Spec(
        "nvl32-16k-risky-elastic",
        "nvl32",
        512,
        _job(32, 8, 60, "elastic"),
        p_fail=0.001,
        risky_tray_fraction=0.02,
        risky_tray_p=0.05,
        power="generous",
        seed=290,
    ),
    # --- GB200 NVL72: one 72-GPU domain per rack (18 trays of 4, 1200 W)
    Spec(
        "nvl72-72-tp72-2gpu-fixed",
        "nvl72",
        1,
        _job(72, 1, 1, "fixed", tp_allowed=(64, 68, 72)),
        fail_count=2,
        seed=300,
    ),
    Spec(
        "nvl72-576-tp36-0.4pct-elastic",
        "nvl72",
        8,
        _job(36, 4, 4, "elastic"),
        fail_fraction=0.004,
        seed=310,
    ),
    Spec(
        "nvl72-1k-tp72-trays-fixed",
        "nvl72",
        16,
        _job(72, 4, 4, "fixed", tp_allowed=(64, 68, 72)),
        failed_trays=2,
        power="generous",
        seed=320,
    ),
    Spec(
        "nvl72-2k-tp72-0.1pct-tight-fixed",
        "nvl72",
        32,
        _job(72, 2, 16, "fixed", max_local_batch=32, tp_allowed=(64, 68, 72)),
        fail_fraction=0.001,
        power="tight",
        seed=330,
    ),
    Spec(
        "nvl72-4k-tp36-0.4pct-elastic",
        "nvl72",
        64,
        _job(36, 8, 16, "elastic"),
        fail_fraction=0.004,
        stragglers=8,
        power="generous",
        seed=340,
    ),
    Spec(
        "nvl72-8k-tp72-0.1pct-elastic",
        "nvl72",
        112,
        _job(72, 8, 14, "elastic", tp_allowed=(64, 66, 68, 70, 72)),
        fail_fraction=0.001,
        seed=350,
    ),
    Spec(
        "nvl72-16k-tp72-trays-fixed",
        "nvl72",
        228,
        _job(72, 4, 57, "fixed", tp_allowed=(64, 66, 68, 70, 72), max_local_batch=20),
        failed_trays=5,
        fail_fraction=0.001,
        stragglers=16,
        seed=360,
    ),
    # --- GB200 NVL36x2: 72-GPU domains spanning two racks of 9 trays (1200 W)
    Spec(
        "nvl36x2-144-tp72-tray-fixed",
        "nvl36x2",
        2,
        _job(72, 1, 2, "fixed", max_local_batch=24, tp_allowed=(64, 68, 72)),
        failed_trays=1,
        power="generous",
        seed=400,
    ),
    Spec(
        "nvl36x2-1k-tp36-0.4pct-elastic",
        "nvl36x2",
        16,
        _job(36, 4, 8, "elastic"),
        fail_fraction=0.004,
        seed=410,
    ),
    Spec(
        "nvl36x2-2k-tp72-tight-elastic",
        "nvl36x2",
        32,
        _job(72, 4, 8, "elastic", tp_allowed=(64, 68, 72)),
        fail_fraction=0.001,
        power="tight",
        seed=420,
    ),
    Spec(
        "nvl36x2-4k-trays-fixed",
        "nvl36x2",
        64,
        _job(64, 8, 8, "fixed"),
        failed_trays=6,
        stragglers=8,
        power="generous",
        seed=430,
    ),
    Spec(
        "nvl36x2-8k-tp36-0.4pct-fixed",
        "nvl36x2",
        128,
        _job(36, 8, 32, "fixed"),
        fail_fraction=0.004,
        seed=440,
    ),
    Spec(
        "nvl36x2-16k-0.1pct-elastic",
        "nvl36x2",
        228,
        _job(64, 4, 56, "elastic"),
        fail_fraction=0.001,
        power="generous",
        seed=450,
    ),
    # --- large (>= 32k GPUs): generated on demand into instances/large/ (gitignored)
    Spec(
        "dgx-32k-0.1pct-fixed",
        "dgx-h100",
        4096,
        _job(8, 16, 252, "fixed"),
        fail_fraction=0.001,
        stragglers=32,
        seed=500,
    ),
    Spec(
        "nvl36x2-32k-0.1pct-tight-elastic",
        "nvl36x2",
        456,
        _job(64, 8, 56, "elastic"),
        fail_fraction=0.001,
        power="tight",
        seed=510,
    ),
    Spec(
        "nvl32-64k-0.4pct-elastic",
        "nvl32",
        2048,
        _job(32, 8, 256, "elastic", tp_allowed=(28, 30, 32)),
        fail_fraction=0.004,
        power="generous",
        seed=520,
    ),
    Spec(
        "nvl72-64k-trays-fixed",
        "nvl72",
        910,
        _job(64, 4, 224, "fixed"),
        failed_trays=40,
        fail_fraction=0.001,
        stragglers=64,
        power="generous",
        seed=530,
    ),
    Spec(
        "nvl32-128k-0.1pct-fixed",
        "nvl32",
        4096,
        _job(32, 16, 256, "fixed", tp_allowed=(28, 30, 32)),
        fail_fraction=0.001,
        stragglers=128,
        power="generous",
        seed=540,
    ),
    Spec(
        "dgx-128k-0.4pct-elastic",
        "dgx-h100",
        16384,
        _job(8, 16, 1016, "elastic"),
        fail_fraction=0.004,
        seed=550,
    ),
    Spec(
        "nvl72-128k-0.1pct-elastic",
        "nvl72",
        1820,
        _job(64, 8, 227, "elastic"),
        fail_fraction=0.001,
        stragglers=128,
        seed=560,
    ),
)
"""Every library instance, small to large."""


BUNDLED: dict[str, Callable[[], Instance]] = {
    "tiny.json": tiny,
    "default.json": default,
    "paper-nvl32-32k-0.1pct.json.gz": paper(0.001),
    "paper-nvl32-32k-0.4pct.json.gz": paper(0.004),
    "gb200-nvl72-9k-trays.json.gz": gb200,
}
"""The hand-made instances (kept byte-identical: tests and the README rely on them)."""

INSTANCES: dict[str, Callable[[], Instance]] = {
    **BUNDLED,
    **{s.file: s.build for s in LIBRARY if s.gpus < LARGE_GPUS},
}
"""Every committed file (relative to ``instances/``) and the function that builds it."""

LARGE: dict[str, Callable[[], Instance]] = {
    s.file: s.build for s in LIBRARY if s.gpus >= LARGE_GPUS
}
"""Files generated on demand (relative to ``instances/``, inside ``large/``)."""


def main(argv: list[str] | None = None) -> int:
    """Write (or with ``--check`` compare) the bundled instances."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare instead of writing")
    parser.add_argument(
        "--large",
        action="store_true",
        help=f"also the instances of {LARGE_GPUS:,}+ GPUs (into instances/{LARGE_DIR}/)",
    )
    parser.add_argument("names", nargs="*", help="only these files (as listed in INSTANCES)")
    args = parser.parse_args(argv)
    todo = dict(INSTANCES)
    if args.large or any(n in LARGE for n in args.names):
        todo.update(LARGE)
    unknown = [n for n in args.names if n not in todo]
    if unknown:
        parser.error(f"unknown instance files: {', '.join(unknown)}")
    stale = []
    for name, make in todo.items():
        if args.names and name not in args.names:
            continue
        target = HERE / name
        if args.check and name in LARGE and not target.exists() and not args.names:
            continue  # large files are optional; check the ones present
        inst = make()
        if args.check:
            with tempfile.TemporaryDirectory() as tmp:
                fresh = Path(tmp) / Path(name).name
                save_instance(inst, fresh)
                if not target.exists() or fresh.read_bytes() != target.read_bytes():
                    stale.append(name)
        else:
            save_instance(inst, target)
            print(f"wrote instances/{name}")
    if stale:
        print("stale: " + ", ".join(stale), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
