"""Importers: Slurm hostlists, topology/block, scontrol, Kubernetes nodes, nvidia-smi XML, CLI.

Expected values are read off the fixture descriptions (tests/fixtures/import/make_fixtures.py)
by hand, never computed by the importer.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ntp_opt.app.cli import main
from ntp_opt.app.importers import expand, import_k8s, import_slurm, read_nodes, read_topology
from ntp_opt.app.importers.cli import load_job
from ntp_opt.app.importers.compose import PowerDefault
from ntp_opt.app.importers.hostlist import HostlistError
from ntp_opt.app.importers.slurm_nodes import classify_state, parse_gres
from ntp_opt.model.files import InputError, load_instance, load_plan
from ntp_opt.model.instance import Instance
from ntp_opt.model.plan import Plan, Replica, Stage
from ntp_opt.rules.validate import evaluate, validate

FIX = Path(__file__).parents[1] / "fixtures" / "import"
GB = FIX / "gb200-slurm"
H100 = FIX / "h100-k8s"
CLUSTER_A = "5cd30dc8-0f3b-4b8e-9a51-7d0e3c1a2b01"
GB_HOSTS = [f"gb-{i:03d}" for i in range(1, 37)]
H100_HOSTS = [f"dgx-h100-{k:02d}" for k in range(1, 9)]


def fixture_uuid(host: str, i: int) -> str:
    return f"GPU-{uuid.uuid5(uuid.NAMESPACE_DNS, f'{host}.gpu{i}')}"


def quiet(_msg: str) -> None:
    pass


def gpus_of(G: Any) -> dict[str, dict[str, Any]]:
    return {n: d for n, d in G.nodes(data=True) if d["kind"] == "gpu"}


def failed(G: Any) -> set[str]:
    return {n for n, d in gpus_of(G).items() if d["state"] == "failed"}


def kinds(G: Any, kind: str) -> list[str]:
    return [n for n, k in G.nodes(data="kind") if k == kind]


# --- hostlists ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("expr", "hosts"),
    [
        ("gb-[001-003]", ["gb-001", "gb-002", "gb-003"]),
        ("a[1-3,5],b7", ["a1", "a2", "a3", "a5", "b7"]),
        ("n[8-11]", ["n8", "n9", "n10", "n11"]),
        ("n[08-11]", ["n08", "n09", "n10", "n11"]),
        ("n[098-101]", ["n098", "n099", "n100", "n101"]),
        ("r[1-2]-n[01-02]", ["r1-n01", "r1-n02", "r2-n01", "r2-n02"]),
        ("single", ["single"]),
        ("x[7],y,z[0-1]", ["x7", "y", "z0", "z1"]),
        ("gb-[019-020,035-036]", ["gb-019", "gb-020", "gb-035", "gb-036"]),
        ("h[1-2]a", ["h1a", "h2a"]),
    ],
)
def test_hostlist_expands(expr: str, hosts: list[str]) -> None:
    assert expand(expr) == hosts


@pytest.mark.parametrize(
    ("expr", "msg"),
    [
        ("a[1-3", "unclosed"),
        ("a1-3]", "unmatched"),
        ("a[1[2]]", "nested"),
        ("a[]", "empty brackets"),
        ("a[3-1]", "backwards"),
        ("a[x]", "bad range"),
        ("a[1-]", "bad range"),
        ("a,,b", "stray comma"),
        ("", "empty hostlist"),
        ("a b", "whitespace"),
        ("n[0-9999999]", "more than"),
    ],
)
def test_hostlist_errors(expr: str, msg: str) -> None:
    with pytest.raises(HostlistError, match=msg):
        expand(expr)


# --- Slurm pieces ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("gres", "count", "kind"),
    [
        ("gpu:4(S:0-1)", 4, None),
        ("gpu:h100:8", 8, "h100"),
        ("gpu:8(S:0-1)", 8, None),
        ("gpu:gb200:4(S:0-1),nic:1", 4, "gb200"),
        ("nic:2,gpu:2", 2, None),
        ("gpu:a:4(S:0),gpu:a:4(S:1)", 8, "a"),
        ("gpu", 1, None),
        ("(null)", 0, None),
    ],
)
def test_gres(gres: str, count: int, kind: str | None) -> None:
    assert parse_gres(gres, "x:1") == (count, kind)


def test_gres_malformed() -> None:
    with pytest.raises(InputError, match="x:1: malformed Gres"):
        parse_gres("gpu::4", "x:1")


@pytest.mark.parametrize(
    ("state", "why"),
    [
        ("IDLE", None),
        ("MIXED", None),
        ("ALLOCATED+COMPLETING", None),
        ("IDLE+DRAIN", "DRAIN"),
        ("MIXED+DRAIN", "DRAIN"),
        ("DOWN+NOT_RESPONDING", "DOWN+NOT_RESPONDING"),
        ("IDLE*", "NOT_RESPONDING"),
        ("DOWN", "DOWN"),
        ("FAIL", "FAIL"),
        ("drained", "DRAINED"),
    ],
)
def test_slurm_states(state: str, why: str | None) -> None:
    v = classify_state(state)
    assert v.usable == (why is None)
    assert [w.split(":")[0] for w in v.why.split("; ") if w] == (why.split("+") if why else [])


def test_topology_yaml_and_conf_give_the_same_blocks() -> None:
    for path in (GB / "topology.yaml", GB / "topology.conf"):
        blocks = read_topology(path)
        assert [b.name for b in blocks] == ["b01", "b02"]
        assert blocks[0].hosts == GB_HOSTS[:18]
        assert blocks[1].hosts == GB_HOSTS[18:]
    assert read_topology(GB / "topology.conf")[1].where.endswith("topology.conf:3")


def test_topology_yaml_choice_of_block_topology(tmp_path: Path) -> None:
    p = tmp_path / "topology.yml"
    two = (
        '- topology: a\n  block:\n    blocks:\n      - block: x\n        nodes: ["n[1-2]", n5]\n'
        "- topology: b\n  block:\n    blocks:\n      - block: y\n        nodes: m[01-03]\n"
    )
    p.write_text(two)
    with pytest.raises(InputError, match="several block topologies \\(a, b\\) and none is"):
        read_topology(p)
    assert read_topology(p, topology_name="a")[0].hosts == ["n1", "n2", "n5"]
    assert read_topology(p, topology_name="b")[0].hosts == ["m01", "m02", "m03"]
    with pytest.raises(InputError, match="no block or tree topology named 'c'"):
        read_topology(p, topology_name="c")
    p.write_text(two.replace("- topology: b\n", "- topology: b\n  cluster_default: true\n"))
    assert [b.name for b in read_topology(p)] == ["y"]


def test_scontrol_multi_line_form(tmp_path: Path) -> None:
    p = tmp_path / "nodes.txt"
    p.write_text(
        "NodeName=h1 Arch=x86_64 CoresPerSocket=56\n"
        "   CPUAlloc=0 CPUEfctv=224 CPUTot=224 CPULoad=0.01\n"
        "   Gres=gpu:h100:8(S:0-1)\n"
        "   State=IDLE+DRAIN ThreadsPerCore=2 TmpDisk=0 Weight=1 Owner=N/A MCS_label=N/A\n"
        "   CurrentWatts=0 AveWatts=0\n"
        "   Reason=ECC errors on GPU 3 [root@2026-12-01T00:00:00]\n"
        "\n"
        "NodeName=h2 Arch=x86_64 CoresPerSocket=56\n"
        "   Gres=gpu:8\n"
        "   State=MIXED ThreadsPerCore=2\n"
    )
    nodes = read_nodes(p)
    assert [(n.name, n.gpus, n.gpu_type, n.state) for n in nodes] == [
        ("h1", 8, "h100", "IDLE+DRAIN"),
        ("h2", 8, None, "MIXED"),
    ]
    assert nodes[0].reason == "ECC errors on GPU 3 [root@2026-12-01T00:00:00]"
    assert nodes[1].where == f"{p}:8"


def test_scontrol_records() -> None:
    nodes = {n.name: n for n in read_nodes(GB / "nodes.txt")}
    assert len(nodes) == 37
    assert nodes["login01"].gpus == 0
    n12 = nodes["gb-012"]
    assert (n12.gpus, n12.state) == (4, "IDLE+DRAIN")
    # Reason is free text: "Xid=79" in it is not a field of its own
    assert n12.reason == "GPU 2 Xid=79 fell off the bus [root@2026-12-01T03:12:44]"
    assert nodes["gb-019"].gpu_type == "gb200"
    assert nodes["gb-001"].gpu_type is None
    assert nodes["gb-005"].where.endswith("nodes.txt:5")


# --- Slurm import ---------------------------------------------------------------


def test_slurm_gb200_with_nvidia_smi() -> None:
    warnings: list[str] = []
    G = import_slurm(
        GB / "topology.yaml",
        GB / "nodes.txt",
        nvidia_smi=GB / "nvidia-smi",
        warn=warnings.append,
    )
    gpus = gpus_of(G)
    assert len(gpus) == 144
    assert kinds(G, "tray") == GB_HOSTS
    assert {d: G.nodes[d]["size"] for d in kinds(G, "domain")} == {"b01": 72, "b02": 72}
    assert sorted(kinds(G, "rack")) == ["b01/rack", "b02/rack"]
    dead = {f"{h}:gpu{i}" for h in ("gb-005", "gb-012", "gb-023") for i in range(4)}
    assert failed(G) == dead | {"gb-007:gpu1", "gb-015:gpu3"}
    g = gpus["gb-001:gpu0"]
    assert (g["tdp_w"], g["max_power_w"], g["host"], g["index"]) == (1000.0, 1200.0, "gb-001", 0)
    assert g["uuid"] == fixture_uuid("gb-001", 0)
    # down host without XML: the hardware table for its Gres type gb200
    assert (gpus["gb-005:gpu2"]["tdp_w"], gpus["gb-005:gpu2"]["max_power_w"]) == (1200.0, 1200.0)
    # GPU missing from the XML: failed, limits of its siblings, no UUID
    assert (gpus["gb-015:gpu3"]["tdp_w"], gpus["gb-015:gpu3"]["max_power_w"]) == (1000.0, 1200.0)
    assert "uuid" not in gpus["gb-015:gpu3"]
    assert "uuid" not in gpus["gb-019:gpu0"]
    assert (gpus["gb-036:gpu3"]["tdp_w"], gpus["gb-036:gpu3"]["max_power_w"]) == (1200.0, 1200.0)
    assert G.nodes["b01/rack"]["power_budget_w"] == 17 * 4 * 1000 + 4 * 1200
    assert G.nodes["b02/rack"]["power_budget_w"] == 72 * 1200
    assert G.graph["power_budget_w"] == 17 * 4 * 1000 + 4 * 1200 + 72 * 1200
    assert G.nodes["gb-007"]["host"] == "gb-007"
    assert G.has_edge("gb-007", "b01") and G.has_edge("gb-007", "b01/rack")
    assert any("gb-012 is drained for a GPU reason" in w for w in warnings)
    assert not any("gb-023 is drained for a GPU reason" in w for w in warnings)


def test_slurm_without_nvidia_smi_and_conf_form() -> None:
    # "gpu:4" names no product and block b01 has no XML: its power is not known, refused
    with pytest.raises(
        InputError, match=r"nodes\.txt:1: host gb-001: the power of its GPUs is not"
    ):
        import_slurm(GB / "topology.conf", GB / "nodes.txt", warn=quiet)
    warnings: list[str] = []
    power = PowerDefault(1100.0, 1150.0)
    G = import_slurm(GB / "topology.conf", GB / "nodes.txt", warn=warnings.append, power=power)
    dead = {f"{h}:gpu{i}" for h in ("gb-005", "gb-012", "gb-023") for i in range(4)}
    assert failed(G) == dead
    gpus = gpus_of(G)
    # --tdp-w / --max-power-w for the 17 hosts of unknown product, the table for gb200 ones
    assert (gpus["gb-001:gpu0"]["tdp_w"], gpus["gb-001:gpu0"]["max_power_w"]) == (1100.0, 1150.0)
    assert (gpus["gb-005:gpu0"]["tdp_w"], gpus["gb-005:gpu0"]["max_power_w"]) == (1200.0, 1200.0)
    assert sum("--tdp-w 1100 W applies to the GPUs of 17 host(s)" in w for w in warnings) == 1
    assert (gpus["gb-020:gpu1"]["tdp_w"], gpus["gb-020:gpu1"]["max_power_w"]) == (1200.0, 1200.0)
    Y = import_slurm(GB / "topology.yaml", GB / "nodes.txt", warn=quiet, power=power)
    assert list(G.nodes(data=True)) == list(Y.nodes(data=True))
    assert set(G.edges) == set(Y.edges)


def test_nvidia_smi_by_node_hostname_and_hosts_outside_the_topology(gb: Path) -> None:
    d = gb
    text = (d / "nodes.txt").read_text()
    (d / "nodes.txt").write_text(text.replace("NodeHostName=gb-002 ", "NodeHostName=gb-002.lan "))
    smi = d / "nvidia-smi"
    (smi / "gb-002.xml").rename(smi / "gb-002.lan.xml")
    _xml_as(GB / "nvidia-smi" / "gb-003.xml", smi / "login01.xml", tag="L")
    warnings: list[str] = []
    G = import_slurm(d / "topology.conf", d / "nodes.txt", nvidia_smi=smi, warn=warnings.append)
    assert gpus_of(G)["gb-002:gpu3"]["uuid"] == fixture_uuid("gb-002", 3)
    assert "login01" not in G
    assert any("skipped 1 file(s)" in w and "login01.xml" in w for w in warnings)


# --- Kubernetes import ----------------------------------------------------------


def test_k8s_h100_with_nvidia_smi() -> None:
    warnings: list[str] = []
    G = import_k8s(
        H100 / "nodes.json",
        nvidia_smi=H100 / "nvidia-smi",
        rack_label="example.com/rack",
        warn=warnings.append,
    )
    assert kinds(G, "tray") == H100_HOSTS
    assert {d: G.nodes[d]["size"] for d in kinds(G, "domain")} == {
        f"{h}/nvlink": 8 for h in H100_HOSTS
    }
    assert sorted(kinds(G, "rack")) == ["r1", "r2"]
    dead = {f"dgx-h100-{k:02d}:gpu{i}" for k in (3, 4, 5) for i in range(8)}
    assert failed(G) == dead | {"dgx-h100-02:gpu5"}
    assert {(d["tdp_w"], d["max_power_w"]) for d in gpus_of(G).values()} == {(700.0, 700.0)}
    assert gpus_of(G)["dgx-h100-02:gpu7"]["uuid"] == fixture_uuid("dgx-h100-02", 7)
    assert G.nodes["r1"]["power_budget_w"] == 32 * 700
    assert any("7 of 8 GPUs allocatable" in w for w in warnings)


def test_k8s_zone_is_never_the_default_rack_and_taints_can_be_tolerated() -> None:
    warnings: list[str] = []
    G = import_k8s(H100 / "nodes.json", warn=warnings.append)
    # no rack label: one rack per NVLink domain (here per node), never the zone
    assert kinds(G, "rack") == [f"{h}/nvlink/rack" for h in H100_HOSTS]
    assert G.nodes["dgx-h100-01/nvlink/rack"]["power_budget_w"] == 8 * 700
    assert any("topology.kubernetes.io/zone is not taken as a rack" in w for w in warnings)
    assert len(failed(G)) == 24
    T = import_k8s(
        H100 / "nodes.json", tolerate=("nvidia.com/gpu", "nvidia.com/gpu-health"), warn=quiet
    )
    assert {n.split(":")[0] for n in failed(T)} == {"dgx-h100-03", "dgx-h100-05"}
    # without the default toleration every GPU node is tainted
    N = import_k8s(H100 / "nodes.json", tolerate=(), warn=quiet)
    assert len(failed(N)) == 64


def _gb200_k8s(tmp: Path, cliques: dict[str, str]) -> Path:
    items = []
    for name, clique in cliques.items():
        labels = {
            "nvidia.com/gpu.count": "4",
            "nvidia.com/gpu.product": "NVIDIA-GB200",
            "nvidia.com/gpu.clique": clique,
        }
        items.append(
            {
                "kind": "Node",
                "metadata": {"name": name, "labels": labels},
                "spec": {},
                "status": {
                    "capacity": {"nvidia.com/gpu": "4"},
                    "conditions": [{"type": "Ready", "status": "True"}],
                },
            }
        )
    p = tmp / "nodes.json"
    p.write_text(json.dumps({"kind": "NodeList", "items": items}))
    return p


def _xml_as(src: Path, dst: Path, *, clique: str | None = None, tag: str = "") -> None:
    text = src.read_text()
    if clique is not None:
        cu, ci = clique.rsplit(".", 1)
        text = re.sub(r"<cliqueId>\d+</cliqueId>", f"<cliqueId>{ci}</cliqueId>", text)
        text = text.replace(CLUSTER_A, cu)
    if tag:
        text = text.replace("<uuid>GPU-", f"<uuid>GPU-{tag}")
    dst.write_text(text)


def test_k8s_gb200_cliques_are_domains(tmp_path: Path) -> None:
    c1, c2 = f"{CLUSTER_A}.1", f"{CLUSTER_A}.2"
    nodes = _gb200_k8s(tmp_path, {"gb-a1": c1, "gb-a2": c1, "gb-a3": c2, "gb-a4": c2})
    smi = tmp_path / "smi"
    smi.mkdir()
    _xml_as(GB / "nvidia-smi" / "gb-001.xml", smi / "gb-a1.xml", clique=c1, tag="a1")
    _xml_as(GB / "nvidia-smi" / "gb-002.xml", smi / "gb-a3.xml", clique=c2, tag="a3")
    G = import_k8s(nodes, nvidia_smi=smi, warn=quiet)
    assert {d: G.nodes[d]["size"] for d in kinds(G, "domain")} == {c1: 8, c2: 8}
    assert G.has_edge("gb-a2", c1) and G.has_edge("gb-a3", c2)
    gpus = gpus_of(G)
    assert (gpus["gb-a1:gpu0"]["tdp_w"], gpus["gb-a1:gpu0"]["max_power_w"]) == (1000.0, 1200.0)
    assert (gpus["gb-a2:gpu0"]["tdp_w"], gpus["gb-a2:gpu0"]["max_power_w"]) == (1200.0, 1200.0)
    # an XML whose fabric clique is not the node's clique label
    _xml_as(GB / "nvidia-smi" / "gb-002.xml", smi / "gb-a3.xml", clique=c1, tag="a3")
    with pytest.raises(InputError, match=r"gb-a3\.xml: /nvidia_smi_log/gpu\[1\]: fabric clique"):
        import_k8s(nodes, nvidia_smi=smi, warn=quiet)


# --- CLI end to end -------------------------------------------------------------


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    rc = main(argv)
    out = capsys.readouterr()
    return rc, out.out, out.err


def slurm_argv(out: Path, **kw: str) -> list[str]:
    args = {
        "--topology": str(GB / "topology.yaml"),
        "--nodes": str(GB / "nodes.txt"),
        "--nvidia-smi": str(GB / "nvidia-smi"),
        "--job": str(GB / "job.json"),
    }
    args.update(kw)
    argv = ["import", "slurm"]
    for k, v in args.items():
        if v:
            argv += [k, v]
    return [*argv, "-o", str(out)]


def k8s_argv(out: Path, **kw: str) -> list[str]:
    args = {
        "--nodes": str(H100 / "nodes.json"),
        "--nvidia-smi": str(H100 / "nvidia-smi"),
        "--rack-label": "example.com/rack",
        "--job": str(H100 / "job.json"),
    }
    args.update(kw)
    argv = ["import", "k8s"]
    for k, v in args.items():
        if v:
            argv += [k, v]
    return [*argv, "-o", str(out)]


def _strings(data: Any) -> list[str]:
    if isinstance(data, str):
        return [data]
    if isinstance(data, dict):
        return [s for k, v in data.items() for s in (*_strings(k), *_strings(v))]
    if isinstance(data, list):
        return [s for v in data for s in _strings(v)]
    return []


@pytest.mark.parametrize(
    ("kind", "hosts", "domains"),
    [
        ("slurm", GB_HOSTS, {"b01", "b02"}),
        ("k8s", H100_HOSTS, {f"{h}/nvlink" for h in H100_HOSTS}),
    ],
)
def test_cli_import_solve_export_round_trip(
    kind: str,
    hosts: list[str],
    domains: set[str],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    inst = tmp_path / "cluster.json"
    argv = slurm_argv(inst) if kind == "slurm" else k8s_argv(inst)
    rc, out, err = run(argv, capsys)
    assert rc == 0, err
    assert "ntp-opt: warning:" in err
    gpus = 144 if kind == "slurm" else 64
    assert f"{gpus} GPUs" in out
    assert load_instance(inst).summary()["gpus"] == gpus
    plan = tmp_path / "plan.json"
    rc, _, err = run(["solve", str(inst), "--policy", "ntp", "-o", str(plan)], capsys)
    assert rc == 0, err
    rc, out, err = run(["validate", str(inst), str(plan)], capsys)
    assert rc == 0 and "valid plan" in out, err
    exp = tmp_path / "export"
    argv = ["export", str(plan), "--to", "megatron-ntp", "--reorder", "--instance", str(inst)]
    # Megatron runs one local batch, and its inactive ranks need hosts of their
    # own: the operator names them (they are sources too).
    spare = ["ph-1", "ph-2", "ph-3", "ph-4"]
    argv += ["--equal-batch", "--placeholder-hosts", ",".join(spare)]
    rc, _, err = run([*argv, "-o", str(exp)], capsys)
    assert rc == 0, err
    # Every node the plan and the launch files name is one the sources named.
    allowed_gpu = re.compile(r"^(?P<h>[^:]+):gpu(?P<i>\d+)$")
    p = load_plan(plan)
    for r in p.replicas:
        for s in r.stages:
            assert s.domain in domains
            for g in s.gpus:
                m = allowed_gpu.match(str(g))
                assert m and m["h"] in hosts and int(m["i"]) < (4 if kind == "slurm" else 8)
    rows = [
        line.split() for line in (exp / "ranks.txt").read_text().splitlines() if line[:1] != "#"
    ]
    assert rows
    for row in rows:  # rank host device gpu domain ...
        host, gpu, domain = row[1], row[3], row[4]
        if gpu == "-":  # an inactive rank on an operator-named host
            assert host in spare and domain == "-"
        else:
            assert host in hosts and gpu.split(":")[0] == host and domain in domains
    names = re.compile(r"gb-\d+|dgx-h100-\d+|login01|cp-1|ph-\d+")
    text = "".join(f.read_text() for f in sorted(exp.iterdir()) if f.name != "LAUNCH.md")
    assert set(names.findall(text)) <= set(hosts) | set(spare)
    for s in _strings(json.loads((exp / "ntp-opt-extras.json").read_text())):
        for token in names.findall(s):
            assert token in hosts


def test_cli_k8s_counts_failed_gpus(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = run(k8s_argv(tmp_path / "h.json"), capsys)
    assert rc == 0
    assert "64 GPUs (25 failed) on 8 hosts, 8 NVLink domains, 2 racks" in out


# --- bad input ------------------------------------------------------------------


@pytest.fixture
def gb(tmp_path: Path) -> Path:
    """A writable copy of the GB200 fixture folder."""
    d = tmp_path / "gb"
    shutil.copytree(GB, d)
    return d


@pytest.fixture
def out(tmp_path: Path) -> Path:
    """The output file of a failing import (must stay as it was)."""
    return tmp_path / "out.json"


def _bad_topology(
    gb: Path, name: str, text: str, out: Path, pattern: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Write ``text`` as the topology file ``name`` and check the import fails with ``pattern``."""
    (gb / name).write_text(text)
    _bad(slurm_argv(out, **{"--topology": str(gb / name)}), out, pattern, capsys)


