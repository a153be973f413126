"""How large the Kubernetes export of a plan is: Jobs, ConfigMaps, bytes, time.

Usage::

    python benchmarks/k8s_export_size.py [FILES ...]

For each instance (default ``instances/default.json`` and the paper's 32k
instance) it plans with ``megatron-ntp-reordered`` (a heuristic: no time
limit involved), exports with 64 named placeholder hosts of 8 GPUs, and
builds the Kubernetes files twice: as the instance is (no GPU UUIDs: index
binding) and with a made-up UUID on every GPU (the longest table). It prints
the ranks, Jobs, the ConfigMaps' sizes (Kubernetes stores at most 1 MiB per
object; larger tables are split) and the size of ``k8s.json``.
"""

from __future__ import annotations

import argparse
import json
import time
import uuid
from pathlib import Path

from ntp_opt import load_instance, solve
from ntp_opt.app.export import K8S_NAME, K8sOptions, k8s_files, megatron_export

ROOT = Path(__file__).resolve().parent.parent
DEFAULT = ["instances/default.json", "instances/paper-nvl32-32k-0.1pct.json.gz"]


def main() -> None:
    """Print one line per instance and binding."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="*", default=DEFAULT)
    args = parser.parse_args()
    for name in args.files:
        inst = load_instance(ROOT / name if not Path(name).is_absolute() else name)
        plan = solve(inst, "megatron-ntp-reordered").plan
        spares = [f"spare-{i}" for i in range(64)]
        ex = megatron_export(inst, plan, placeholder_hosts=spares, placeholder_gpus=8)
        for with_uuid in (False, True):
            if with_uuid:
                for g in inst.arrays.gpu_ids:
                    inst.cluster.nodes[g]["uuid"] = "GPU-" + str(
                        uuid.uuid5(uuid.NAMESPACE_DNS, str(g))
                    )
            t = time.perf_counter()
            files = k8s_files(inst, ex, K8sOptions("nvcr.io/nvidia/pytorch:25.01-py3"))
            took = time.perf_counter() - t
            doc = json.loads(files[K8S_NAME])
            cms = [it["data"] for it in doc["items"] if it["kind"] == "ConfigMap"]
            sizes = [sum(len(k) + len(v.encode()) for k, v in cm.items()) for cm in cms]
            jobs = sum(it["kind"] == "Job" for it in doc["items"])
            print(
                f"{Path(name).name} {'uuid ' if with_uuid else 'index'}: {len(ex.rows)} ranks, "
                f"{jobs} Jobs, {len(cms)} ConfigMap(s) of {sizes} bytes, "
                f"k8s.json {len(files[K8S_NAME]) / 1e6:.1f} MB, {took:.1f} s"
            )


if __name__ == "__main__":
    main()
