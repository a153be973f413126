"""``ntp-opt export --to k8s``: Kubernetes objects, pod placement, GPU binding, the wrapper.

Every generated object is checked against the Kubernetes object model of the
``kubernetes`` Python client (its model classes' ``openapi_types``,
``attribute_map`` and required fields), with a strict recursive checker that is
itself shown to reject wrong keys, wrong types and missing fields.

Expected values come from the fixtures (the nvidia-smi XML files' UUIDs and
minor numbers, the failed GPUs listed in docs/import.md), from the plan, or
from the rank table of the Megatron-LM export this route consumes
(``Export.rows``, placement is not this module's job); never from
``ntp_opt.app.export.k8s`` itself. The wrapper script runs under bash with a
stub training command that records its environment.
"""

from __future__ import annotations

import copy
import functools
import json
import os
import re
import subprocess
from pathlib import Path
from typing import Any

import networkx as nx
import pytest

from ntp_opt.app.cli import main
from ntp_opt.app.export import K8S_NAME, K8sOptions, export_k8s, megatron_export
from ntp_opt.app.importers import import_k8s, import_slurm
from ntp_opt.app.importers.cli import load_job
from ntp_opt.model.files import load_instance, save_instance, save_plan
from ntp_opt.model.instance import Instance
from ntp_opt.model.plan import Plan, Replica, Stage
from ntp_opt.planners.megatron import MegatronError
from ntp_opt.rules.validate import evaluate
from ntp_opt.solve import solve

k8s_models = pytest.importorskip("kubernetes.client.models")

ROOT = Path(__file__).resolve().parents[2]
H100 = ROOT / "tests/fixtures/import/h100-k8s"
GB = ROOT / "tests/fixtures/import/gb200-slurm"
IMAGE = "nvcr.io/nvidia/pytorch:25.01-py3"
OPTS = K8sOptions(IMAGE)
#: DNS-1123 label and subdomain, written out here from the Kubernetes documentation.
LABEL = re.compile(r"^[a-z0-9]([a-z0-9-]*[a-z0-9])?$")
SUBDOMAIN = re.compile(r"^[a-z0-9]([a-z0-9-]*[a-z0-9])?(\.[a-z0-9]([a-z0-9-]*[a-z0-9])?)*$")
#: Label values: at most 63 of [A-Za-z0-9._-], alphanumeric at both ends (or empty).
LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")


def quiet(_: str) -> None:
    pass


# --- a strict checker against the Kubernetes object model --------------------------------

MODELS = {("v1", "Service"): "V1Service", ("v1", "ConfigMap"): "V1ConfigMap"}
MODELS[("batch/v1", "Job")] = "V1Job"
PRIMITIVES: dict[str, tuple[type, ...]] = {
    "str": (str,),
    "int": (int,),
    "bool": (bool,),
    "float": (int, float),
    "datetime": (str,),
    "date": (str,),
    "bytes": (str,),
    "object": (str, int),  # IntOrString (a Service's targetPort, a probe's port)
}


def model_errors(value: Any, type_name: str, path: str) -> list[str]:
    """Everything in ``value`` that the Kubernetes model type ``type_name`` does not allow."""
    if m := re.fullmatch(r"List\[(.+)\]", type_name):
        if not isinstance(value, list):
            return [f"{path}: {type(value).__name__}, expected a list of {m[1]}"]
        return [e for i, v in enumerate(value) for e in model_errors(v, m[1], f"{path}[{i}]")]
    if m := re.fullmatch(r"Dict\[str, (.+)\]", type_name):
        if not isinstance(value, dict):
            return [f"{path}: {type(value).__name__}, expected a map of {m[1]}"]
        errors = [f"{path}: key {k!r} is not a string" for k in value if not isinstance(k, str)]
        return errors + [e for k, v in value.items() for e in model_errors(v, m[1], f"{path}.{k}")]
    if type_name in PRIMITIVES:
        ok = isinstance(value, PRIMITIVES[type_name])
        if isinstance(value, bool) and type_name != "bool":
            ok = False
        return [] if ok else [f"{path}: {value!r} is not {type_name}"]
    cls = getattr(k8s_models, type_name, None)
    if cls is None:
        return [f"{path}: unknown model type {type_name}"]
    if not isinstance(value, dict):
        return [f"{path}: {type(value).__name__}, expected an object {type_name}"]
    by_json = {j: py for py, j in cls.attribute_map.items()}
    errors = []
    for key, v in value.items():
        if key not in by_json:
            errors.append(f"{path}.{key}: not a field of {type_name}")
        else:
            errors += model_errors(v, cls.openapi_types[by_json[key]], f"{path}.{key}")
    for py, info in cls.model_fields.items():
        if info.is_required() and cls.attribute_map[py] not in value:
            errors.append(f"{path}.{cls.attribute_map[py]}: required by {type_name}, missing")
    return errors