def _bad(argv: list[str], out: Path, pattern: str, capsys: pytest.CaptureFixture[str]) -> None:
    out.write_text("previous contents\n")
    rc, _, err = run(argv, capsys)
    assert rc == 2
    lines = err.strip().splitlines()
    assert lines[-1].startswith("ntp-opt: error: "), err
    assert re.search(pattern, lines[-1]), lines[-1]
    assert "Traceback" not in err
    assert out.read_text() == "previous contents\n"  # nothing half-written
    assert [p.name for p in out.parent.iterdir() if p.name.startswith(out.name + ".")] == []


CONF_CASES = [
    (
        "BlockName=b01 Nodes=gb-[001-018]\nBlockName=b02 Nodes=gb-[019-036]\n"
        "BlockName=b03 Nodes=gb-[037-038]\n",
        r"topology\.conf:3: unknown host gb-037 in block 'b03'",
    ),
    (
        "BlockName=b01 Nodes=gb-[001-018]\n# b02 overlaps\nBlockName=b02 Nodes=gb-[018-036]\n",
        r"topology\.conf:3: host gb-018 of block 'b02' is also in block 'b01'",
    ),
    (
        "BlockName=b01 Nodes=gb-[001-018],gb-003\n",
        r"topology\.conf:1: host gb-003 is listed twice in block 'b01'",
    ),
    (
        "BlockName=b01 Nodes=gb-[001-018] \\\n   # the rest\nBlockName=b02 Nodes=login01\n",
        r"nodes\.txt:37: host login01 of block 'b02' has no GPU",
    ),
    (
        "BlockName=b01 Nodes=gb-[001-018]\nBlockName=b02\n",
        r"topology\.conf:2: block 'b02' is empty",
    ),
    (
        "BlockName=b01 Nodes=gb-[001-018\n",
        r"topology\.conf:1: bad hostlist: unclosed '\['",
    ),
    (
        "BlockName=b01 Nodes=gb-[001-018]\nBlockName=b01 Nodes=gb-[019-036]\n",
        r"topology\.conf:2: block 'b01' defined twice",
    ),
    (
        "SwitchName=s0 Nodes=gb-[001-036]\n",
        r"topology\.conf:1: topology/tree says nothing about NVLink, and host gb-001 has 4 GPUs",
    ),
    (
        "BlockName=b01 Nodes=gb-[001-018] Speed=7\n",
        r"topology\.conf:1: unknown parameter\(s\) on a block line: speed",
    ),
]


