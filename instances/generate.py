"""Regenerate the bundled instance files (seeded, deterministic).

Usage::

    python instances/generate.py            # write every instance below
    python instances/generate.py --check    # exit 1 if a committed file differs

Every instance here is built from a preset of :mod:`ntp_opt.topology`, with
failures and stragglers drawn from fixed seeds, so the files can be rebuilt
byte for byte. See ``instances/README.md`` for what each one is for.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import networkx as nx

from ntp_opt import topology
from ntp_opt.files import save_instance
from ntp_opt.instance import Instance
from ntp_opt.job import Job

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


INSTANCES: dict[str, Callable[[], Instance]] = {
    "tiny.json": tiny,
    "default.json": default,
    "paper-nvl32-32k-0.1pct.json.gz": paper(0.001),
    "paper-nvl32-32k-0.4pct.json.gz": paper(0.004),
    "gb200-nvl72-9k-trays.json.gz": gb200,
}


def main(argv: list[str] | None = None) -> int:
    """Write (or with ``--check`` compare) every bundled instance."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare instead of writing")
    parser.add_argument("names", nargs="*", help="only these files")
    args = parser.parse_args(argv)
    stale = []
    for name, make in INSTANCES.items():
        if args.names and name not in args.names:
            continue
        inst = make()
        if args.check:
            with tempfile.TemporaryDirectory() as tmp:
                fresh = Path(tmp) / name
                save_instance(inst, fresh)
                if fresh.read_bytes() != (HERE / name).read_bytes():
                    stale.append(name)
        else:
            save_instance(inst, HERE / name)
            print(f"wrote instances/{name}")
    if stale:
        print("stale: " + ", ".join(stale), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