def manifest_errors(doc: Any) -> list[str]:
    """A ``v1`` ``List`` of Services, ConfigMaps and Jobs, checked object by object."""
    if not isinstance(doc, dict) or set(doc) - {"apiVersion", "kind", "items", "metadata"}:
        return ["the document is not a v1 List"]
    if (doc.get("apiVersion"), doc.get("kind")) != ("v1", "List"):
        return ["the document is not a v1 List"]
    errors = []
    for i, item in enumerate(doc["items"]):
        key = (item.get("apiVersion"), item.get("kind"))
        if key not in MODELS:
            errors.append(f"items[{i}]: unexpected object {key}")
            continue
        errors += model_errors(item, MODELS[key], f"items[{i}]")
    return errors


# --- the H100 Kubernetes fixture and a plan with placeholder ranks --------------------------


@functools.cache
def _h100_graph(with_uuid: bool = True) -> nx.Graph:
    return import_k8s(
        H100 / "nodes.json",
        nvidia_smi=H100 / "nvidia-smi" if with_uuid else None,
        rack_label="example.com/rack",
        warn=quiet,
    )


def h100(with_uuid: bool = True) -> Instance:
    return Instance("h100", _h100_graph(with_uuid).copy(), load_job(H100 / "job.json"))


def _stage(host: str, idx: Any) -> Stage:
    return Stage(f"{host}/nvlink", tuple(f"{host}:gpu{i}" for i in idx), 1.0)


#: Replica 0 at TP7 (dgx-h100-02 without its failed GPU 5, then dgx-h100-06), replica 1 at
#: TP8; the two inactive ranks go to the idle dgx-h100-01 and the named spare host.
PLAN = Plan(
    "h100",
    (
        Replica(
            7, 16, (_stage("dgx-h100-02", [0, 1, 2, 3, 4, 6, 7]), _stage("dgx-h100-06", range(7)))
        ),
        Replica(8, 16, (_stage("dgx-h100-07", range(8)), _stage("dgx-h100-08", range(8)))),
    ),
    {},
)
SPARE = ["spare-01"]


def xml_uuids(path: Path) -> dict[int, str]:
    """minor number -> UUID, read from an nvidia-smi XML file with regular expressions."""
    text = path.read_text()
    return {
        int(m): u for u, m in re.findall(r"<uuid>(GPU-[^<]+)</uuid>\s*<minor_number>(\d+)</", text)
    }


def evaluated(inst: Instance, plan: Plan) -> Plan:
    return plan.with_metrics(**evaluate(inst, plan).as_metrics())


def items(doc: dict[str, Any], kind: str) -> list[dict[str, Any]]:
    return [it for it in doc["items"] if it["kind"] == kind]


def pod(job: dict[str, Any]) -> dict[str, Any]:
    return job["spec"]["template"]["spec"]


def pinned_node(job: dict[str, Any]) -> str:
    terms = pod(job)["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    [term] = terms["nodeSelectorTerms"]
    [req] = term["matchFields"]
    assert (req["key"], req["operator"]) == ("metadata.name", "In")
    [node] = req["values"]
    return node


def env_of(job: dict[str, Any]) -> dict[str, Any]:
    [c] = pod(job)["containers"]
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in c["env"]}


@pytest.fixture(scope="module")
def h100_export(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any], Any]:
    out = tmp_path_factory.mktemp("h100-k8s")
    ex = export_k8s(h100(), PLAN, out, OPTS, placeholder_hosts=SPARE, placeholder_gpus=8)
    return out, json.loads((out / K8S_NAME).read_text()), ex