@pytest.mark.parametrize(("conf", "pattern"), CONF_CASES)
def test_bad_topology_conf(
    conf: str, pattern: str, gb: Path, out: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _bad_topology(gb, "topology.conf", conf, out, pattern, capsys)


YAML_CASES = [
    (
        "- topology: t\n  block:\n    blocks:\n      - block: b01\n        nodes: gb-[001-018]\n"
        "      - block: b02\n",
        r"topology\.yaml:6: block 'b02' is empty",
    ),
    ("- topology: t\n  block: [\n", r"topology\.yaml:\d+: malformed YAML"),
    ("- topology: t\n  tree:\n    switches: []\n", r"topology\.yaml:3: tree: no switch"),
    ("- topology: t\n  flat: true\n", r"topology\.yaml:1: no topology with a 'block' or 'tree'"),
    (
        "- topology: t\n  block:\n    blocks:\n      - block: b01\n        nodes: gb-[001-0x8]\n",
        r"topology\.yaml:5: bad hostlist",
    ),
]


@pytest.mark.parametrize(("text", "pattern"), YAML_CASES)
def test_bad_topology_yaml(
    text: str, pattern: str, gb: Path, out: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _bad_topology(gb, "topology.yaml", text, out, pattern, capsys)


def test_bad_scontrol_lines(gb: Path, out: Path, capsys: pytest.CaptureFixture[str]) -> None:
    d = gb
    lines = (GB / "nodes.txt").read_text().splitlines()
    (d / "nodes.txt").write_text("\n".join([*lines[:3], "garbage here", *lines[3:]]) + "\n")
    _bad(
        slurm_argv(out, **{"--nodes": str(d / "nodes.txt")}),
        out,
        r"nodes\.txt:4: expected a NodeName",
        capsys,
    )
    (d / "nodes.txt").write_text("\n".join([*lines, lines[6]]) + "\n")
    _bad(
        slurm_argv(out, **{"--nodes": str(d / "nodes.txt")}),
        out,
        r"nodes\.txt:38: node gb-007 listed twice \(first at .*nodes\.txt:7\)",
        capsys,
    )
    (d / "nodes.txt").write_text("\n".join(lines[1:]) + "\n")  # gb-001 unknown to Slurm
    _bad(
        slurm_argv(out, **{"--nodes": str(d / "nodes.txt")}),
        out,
        r"topology\.yaml:\d+: unknown host gb-001 in block 'b01'",
        capsys,
    )


def test_bad_nvidia_smi(gb: Path, out: Path, capsys: pytest.CaptureFixture[str]) -> None:
    smi = gb / "nvidia-smi"
    argv = slurm_argv(out, **{"--nvidia-smi": str(smi)})
    # XML from another host: gb-001's file copied as gb-002's
    shutil.copy(smi / "gb-001.xml", smi / "gb-002.xml")
    _bad(
        argv,
        out,
        r"gb-002\.xml: /nvidia_smi_log/gpu\[1\]/uuid: GPU GPU-.* is also in .*gb-001\.xml",
        capsys,
    )
    # more GPUs than the scheduler counts
    text = (GB / "nvidia-smi" / "gb-002.xml").read_text()
    first = text[text.index("\t<gpu ") : text.index("\t</gpu>") + 7]
    fifth = first.replace("<minor_number>0<", "<minor_number>4<").replace(
        "<uuid>GPU-", "<uuid>GPU-5"
    )
    (smi / "gb-002.xml").write_text(text.replace("</nvidia_smi_log>", fifth + "</nvidia_smi_log>"))
    _bad(argv, out, r"gb-002\.xml: lists 5 GPUs but the scheduler counts 4 on host gb-002", capsys)
    shutil.copy(GB / "nvidia-smi" / "gb-002.xml", smi / "gb-002.xml")
    # a file for a host the scheduler does not know
    _xml_as(GB / "nvidia-smi" / "gb-003.xml", smi / "gb-999.xml", tag="9")
    _bad(argv, out, r"gb-999\.xml: file for unknown host 'gb-999'", capsys)
    (smi / "gb-999.xml").unlink()
    # a block-b02 host whose fabric clique is b01's
    _xml_as(GB / "nvidia-smi" / "gb-003.xml", smi / "gb-019.xml", tag="19")
    _bad(
        argv,
        out,
        r"gb-019\.xml: /nvidia_smi_log/gpu\[1\]: fabric clique .* also the clique of host gb-001",
        capsys,
    )
    (smi / "gb-019.xml").unlink()
    # two cliques in one block
    _xml_as(GB / "nvidia-smi" / "gb-003.xml", smi / "gb-003.xml", clique=f"{CLUSTER_A}.7")
    _bad(
        argv, out, r"gb-003\.xml: .*fabric clique .*\.7 of host gb-003 differs from clique", capsys
    )
    shutil.copy(GB / "nvidia-smi" / "gb-003.xml", smi / "gb-003.xml")
    # malformed values and files
    (smi / "gb-004.xml").write_text(
        text.replace("<max_power_limit>1200.00 W", "<max_power_limit>lots")
    )
    _bad(
        argv,
        out,
        r"gb-004\.xml: /nvidia_smi_log/gpu\[1\]/gpu_power_readings/max_power_limit: "
        "expected a power",
        capsys,
    )
    (smi / "gb-004.xml").write_text(
        text.replace("<max_power_limit>1200.00 W", "<max_power_limit>900.00 W")
    )
    _bad(argv, out, r"gb-004\.xml: .*max_power_limit: max power limit 900 W is below", capsys)
    (smi / "gb-004.xml").write_text(text[:500])
    _bad(argv, out, r"gb-004\.xml: malformed XML", capsys)
    (smi / "gb-004.xml").write_text(
        '<?xml version="1.0"?><!DOCTYPE x [<!ENTITY a "aaaa">]><nvidia_smi_log>&a;</nvidia_smi_log>'
    )
    _bad(argv, out, r"gb-004\.xml: refused XML construct", capsys)
    (smi / "gb-004.xml").write_text("<other/>")
    _bad(argv, out, r"gb-004\.xml: root element is <other>", capsys)


def _nodes_json(tmp: Path, edit: Any) -> Path:
    data = json.loads((H100 / "nodes.json").read_text())
    edit(data)
    p = tmp / "nodes.json"
    p.write_text(json.dumps(data))
    return p


def test_bad_k8s(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out.json"

    def bad(edit: Any, pattern: str, **kw: str) -> None:
        p = _nodes_json(tmp_path, edit)
        _bad(k8s_argv(out, **{"--nodes": str(p), **kw}), out, pattern, capsys)

    def count(d: Any) -> None:
        d["items"][2]["status"]["capacity"]["nvidia.com/gpu"] = "4"

    bad(
        count,
        r'nodes\.json: items\[2\]\.status\.capacity\["nvidia\.com/gpu"\]: node dgx-h100-02: 4 GPUs',
    )

    def clique(d: Any) -> None:
        d["items"][1]["metadata"]["labels"]["nvidia.com/gpu.clique"] = "no-dot"

    bad(clique, r'items\[1\]\.metadata\.labels\["nvidia\.com/gpu\.clique"\]: expected')

    def dup(d: Any) -> None:
        d["items"].append(d["items"][1])

    bad(dup, r"nodes\.json: items\[9\]: node dgx-h100-01 listed twice")

    def norack(d: Any) -> None:
        del d["items"][7]["metadata"]["labels"]["example.com/rack"]

    bad(
        norack, r'items\[7\]\.metadata\.labels\["example\.com/rack"\]: node dgx-h100-07 has no rack'
    )

    def clash(d: Any) -> None:
        d["items"][8]["metadata"]["labels"]["example.com/rack"] = "dgx-h100-01"

    bad(clash, r"items\[8\]: name 'dgx-h100-01' is used both as a rack and as a tray")
    p = tmp_path / "broken.json"
    p.write_text('{"items": [')
    _bad(
        k8s_argv(out, **{"--nodes": str(p)}), out, r"broken\.json: malformed JSON at line 1", capsys
    )


def test_bad_job(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out.json"
    job = tmp_path / "job.json"
    job.write_text(json.dumps({"tp": 0, "pp": 1, "dp": 1, "global_batch": 8}))
    _bad(
        k8s_argv(out, **{"--job": str(job)}), out, r"job\.json: tp: Input should be greater", capsys
    )
    job.write_text(json.dumps({"tp": 16, "pp": 1, "dp": 1, "global_batch": 8}))
    _bad(
        k8s_argv(out, **{"--job": str(job)}),
        out,
        r"job\.tp=16 is larger than 8 NVLink domain",
        capsys,
    )


# --- power limits the boards accept (docs/model.md, v1.1) -----------------------


def _solve_all(inst: Path, policies: list[str], tmp: Path, capsys: Any) -> dict[str, Any]:
    plans = {}
    for policy in policies:
        out = tmp / f"{policy}.json"
        rc, _, err = run(["solve", str(inst), "--policy", policy, "-o", str(out)], capsys)
        assert rc == 0, err
        rc, _, err = run(["validate", str(inst), str(out)], capsys)
        assert rc == 0, err
        plans[policy] = load_plan(out)
    return plans


def test_h100_import_is_never_boosted(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # dp 5 of TP8 on 4 whole nodes and dgx-h100-02 (7 healthy GPUs): one replica runs at TP7,
    # which ntp-pw would boost if the boards allowed it (H100 SXM: max limit = 700 W = nominal)
    job = tmp_path / "job.json"
    job.write_text(json.dumps({"tp": 8, "pp": 1, "dp": 5, "global_batch": 40}))
    inst = tmp_path / "h100.json"
    rc, _, err = run(k8s_argv(inst, **{"--job": str(job)}), capsys)
    assert rc == 0, err
    plans = _solve_all(inst, ["ntp-pw", "fast"], tmp_path, capsys)
    for policy, plan in plans.items():
        assert any(r.tp == 7 for r in plan.replicas), policy
        powers = {s.power for r in plan.replicas for s in r.stages}
        assert powers == {1.0}, (policy, powers)


def test_gb200_boost_stays_within_each_board(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    inst = tmp_path / "gb200.json"
    rc, _, err = run(slurm_argv(inst), capsys)
    assert rc == 0, err
    gpus = {
        n["id"]: n for n in json.loads(inst.read_text())["cluster"]["nodes"] if n["kind"] == "gpu"
    }
    # ntp-pw and fast leave the boards at 1.0 here (a boost would gain nothing, issue
    # 32); optimal boosts b01 stages to reach 0.9901
    plans = _solve_all(inst, ["ntp-pw", "fast", "optimal"], tmp_path, capsys)
    boosted = 0
    for policy, plan in plans.items():
        for r in plan.replicas:
            for s in r.stages:
                for g in s.gpus:
                    # b01 boards: 1000 W running limit, 1200 W max; b02 boards: 1200 W / 1200 W
                    limit = 1.2 if str(g) < "gb-019" else 1.0
                    assert s.power <= limit + 1e-9, (policy, g, s.power)
                    assert s.power * gpus[g]["tdp_w"] <= gpus[g]["max_power_w"] + 1e-6
                boosted += s.power > 1.0
    assert boosted > 0  # the headroom of block b01 is used


# --- properties -----------------------------------------------------------------


def _compress(prefix: str, numbers: list[int], width: int) -> str:
    """A hostlist expression for ``prefix`` + numbers (a writer independent of the parser)."""
    runs: list[tuple[int, int]] = []
    for n in numbers:
        if runs and n == runs[-1][1] + 1:
            runs[-1] = (runs[-1][0], n)
        else:
            runs.append((n, n))
    parts = [
        str(lo).zfill(width) if lo == hi else f"{str(lo).zfill(width)}-{str(hi).zfill(width)}"
        for lo, hi in runs
    ]
    return f"{prefix}[{','.join(parts)}]"


@given(
    prefix=st.text(alphabet="abgnxz-", min_size=1, max_size=4),
    numbers=st.lists(st.integers(0, 300), min_size=1, max_size=30, unique=True).map(sorted),
    width=st.integers(1, 4),
    extra=st.lists(st.text(alphabet="abc", min_size=1, max_size=3), max_size=3),
)
def test_hostlist_round_trip(prefix: str, numbers: list[int], width: int, extra: list[str]) -> None:
    expr = ",".join([_compress(prefix, numbers, width), *extra])
    assert expand(expr) == [prefix + str(n).zfill(width) for n in numbers] + extra


_STATES = ["IDLE", "ALLOCATED", "MIXED", "IDLE+DRAIN", "DOWN", "MIXED+DRAIN", "DOWN*", "IDLE+FAIL"]


@settings(max_examples=8, deadline=None)
@given(
    blocks=st.lists(st.integers(2, 5), min_size=1, max_size=3),
    prefix=st.sampled_from(["gb-", "nvl", "node"]),
    states=st.lists(st.sampled_from(_STATES), min_size=15, max_size=15),
)
def test_slurm_round_trip_names_only_source_hosts(
    blocks: list[int], prefix: str, states: list[str], tmp_path_factory: Any
) -> None:
    tmp = tmp_path_factory.mktemp("rt")
    hosts: list[list[str]] = []
    k = 1
    for size in blocks:
        hosts.append([f"{prefix}{k + j:03d}" for j in range(size)])
        k += size + 1  # gaps between blocks: names the sources never mention
    flat = [h for b in hosts for h in b]
    state = {h: ("IDLE" if i < 2 else states[i % len(states)]) for i, h in enumerate(flat)}
    (tmp / "topology.conf").write_text(
        "".join(
            f"BlockName=blk{i} Nodes={_compress(prefix, [int(h[-3:]) for h in b], 3)}\n"
            for i, b in enumerate(hosts)
        )
    )
    (tmp / "nodes.txt").write_text(
        "".join(f"NodeName={h} Gres=gpu:gb200:4 State={state[h]} Reason=x\n" for h in flat)
    )
    (tmp / "job.json").write_text(json.dumps({"tp": 4, "pp": 1, "dp": 2, "global_batch": 8}))
    inst, plan, exp = tmp / "i.json", tmp / "p.json", tmp / "x"
    argv = ["import", "slurm", "--topology", str(tmp / "topology.conf")]
    argv += ["--nodes", str(tmp / "nodes.txt"), "--job", str(tmp / "job.json"), "-o", str(inst)]
    assert main(argv) == 0
    assert main(["solve", str(inst), "--policy", "ntp", "-o", str(plan)]) == 0
    xargv = ["export", str(plan), "--to", "megatron-ntp", "--reorder", "--instance", str(inst)]
    xargv += ["--equal-batch", "--placeholder-hosts", "spare-a,spare-b"]
    assert main([*xargv, "-o", str(exp)]) == 0
    written = [plan, *(f for f in sorted(exp.iterdir()) if f.name != "LAUNCH.md")]
    text = "".join(p.read_text() for p in written)
    mentioned = set(re.findall(rf"{re.escape(prefix)}\d+", text))
    assert mentioned and mentioned <= set(flat)
    healthy = {h for h in flat if state[h] in ("IDLE", "ALLOCATED", "MIXED")}
    used = {row.split()[1] for row in (exp / "ranks.txt").read_text().splitlines()[1:]}
    assert used <= healthy | {"spare-a", "spare-b"}


def test_gb200_import_board_limits_in_the_validator(tmp_path: Path) -> None:
    # Hand-built plan on the imported GB200 cluster: replica 0 at TP16 on block b02 (68 healthy
    # GPUs, 1200 W boards with no headroom), replica 1 at TP14 on block b01 (62 healthy GPUs
    # capped at 1000 W, max 1200 W), local batch 16 each.
    G = import_slurm(
        GB / "topology.yaml", GB / "nodes.txt", nvidia_smi=GB / "nvidia-smi", warn=quiet
    )
    inst = Instance("gb200", G, load_job(GB / "job.json"))

    def healthy(d: str) -> list[str]:
        return [
            g
            for t in G[d]
            if G.nodes[t]["kind"] == "tray"
            for g in sorted(G[t])
            if G.nodes[g]["kind"] == "gpu" and G.nodes[g]["state"] == "healthy"
        ]

    b1, b2 = healthy("b01"), healthy("b02")
    assert (len(b1), len(b2)) == (62, 68)

    def plan(p0: float, p1: float) -> Plan:
        r0 = Replica(
            16, 16, tuple(Stage("b02", tuple(b2[16 * k : 16 * k + 16]), p0) for k in range(4))
        )
        r1 = Replica(
            14, 16, tuple(Stage("b01", tuple(b1[14 * k : 14 * k + 14]), p1) for k in range(4))
        )
        return Plan("gb200", (r0, r1), {})

    assert validate(inst, plan(1.0, 1.2)) == []
    # speed of the TP14 replica: 14/16 * 1.2^0.65; step time set by it; resharding 1 %
    assert evaluate(inst, plan(1.0, 1.2)).relative_goodput == pytest.approx(
        14 / 16 * 1.2**0.65 / 1.01
    )
    over_b01 = {v.rule for v in validate(inst, plan(1.0, 1.21))}
    over_b02 = {v.rule for v in validate(inst, plan(1.01, 1.2))}
    assert over_b01 == {"board-power"} and over_b02 == {"board-power"}


_CONF_ALPHABET = st.sampled_from(
    [
        "BlockName=",
        "Nodes=",
        "BlockSizes=",
        "SwitchName=",
        "gb-",
        "[",
        "]",
        "-",
        ",",
        "0",
        "1",
        "9",
        " ",
        "\n",
        "#",
        "\\",
        "=",
        "b",
    ]
)
_XML_BITS = st.sampled_from(
    [
        "<nvidia_smi_log>",
        "</nvidia_smi_log>",
        "<gpu>",
        "</gpu>",
        "<minor_number>",
        "</minor_number>",
        "<gpu_power_readings>",
        "</gpu_power_readings>",
        "<default_power_limit>",
        "</default_power_limit>",
        "<max_power_limit>",
        "</max_power_limit>",
        "700.00 W",
        "N/A",
        "x",
        "3",
        "<fabric><clusterUuid>u</clusterUuid><cliqueId>1</cliqueId></fabric>",
        "<uuid>GPU-1</uuid>",
    ]
)


@settings(max_examples=40, deadline=None)
@given(
    conf=st.lists(_CONF_ALPHABET, max_size=40).map("".join),
    xml=st.lists(_XML_BITS, max_size=30).map("".join),
)
def test_garbage_is_an_input_error_never_a_crash(
    conf: str, xml: str, tmp_path_factory: Any
) -> None:
    tmp = tmp_path_factory.mktemp("fuzz")
    (tmp / "topology.conf").write_text(conf)
    (tmp / "smi").mkdir()
    (tmp / "smi" / "gb-001.xml").write_text(xml)
    for path, nvidia_smi in ((tmp / "topology.conf", None), (GB / "topology.conf", tmp / "smi")):
        try:
            import_slurm(path, GB / "nodes.txt", nvidia_smi=nvidia_smi, warn=quiet)
        except InputError as err:
            msg = str(err)
            assert len(msg.splitlines()) == 1 and msg.startswith((str(tmp), str(GB)))


def test_block_named_like_a_host(gb: Path, out: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _bad_topology(
        gb,
        "topology.conf",
        "BlockName=b01 Nodes=gb-[001-018]\nBlockName=gb-001 Nodes=gb-[019-036]\n",
        out,
        r"topology\.conf:2: name 'gb-001' is used both as a domain and as a tray",
        capsys,
    )


def test_docs_python_example_runs(monkeypatch: pytest.MonkeyPatch, capsys: Any) -> None:
    doc = Path(__file__).resolve().parents[2] / "docs" / "import.md"
    block = re.search(r"```python\n(.*?)```", doc.read_text(), re.S)
    assert block is not None
    monkeypatch.chdir(doc.parent.parent)
    exec(compile(block.group(1), "docs/import.md", "exec"), {})
    last = capsys.readouterr().out.splitlines()[-1].split()
    assert last[0] == fixture_uuid("gb-001", 0)
    # at least the TP14 replica unboosted (14/16, 1 % resharding), at most no loss at all
    assert 14 / 16 / 1.01 - 1e-9 <= float(last[1]) <= 1.0


def test_docs_gb200_transcript_runs(tmp_path: Path) -> None:
    """The worked example of docs/import.md, run command by command (``/tmp/`` -> tmp_path):
    the quoted output of ``validate``, ``export`` and ``head`` is what the commands print."""
    doc = (Path(__file__).resolve().parents[2] / "docs" / "import.md").read_text()
    start = doc.index("## Worked example")
    block = re.search(r"```console\n(.*?)```", doc[start:], re.S)
    assert block is not None
    steps: list[tuple[str, list[str]]] = []  # (command, quoted output lines)
    lines = block.group(1).splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("$ "):
            cmd = line[2:]
            while cmd.endswith("\\"):
                i += 1
                cmd = cmd[:-1] + " " + lines[i].strip()
            steps.append((cmd, []))
        else:
            steps[-1][1].append(line)
        i += 1
    assert len(steps) == 8
    bindir = tmp_path / "bin"
    bindir.mkdir()
    shim = bindir / "ntp-opt"
    shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m ntp_opt.app.cli "$@"\n')
    shim.chmod(0o755)
    root = Path(__file__).resolve().parents[2]
    env = {
        **os.environ,
        "PATH": f"{bindir}{os.pathsep}{os.environ['PATH']}",
        "PYTHONPATH": str(root),
    }
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    cwd = root
    for cmd, quoted in steps:
        real = cmd.replace("/tmp/", f"{out_dir}/")
        if real.startswith("cd "):
            cwd = cwd / real[3:].strip()
            continue
        proc = subprocess.run(
            real, shell=True, cwd=cwd, env=env, capture_output=True, text=True, check=False
        )
        assert proc.returncode == 0, f"{cmd}: {proc.stderr[-2000:]}"
        words = cmd.split()
        if words[0] == "head" or words[1] in ("validate", "export"):
            got = proc.stdout.replace(f"{out_dir}/", "/tmp/").splitlines()
            assert got == quoted, f"{cmd}"
