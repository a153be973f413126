"""How many Megatron exports have a torchrun variant (every host's ranks contiguous).

Usage::

    python benchmarks/torchrun_share.py [--time-limit 5] [--exact-max-gpus 5000]
        [--spare-hosts N] [--detail] [FILES ...]

For every instance of the library (default ``instances/*.json`` and
``instances/*.json.gz``) and every importer fixture (``tests/fixtures/import/*``:
``topology.yaml`` -> Slurm, ``nodes.json`` -> Kubernetes with the rack label
``example.com/rack``, one instance per ``job*.json``), each main policy
(``ntp``, ``ntp-pw``, ``fast``, ``optimal``, ``optimal-megatron``) is solved
and its plan exported in memory (:func:`ntp_opt.app.export.megatron_export`,
``reorder=True``; with ``--spare-hosts N``, N named placeholder hosts
``spare0000 ...`` of the cluster's largest host size); ``optimal-megatron`` plans
are exported as they are (one local batch). Each plan counts as one of:

* ``torchrun``: exported, with torchrun files;
* ``srun only``: exported, but some host's ranks are not contiguous;
* ``no slots``: refused for lack of GPUs for the inactive ranks (``megatron-placeholders``);
* ``not exportable``: several reduced degrees or unequal local batches (or the
  paused plan): Megatron cannot run it whatever the hosts;
* ``skipped``: exact planners on instances above ``--exact-max-gpus``, or no plan.

It prints one table per policy and overall, and with ``--detail`` one line
per plan (the torchrun note when there is none).
"""

from __future__ import annotations

import argparse
import glob
import io
from collections import Counter
from collections.abc import Iterator
from contextlib import redirect_stdout
from pathlib import Path

from ntp_opt import Instance, load_instance, solve
from ntp_opt.app.export import MegatronError, megatron_export

ROOT = Path(__file__).resolve().parent.parent
POLICIES = ("ntp", "ntp-pw", "fast", "optimal", "optimal-megatron")
EXACT = ("optimal", "optimal-megatron")
KINDS = ("torchrun", "srun only", "no slots", "not exportable", "skipped")
RACK_LABEL = "example.com/rack"


def _fixtures() -> Iterator[tuple[str, Instance]]:
    """Instances of the importer fixtures, one per job file."""
    from ntp_opt.app.importers import import_k8s, import_slurm
    from ntp_opt.app.importers.cli import load_job

    def quiet(_: str) -> None:
        return None

    for d in sorted((ROOT / "tests" / "fixtures" / "import").iterdir()):
        if not d.is_dir():
            continue
        smi = d / "nvidia-smi" if (d / "nvidia-smi").is_dir() else None
        if (d / "topology.yaml").is_file():
            cluster = import_slurm(
                d / "topology.yaml", d / "nodes.txt", nvidia_smi=smi, warn=quiet, name=d.name
            )
        elif (d / "nodes.json").is_file():
            cluster = import_k8s(
                d / "nodes.json", nvidia_smi=smi, rack_label=RACK_LABEL, warn=quiet, name=d.name
            )
        else:
            continue
        for job in sorted(d.glob("job*.json")):
            name = f"{d.name}/{job.stem}"
            yield name, Instance(name, cluster, load_job(job))


def _library(files: list[str]) -> Iterator[tuple[str, Instance]]:
    for f in files:
        yield Path(f).name, load_instance(f)


def classify(
    instance: Instance, policy: str, time_limit: float, spares: list[str]
) -> tuple[str, str]:
    """The kind of one policy's plan on ``instance`` and a note."""
    res = solve(instance, policy, time_limit=time_limit)
    if res.plan is None:
        return "skipped", "no plan"
    plan = res.plan
    try:
        ex = megatron_export(instance, plan, reorder=True, placeholder_hosts=spares)
    except MegatronError as err:
        v = err.violations[0]
        if v.rule == "megatron-placeholders":
            return "no slots", str(v)
        return "not exportable", str(v)
    if ex.torchrun_hosts is not None:
        named = sum(1 for h in {row.host for row in ex.rows} if h in spares)
        return "torchrun", f"{len(ex.torchrun_hosts)} hosts, {named} named placeholder hosts"
    return "srun only", ex.torchrun_note


def main() -> None:
    """Solve, export and print the tables."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="*", help="instance files (default: the library + fixtures)")
    ap.add_argument("--time-limit", type=float, default=5.0, help="seconds per exact solve")
    ap.add_argument("--exact-max-gpus", type=int, default=5000, help="skip exact planners above")
    ap.add_argument("--policies", default=",".join(POLICIES), help="comma-separated")
    ap.add_argument("--spare-hosts", type=int, default=0, help="named placeholder hosts")
    ap.add_argument("--detail", action="store_true", help="one line per plan")
    args = ap.parse_args()
    files = args.files or sorted(
        f
        for pat in ("instances/*.json", "instances/*.json.gz")
        for f in glob.glob(str(ROOT / pat))
        if Path(f).name != "best_known.json"
    )
    sources: list[Iterator[tuple[str, Instance]]] = [_library(files)]
    if not args.files:
        sources.append(_fixtures())
    policies = [p for p in args.policies.split(",") if p]
    spares = [f"spare{i:04d}" for i in range(args.spare_hosts)]
    counts: dict[str, Counter[str]] = {p: Counter() for p in policies}
    for source in sources:
        for name, instance in source:
            for policy in policies:
                if policy in EXACT and instance.arrays.n_gpus > args.exact_max_gpus:
                    kind, note = "skipped", f"{instance.arrays.n_gpus} GPUs"
                else:
                    with redirect_stdout(io.StringIO()):
                        kind, note = classify(instance, policy, args.time_limit, spares)
                counts[policy][kind] += 1
                if args.detail:
                    print(f"{name:45s} {policy:17s} {kind:15s} {note[:160]}", flush=True)
    total: Counter[str] = Counter()
    for c in counts.values():
        total.update(c)
    print()
    print("| policy | plans | " + " | ".join(KINDS) + " | torchrun share of exportable |")
    print("|---|---:|" + "---:|" * len(KINDS) + "---:|")
    for label, c in [*counts.items(), ("all", total)]:
        exportable = c["torchrun"] + c["srun only"] + c["no slots"]
        share = f"{c['torchrun'] / exportable:.0%}" if exportable else "-"
        cells = " | ".join(str(c[k]) for k in KINDS)
        print(f"| {label} | {sum(c.values())} | {cells} | {share} |")


if __name__ == "__main__":
    main()