def test_the_checker_rejects_wrong_keys_types_and_missing_fields(
    h100_export: tuple[Path, dict[str, Any], Any],
) -> None:
    _, doc, _ = h100_export
    assert manifest_errors(doc) == []
    job = next(i for i, it in enumerate(doc["items"]) if it["kind"] == "Job")

    def broken(change: Any) -> list[str]:
        d = copy.deepcopy(doc)
        change(d["items"][job])
        return manifest_errors(d)

    def typo(j: dict[str, Any]) -> None:
        pod(j)["nodeSelecter"] = {"kubernetes.io/hostname": "x"}

    def int_quantity(j: dict[str, Any]) -> None:
        pod(j)["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] = 8

    def str_count(j: dict[str, Any]) -> None:
        j["spec"]["backoffLimit"] = "0"

    def no_containers(j: dict[str, Any]) -> None:
        del pod(j)["containers"]

    def env_not_list(j: dict[str, Any]) -> None:
        pod(j)["containers"][0]["env"] = {"RANK": "0"}

    def bool_port(j: dict[str, Any]) -> None:
        pod(j)["containers"][0]["ports"] = [{"containerPort": True}]

    def no_template(j: dict[str, Any]) -> None:
        del j["spec"]["template"]

    assert any("nodeSelecter: not a field of V1PodSpec" in e for e in broken(typo))
    assert any("8 is not str" in e for e in broken(int_quantity))
    assert any("backoffLimit: '0' is not int" in e for e in broken(str_count))
    assert any("containers: required by V1PodSpec" in e for e in broken(no_containers))
    assert any("expected a list of V1EnvVar" in e for e in broken(env_not_list))
    assert any("containerPort: True is not int" in e for e in broken(bool_port))
    assert any("template: required by V1JobSpec" in e for e in broken(no_template))
    assert manifest_errors({**doc, "kind": "PodList"}) == ["the document is not a v1 List"]


def test_h100_one_pinned_job_per_planned_host(
    h100_export: tuple[Path, dict[str, Any], Any],
) -> None:
    out, doc, ex = h100_export
    assert manifest_errors(doc) == []
    [svc] = items(doc, "Service")
    [cm] = items(doc, "ConfigMap")
    jobs = items(doc, "Job")
    # the hosts the plan names, plus those the rank table gives the two placeholder ranks
    # (free healthy GPUs of any host, planned ones included)
    planned = {"dgx-h100-02", "dgx-h100-06", "dgx-h100-07", "dgx-h100-08"}
    inactive_hosts = {r.host for r in ex.rows if not r.active}
    assert len([r for r in ex.rows if not r.active]) == 2
    assert sorted(pinned_node(j) for j in jobs) == sorted(planned | inactive_hosts)
    ranks_by_host: dict[str, list[int]] = {}
    for r in ex.rows:
        ranks_by_host.setdefault(r.host, []).append(r.rank)
    healthy = {h: 8 for h in ("dgx-h100-01", "dgx-h100-06", "dgx-h100-07", "dgx-h100-08")}
    healthy["dgx-h100-02"] = 7  # GPU 5 failed (docs/import.md)
    names = set()
    for j in jobs:
        node = pinned_node(j)
        spec, p = j["spec"], pod(j)
        assert (spec["completions"], spec["backoffLimit"], p["restartPolicy"]) == (1, 0, "Never")
        assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in p[
            "tolerations"
        ]
        [c] = p["containers"]
        want = healthy.get(node, len(ranks_by_host[node]))  # spare host: its placeholders
        assert c["resources"]["limits"] == {"nvidia.com/gpu": str(want)}
        env = env_of(j)
        assert env["NTP_NODE_NAME"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
        assert c["command"][0] == "bash" and c["args"] == ["python", "pretrain_gpt_ntp.py"]
        name = j["metadata"]["name"]
        assert LABEL.match(name) and len(name) <= 63 and p["hostname"] == name
        assert p["subdomain"] == svc["metadata"]["name"]
        assert (
            j["spec"]["template"]["metadata"]["labels"].items() >= svc["spec"]["selector"].items()
        )
        assert all(LABEL_VALUE.match(v) for v in j["metadata"]["labels"].values())
        [vol] = [v for v in p["volumes"] if v["name"] == "ntp"]
        assert vol["projected"]["sources"] == [{"configMap": {"name": cm["metadata"]["name"]}}]
        names.add(name)
    assert len(names) == len(jobs)
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"]
    rank0 = next(j for j in jobs if pinned_node(j) == "dgx-h100-02")  # the host of rank 0
    master = f"{rank0['metadata']['name']}.{svc['metadata']['name']}"
    assert {env_of(j)["MASTER_ADDR"] for j in jobs} == {master}
    assert {env_of(j)["MASTER_PORT"] for j in jobs} == {"29500"}
    assert set(cm["data"]) >= {"k8s-launch.sh", "ranks.txt", "ntp_config.py", "megatron-args.txt"}
    assert cm["data"]["ranks.txt"] == (out / "ranks.txt").read_text()
    assert (out / "bind.sh").is_file() and (out / "LAUNCH.md").is_file()


# --- the wrapper ----------------------------------------------------------------------

STUB = r"""#!/bin/bash
{
  for v in RANK WORLD_SIZE LOCAL_RANK CUDA_VISIBLE_DEVICES CUDA_DEVICE_ORDER MASTER_ADDR \
      MASTER_PORT NTP_RANK_ACTIVE; do
    printf '%s=%s\n' "$v" "${!v-<unset>}"
  done
  printf 'ARGS=%s\n' "$*"
} >"$STUB_OUT/.rank-$RANK"
mv "$STUB_OUT/.rank-$RANK" "$STUB_OUT/rank-$RANK.env"  # whole or absent if the rank is stopped
if [ "$RANK" = "${STUB_FAIL_RANK:-}" ]; then exit 7; fi
"""


def run_wrapper(
    tmp: Path,
    doc: dict[str, Any],
    node: str,
    *,
    extra_env: dict[str, str] | None = None,
    nvidia_smi: str | None = None,
) -> tuple[subprocess.CompletedProcess[str], dict[int, dict[str, str]]]:
    """Run a pod's command as the Job gives it, on ``node``, with the ConfigMap's files."""
    cms = {cm["metadata"]["name"]: cm["data"] for cm in items(doc, "ConfigMap")}
    jobs = items(doc, "Job")
    job = next((j for j in jobs if pinned_node(j) == node), jobs[0])
    d = tmp / "ntp"
    d.mkdir()
    [vol] = [v for v in pod(job)["volumes"] if v["name"] == "ntp"]
    for src in vol["projected"]["sources"]:  # the projected volume: every ConfigMap in /ntp
        for name, text in cms[src["configMap"]["name"]].items():
            assert not (d / name).exists()
            (d / name).write_text(text)
    out = tmp / "out"
    out.mkdir()
    (tmp / "bin").mkdir()
    if nvidia_smi is not None:  # a fake nvidia-smi on PATH
        (tmp / "bin/nvidia-smi").write_text(nvidia_smi)
        (tmp / "bin/nvidia-smi").chmod(0o755)
    stub = tmp / "stub.sh"
    stub.write_text(STUB)
    stub.chmod(0o755)
    env = {k: v for k, v in env_of(job).items() if isinstance(v, str)}
    env.update(NTP_NODE_NAME=node, NTP_EXPORT_DIR=str(d), NTP_DNS_WAIT="0")
    env.update(PATH=f"{tmp / 'bin'}:/usr/bin:/bin", STUB_OUT=str(out), **(extra_env or {}))
    [c] = pod(job)["containers"]
    assert c["command"] == ["bash", "/ntp/k8s-launch.sh"]
    cmd = ["bash", str(d / "k8s-launch.sh"), str(stub), "--model-flag"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120, cwd=tmp)
    seen = {}
    for f in out.glob("rank-*.env"):
        kv = dict(line.split("=", 1) for line in f.read_text().splitlines())
        seen[int(kv["RANK"])] = kv
    return proc, seen


def test_wrapper_starts_the_ranks_of_its_node_bound_by_uuid(
    tmp_path: Path, h100_export: tuple[Path, dict[str, Any], Any]
) -> None:
    _, doc, _ = h100_export
    proc, seen = run_wrapper(tmp_path, doc, "dgx-h100-02")
    assert proc.returncode == 0, proc.stderr
    assert sorted(seen) == list(range(7))  # stage 0 of replica 0: local ranks 0..6
    uuids = xml_uuids(H100 / "nvidia-smi/dgx-h100-02.xml")
    devices = [0, 1, 2, 3, 4, 6, 7]  # the stage's GPUs by index; GPU 5 failed
    args = "--model-flag --tensor-model-parallel-size 8 --pipeline-model-parallel-size 2 "
    args += "--global-batch-size 32 --micro-batch-size 1 --use-tp-pp-dp-mapping"
    for rank, dev in zip(range(7), devices, strict=True):
        kv = seen[rank]
        assert kv["CUDA_VISIBLE_DEVICES"] == uuids[dev]
        assert kv["CUDA_DEVICE_ORDER"] == "<unset>"
        assert (kv["WORLD_SIZE"], kv["LOCAL_RANK"], kv["NTP_RANK_ACTIVE"]) == ("32", "0", "1")
        assert kv["MASTER_ADDR"] == "ntp-0-dgx-h100-02.ntp" and kv["MASTER_PORT"] == "29500"
        assert kv["ARGS"] == args
    assert "starting ranks 0 1 2 3 4 5 6 of world 32" in proc.stderr


def test_large_tables_are_split_over_configmaps(tmp_path: Path) -> None:
    inst = load_instance(ROOT / "instances/default.json")  # 4096 GPUs, 256 hosts
    plan = solve(inst, "megatron-ntp-reordered").plan
    spares = [f"spare-{i}" for i in range(32)]
    limit = 40_000  # k8s-ranks.tsv holds about 65 kB, ranks.txt about 190 kB
    ex = export_k8s(
        inst,
        plan,
        tmp_path / "x",
        K8sOptions(IMAGE, configmap_bytes=limit),
        placeholder_hosts=spares,
    )
    doc = json.loads(ex.files[K8S_NAME])
    assert manifest_errors(doc) == []
    cms = items(doc, "ConfigMap")
    names = [cm["metadata"]["name"] for cm in cms]
    assert len(names) >= 3
    for j in items(doc, "Job"):
        [vol] = [v for v in pod(j)["volumes"] if v["name"] == "ntp"]
        assert [s["configMap"]["name"] for s in vol["projected"]["sources"]] == names
    files: dict[str, str] = {}
    for cm in cms:
        assert sum(len(k) + len(v.encode()) for k, v in cm["data"].items()) <= limit
        assert not set(files) & set(cm["data"])
        files.update(cm["data"])
    parts = sorted((k for k in files if k.startswith("k8s-ranks.tsv.")), key=lambda k: int(k[14:]))
    assert len(parts) >= 2 and "k8s-ranks.tsv" not in files
    assert "".join(files[k] for k in parts) == ex.files["k8s-ranks.tsv"]
    last = ex.rows[-1]  # a host whose lines come from the last part
    proc, seen = run_wrapper(tmp_path, doc, last.host)
    assert proc.returncode == 0, proc.stderr
    assert sorted(seen) == [r.rank for r in ex.rows if r.host == last.host]
    assert {kv["WORLD_SIZE"] for kv in seen.values()} == {str(len(ex.rows))}
    with pytest.raises(MegatronError, match=r"k8s-launch\.sh needs"):
        export_k8s(
            inst,
            plan,
            tmp_path / "y",
            K8sOptions(IMAGE, configmap_bytes=2000),
            placeholder_hosts=spares,
        )
    assert not (tmp_path / "y").exists()


def test_wrapper_binds_by_index_without_uuids(tmp_path: Path) -> None:
    inst = h100()  # GPU 5 of dgx-h100-02 failed (its XML), but no UUIDs on that host
    for i in range(8):
        del inst.cluster.nodes[f"dgx-h100-02:gpu{i}"]["uuid"]
    ex = export_k8s(inst, PLAN, tmp_path / "x", OPTS, placeholder_hosts=SPARE)
    doc = json.loads(ex.files[K8S_NAME])
    assert manifest_errors(doc) == []
    proc, seen = run_wrapper(tmp_path, doc, "dgx-h100-02")
    assert proc.returncode == 0, proc.stderr
    # host devices 0-4, 6, 7 of a pod that holds the 7 healthy GPUs: indices 0..6 in it
    assert [seen[r]["CUDA_VISIBLE_DEVICES"] for r in range(7)] == [str(i) for i in range(7)]
    assert {seen[r]["CUDA_DEVICE_ORDER"] for r in range(7)} == {"PCI_BUS_ID"}


def test_wrapper_refuses_a_node_without_ranks(
    tmp_path: Path, h100_export: tuple[Path, dict[str, Any], Any]
) -> None:
    _, doc, _ = h100_export
    proc, seen = run_wrapper(tmp_path, doc, "dgx-h100-03")  # NotReady: all GPUs failed
    assert proc.returncode == 3 and seen == {}
    assert "node dgx-h100-03 runs no rank" in proc.stderr
    assert "wrong node" in proc.stderr


def test_wrapper_starts_placeholder_only_nodes(
    tmp_path: Path, h100_export: tuple[Path, dict[str, Any], Any]
) -> None:
    _, doc, ex = h100_export
    by_host: dict[str, list[Any]] = {}
    for r in ex.rows:
        by_host.setdefault(r.host, []).append(r)
    idle = next(
        h for h, rows in by_host.items() if h.startswith("dgx") and not any(r.active for r in rows)
    )
    proc, seen = run_wrapper(tmp_path, doc, idle)
    assert proc.returncode == 0, proc.stderr
    assert sorted(seen) == [r.rank for r in by_host[idle]]
    uuids = xml_uuids(H100 / f"nvidia-smi/{idle}.xml")
    for r in by_host[idle]:
        assert seen[r.rank]["NTP_RANK_ACTIVE"] == "0"
        assert seen[r.rank]["CUDA_VISIBLE_DEVICES"] == uuids[r.device]
    assert "(0 active, 1 placeholders)" in proc.stderr


def test_wrapper_fails_with_its_ranks(
    tmp_path: Path, h100_export: tuple[Path, dict[str, Any], Any]
) -> None:
    _, doc, _ = h100_export
    proc, seen = run_wrapper(tmp_path, doc, "dgx-h100-02", extra_env={"STUB_FAIL_RANK": "3"})
    assert proc.returncode == 7 and 3 in seen
    assert "a rank exited with status 7" in proc.stderr


def test_wrapper_stops_its_ranks_on_sigterm(
    tmp_path: Path, h100_export: tuple[Path, dict[str, Any], Any]
) -> None:
    """Deleting the pod sends SIGTERM to the wrapper: it stops every rank and exits 143."""
    _, doc, _ = h100_export
    [cm] = items(doc, "ConfigMap")
    d = tmp_path / "ntp"
    d.mkdir()
    for name, text in cm["data"].items():
        (d / name).write_text(text)
    stub = tmp_path / "sleeper.sh"
    stub.write_text('#!/bin/sh\necho $$ > "$STUB_OUT/pid-$RANK"\nexec sleep 600\n')
    stub.chmod(0o755)
    env = {"NTP_NODE_NAME": "dgx-h100-07", "MASTER_ADDR": "x", "NTP_DNS_WAIT": "0"}
    env.update(NTP_EXPORT_DIR=str(d), STUB_OUT=str(tmp_path), PATH="/usr/bin:/bin")
    proc = subprocess.Popen(
        ["bash", str(d / "k8s-launch.sh"), str(stub)], env=env, stderr=subprocess.PIPE, text=True
    )
    try:
        pid_files = [tmp_path / f"pid-{r}" for r in range(16, 24)]  # replica 1, stage 0
        started = False
        for _ in range(6000):  # until every rank has written its pid (hang guard: 6000 polls)
            if all(f.exists() and f.read_text().strip() for f in pid_files):
                started = True
                break
            proc.poll()
            assert proc.returncode is None, proc.stderr.read() if proc.stderr else ""
            subprocess.run(["sleep", "0.01"], check=True)
        assert started
        proc.terminate()
        assert proc.wait(timeout=120) == 143
    finally:
        if proc.poll() is None:
            proc.kill()
    for f in pid_files:
        with pytest.raises(ProcessLookupError):
            os.kill(int(f.read_text()), 0)


def test_wrapper_checks_the_pods_gpus(
    tmp_path: Path, h100_export: tuple[Path, dict[str, Any], Any]
) -> None:
    _, doc, _ = h100_export
    smi = "#!/bin/sh\necho GPU-00000000-0000-0000-0000-000000000000\n"
    proc, seen = run_wrapper(tmp_path, doc, "dgx-h100-02", nvidia_smi=smi)
    assert proc.returncode == 4 and seen == {}
    assert "is not among this pod's GPUs" in proc.stderr


def test_wrapper_reads_a_hostile_node_name_as_data(
    tmp_path: Path, h100_export: tuple[Path, dict[str, Any], Any]
) -> None:
    _, doc, _ = h100_export
    canary = tmp_path / "PWNED"
    node = f'x"; touch {canary}; $(touch {canary}) `touch {canary}`\ndgx-h100-02'
    proc, seen = run_wrapper(tmp_path, doc, node)
    assert proc.returncode == 3 and seen == {}
    assert not canary.exists()
    assert "runs no rank" in proc.stderr


# --- GB200 (Slurm fixture), names, hostile instances, the CLI ---------------------------------


def test_gb200_jobs_bind_by_uuid_where_the_xml_gives_it(tmp_path: Path) -> None:
    cluster = import_slurm(
        GB / "topology.yaml", GB / "nodes.txt", nvidia_smi=GB / "nvidia-smi", warn=quiet
    )
    inst = Instance("gb200", cluster, load_job(GB / "job.json"))
    plan = solve(inst, "megatron-ntp-reordered").plan
    spares = [f"gb-spare-{i}" for i in range(1, 5)]
    ex = export_k8s(inst, plan, tmp_path, OPTS, placeholder_hosts=spares, placeholder_gpus=4)
    doc = json.loads((tmp_path / K8S_NAME).read_text())
    assert manifest_errors(doc) == []
    jobs = items(doc, "Job")
    hosts = {r.host for r in ex.rows}
    assert sorted(pinned_node(j) for j in jobs) == sorted(hosts)
    table = [line.split("\t") for line in (tmp_path / "k8s-ranks.tsv").read_text().splitlines()]
    vis = {int(r[0]): r[2] for r in table if not r[0].startswith("#")}
    by_uuid = set()
    for r in ex.rows:
        xml = GB / f"nvidia-smi/{r.host}.xml"  # block b01 has XML files, b02 none
        if xml.exists() and r.gpu is not None:
            assert vis[r.rank] == xml_uuids(xml)[r.device]
            by_uuid.add(r.host)
        else:
            assert vis[r.rank].isdigit()
    assert len(by_uuid) >= 10
    # docs/import.md: gb-005, gb-012, gb-023 are out of service, gb-007 lost GPU 1 and
    # gb-015 GPU 3; a pod asks for every other GPU of its 4-GPU tray
    for j in jobs:
        n = pinned_node(j)
        assert n not in ("gb-005", "gb-012", "gb-023")
        gpus = pod(j)["containers"][0]["resources"]["limits"]["nvidia.com/gpu"]
        if n in spares:
            assert gpus == str(sum(r.host == n for r in ex.rows))
        else:
            assert gpus == ("3" if n in ("gb-007", "gb-015") else "4"), n
    assert "gb-015" in hosts  # the 3-GPU tray is used


def test_names_from_long_and_dotted_host_names(tmp_path: Path) -> None:
    inst = load_instance(ROOT / "instances/tiny.json")
    trays = sorted({inst.cluster.nodes[g].get("host") or t for g, t in _gpu_trays(inst)})
    long = "node-" + "a" * 70 + ".rack-7.example.com"
    rename = {trays[0]: long, trays[1]: "gpu.node.b"}
    for t, h in rename.items():
        inst.cluster.nodes[t]["host"] = h
    plan = solve(inst, "optimal-megatron").plan
    ex = export_k8s(inst, plan, tmp_path, OPTS, placeholder_hosts=["spare-1"])
    doc = json.loads(ex.files[K8S_NAME])
    assert manifest_errors(doc) == []
    nodes = [pinned_node(j) for j in items(doc, "Job")]
    assert sorted(nodes) == sorted({r.host for r in ex.rows})
    for j in items(doc, "Job"):
        name = j["metadata"]["name"]
        assert LABEL.match(name) and len(name) <= 63, name
        assert SUBDOMAIN.match(pinned_node(j))
    assert len({j["metadata"]["name"] for j in items(doc, "Job")}) == len(nodes)


def _gpu_trays(inst: Instance) -> list[tuple[Any, Any]]:
    a = inst.arrays
    return [(g, a.tray_ids[a.gpu_tray[i]]) for i, g in enumerate(a.gpu_ids)]


def _hostile_h100(tmp: Path, *, node: str | None = None, uuid: str | None = None) -> Path:
    """The H100 fixture with dgx-h100-06 renamed to ``node`` or dgx-h100-01's GPU 0 UUID set."""
    d = tmp / "fixture"
    (d / "nvidia-smi").mkdir(parents=True)
    nodes = (H100 / "nodes.json").read_text()
    if node is not None:
        nodes = nodes.replace('"dgx-h100-06"', json.dumps(node))
    (d / "nodes.json").write_text(nodes)
    for f in (H100 / "nvidia-smi").iterdir():
        text = f.read_text()
        if uuid is not None and f.name == "dgx-h100-01.xml":
            first = xml_uuids(f)[0]
            text = text.replace(first, uuid.replace("&", "&amp;").replace("<", "&lt;"))
        (d / "nvidia-smi" / f.name).write_text(text)
    return d


@pytest.mark.parametrize(
    ("node", "uuid", "rule"),
    [
        ('dgx"-06$(touch PWNED)', None, "megatron-ids"),
        ("dgx-06`touch PWNED`\n", None, "megatron-ids"),
        ("DGX_H100_06", None, "k8s-hosts"),
        ("dgx-06.", None, "k8s-hosts"),
        (None, "GPU-$(touch PWNED)", "megatron-uuids"),
        (None, "GPU-796c5264-a8d5-53d7-bffe-40012d2cc3b9\nrm -rf /", "megatron-uuids"),
    ],
)
def test_hostile_instances_are_refused_and_run_nothing(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    node: str | None,
    uuid: str | None,
    rule: str,
) -> None:
    d = _hostile_h100(tmp_path, node=node, uuid=uuid)
    graph = import_k8s(
        d / "nodes.json", nvidia_smi=d / "nvidia-smi", rack_label="example.com/rack", warn=quiet
    )
    inst = Instance("h100", graph, load_job(H100 / "job.json"))
    host6 = node or "dgx-h100-06"
    plan = Plan(
        "h100",
        (
            Replica(8, 16, (_stage("dgx-h100-01", range(8)), _stage(host6, range(8)))),
            Replica(8, 16, (_stage("dgx-h100-07", range(8)), _stage("dgx-h100-08", range(8)))),
        ),
        {},
    )
    save_instance(inst, tmp_path / "inst.json")
    save_plan(evaluated(inst, plan), tmp_path / "plan.json")
    monkeypatch.chdir(tmp_path)
    code = main(
        [
            "export",
            "--to",
            "k8s",
            "plan.json",
            "--instance",
            "inst.json",
            "-o",
            "out",
            "--image",
            IMAGE,
        ]
    )
    err = capsys.readouterr().err
    assert code == 2
    assert err.count("\n") == 1 and f": {rule}: " in err, err
    assert not (tmp_path / "out").exists()
    assert not list(tmp_path.rglob("PWNED"))


def test_cli_options(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    inst = h100()
    save_instance(inst, tmp_path / "inst.json")
    save_plan(evaluated(inst, PLAN), tmp_path / "plan.json")
    base = ["export", "--to", "k8s", str(tmp_path / "plan.json"), "--instance"]
    base += [str(tmp_path / "inst.json"), "-o", str(tmp_path / "out"), "--placeholder-hosts"]
    base += ["spare-01"]
    assert main(base) == 2
    assert capsys.readouterr().err == "ntp-opt: error: --image is required with --to k8s\n"
    assert main([*base, "--image", IMAGE, "--name", "Bad_Name"]) == 2
    assert "--name: 'Bad_Name' is not a DNS-1123 label" in capsys.readouterr().err
    assert main([*base, "--image", IMAGE, "--command", "python 'unclosed"]) == 2
    assert capsys.readouterr().err.startswith("ntp-opt: error: --command: ")
    assert not (tmp_path / "out").exists()
    cmd = "torchrun-free python /workspace/pretrain_gpt_ntp.py --micro-batch-size '1'"
    code = main(
        [*base, "--image", IMAGE, "--name", "llm", "--namespace", "train", "--command", cmd]
    )
    assert code == 0
    out = capsys.readouterr().out
    assert "kubectl apply -f" in out and "MASTER_ADDR=llm-0-dgx-h100-02.llm" in out
    assert "3 host(s) bound by GPU index, not UUID (dgx-h100-06, dgx-h100-07, dgx-h100-08)" in out
    doc = json.loads((tmp_path / "out" / K8S_NAME).read_text())
    assert manifest_errors(doc) == []
    assert {it["metadata"]["namespace"] for it in doc["items"]} == {"train"}
    [c] = pod(items(doc, "Job")[0])["containers"]
    assert c["args"] == [
        "torchrun-free",
        "python",
        "/workspace/pretrain_gpt_ntp.py",
        "--micro-batch-size",
        "1",
    ]


def test_megatron_export_is_unchanged_by_the_k8s_route(tmp_path: Path) -> None:
    ex = export_k8s(h100(), PLAN, tmp_path, OPTS, placeholder_hosts=SPARE)
    plain = megatron_export(h100(), PLAN, placeholder_hosts=SPARE)
    assert {k: ex.files[k] for k in plain.files} == plain.files
    assert set(ex.files) - set(plain.files) == {K8S_NAME, "k8s-ranks.tsv", "k8s-launch.sh"}
    for name in ex.files:
        assert (tmp_path / name).read_text() == ex.files[name]


def test_options_are_checked() -> None:
    with pytest.raises(ValueError, match="--image"):
        K8sOptions("")
    with pytest.raises(ValueError, match="--namespace"):
        K8sOptions(IMAGE, namespace="a/b")
    with pytest.raises(ValueError, match="--master-port"):
        K8sOptions(IMAGE, master_port=0)
    with pytest.raises(MegatronError):
        inst = h100()
        inst.cluster.nodes["dgx-h100-02:gpu0"]["uuid"] = "GPU-'; reboot"
        export_k8s(inst, PLAN, "/nonexistent/never-written", OPTS, placeholder_hosts=SPARE)
    assert os.path.exists("/nonexistent/never-written") is False
