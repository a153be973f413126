"""An exported plan launched under a real Slurm, and ``bind.sh`` on its own.

``slurm`` (session fixture) runs the cluster of ``tests/slurm_cluster.py``: 4
GB200-like nodes with 4 GPUs each in one NVLink block, and 2 spare nodes outside
it for the placeholder ranks. The test drains one node for a GPU reason, reads
the cluster back with ``scontrol show node --oneliner``, imports, solves, exports
and launches the export with ``srun --distribution=arbitrary``; every rank records
its environment and must sit where ``ranks.txt`` says. All Slurm tests live in this
file, so that ``pytest -n 4 --dist loadfile`` gives the cluster to one worker.

Without Slurm (``apt-get install slurmctld slurmd slurm-client munge``) the Slurm
tests skip, except with ``CI=true``, where they fail (``.ci/run`` installs it).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import uuid
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest

from ntp_opt.app.cli import main
from ntp_opt.app.export import UUIDS_NAME, export_megatron
from ntp_opt.model import topology
from ntp_opt.model.instance import Instance
from ntp_opt.model.job import Job
from ntp_opt.planners.megatron import MegatronError
from ntp_opt.solve import solve
from tests.helpers import HANG_GUARD
from tests.slurm_cluster import SlurmCluster, running

#: Seconds the fixture took to start (reported by the test, see docs/testing.md).
STARTUP: dict[str, float] = {}


def gpu_uuid(host: str, index: int) -> str:
    """The UUID the test's nvidia-smi files give GPU ``index`` of ``host``."""
    return f"GPU-{uuid.uuid5(uuid.NAMESPACE_DNS, f'{host}.gpu{index}')}"


def _smi_xml(host: str, gpus: int) -> str:
    """A minimal ``nvidia-smi -q -x`` file: index, UUID, product, power limits."""
    parts = ['<?xml version="1.0" ?>\n<nvidia_smi_log>']
    for i in range(gpus):
        parts.append(
            f'<gpu id="0000000{i}:01:00.0"><product_name>NVIDIA GB200</product_name>'
            f"<uuid>{gpu_uuid(host, i)}</uuid><minor_number>{i}</minor_number>"
            "<gpu_power_readings><current_power_limit>1200.00 W</current_power_limit>"
            "<default_power_limit>1200.00 W</default_power_limit>"
            "<max_power_limit>1200.00 W</max_power_limit></gpu_power_readings></gpu>"
        )
    parts.append("</nvidia_smi_log>\n")
    return "\n".join(parts)


@pytest.fixture(scope="session")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    """A running cluster: 4 nodes x 4 GPUs in block ``nvl0``, 2 spares; stopped at the end."""
    t0 = time.monotonic()
    with running(
        tmp_path_factory.mktemp("slurm"), nodes=4, gpus=4, spares=2, tie_to_parent=True
    ) as cluster:
        STARTUP["start_s"] = time.monotonic() - t0
        yield cluster


def _ranks(path: Path) -> list[list[str]]:
    return [ln.split() for ln in path.read_text().splitlines() if not ln.startswith("#")]


def _srun(
    cluster: SlurmCluster, launch: Path, world: int, out: Path
) -> subprocess.CompletedProcess[str]:
    """Every rank of ``launch`` under srun; each writes its environment to ``out/<RANK>.env``."""
    out.mkdir()
    record = 'env -0 > "$0/$RANK.env"'
    return cluster.run(
        shutil.which("srun") or "srun",
        "--distribution=arbitrary",
        f"--ntasks={world}",
        "--kill-on-bad-exit=0",
        str(launch / "bind.sh"),
        "sh",
        "-c",
        record,
        str(out),
        check=False,
        cwd=str(launch),
        extra_env={"SLURM_HOSTFILE": str(launch / "slurm-hostfile")},
    )


def _env(path: Path) -> dict[str, str]:
    """A rank's environment as ``env -0`` wrote it."""
    return dict(item.split("=", 1) for item in path.read_text().split("\0") if "=" in item)


@pytest.fixture(scope="session")
def launched(slurm: SlurmCluster, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Drain a node, import, solve, export: the export directory (``launch/``)."""
    work = tmp_path_factory.mktemp("flow")
    n2 = slurm.block_nodes[1]
    slurm.run("scontrol", "update", f"nodename={n2}", "state=drain", "reason=GPU Xid 79")
    assert slurm.node_states()[n2] in {"drained", "draining"}
    nodes = slurm.run("scontrol", "show", "node", "--oneliner").stdout
    (work / "nodes.txt").write_text(nodes)
    # ntp-opt's importer reads topology/block files only (topology.conf's BlockName
    # lines or topology.yaml); Slurm 22.05 has no topology/block, so the cluster runs
    # topology/tree (etc/topology.conf, SwitchName lines) and the importer gets this
    # block-form file of the same NVLink block, written beside it.
    slurm.write_block_topology(work / "topology-block.conf")
    smi = work / "nvidia-smi"
    smi.mkdir()
    for h in slurm.block_nodes:
        (smi / f"{h}.xml").write_text(_smi_xml(h, slurm.gpus))
    job = {"tp": 4, "pp": 2, "dp": 2, "tp_min": 2, "tp_allowed": [2, 4], "global_batch": 8}
    (work / "job.json").write_text(json.dumps({**job, "batch_policy": "elastic"}))
    inst, plan, launch = work / "instance.json", work / "plan.json", work / "launch"
    argv = ["import", "slurm", "--topology", str(work / "topology-block.conf")]
    argv += ["--nodes", str(work / "nodes.txt"), "--nvidia-smi", str(smi)]
    assert main([*argv, "--job", str(work / "job.json"), "-o", str(inst)]) == 0
    argv = ["solve", str(inst), "--policy", "optimal", "--time-limit", str(HANG_GUARD)]
    assert main([*argv, "-o", str(plan)]) == 0
    argv = ["export", str(plan), "--to", "megatron-ntp", "--reorder", "--equal-batch"]
    argv += ["--instance", str(inst), "--placeholder-hosts", ",".join(slurm.spare_nodes)]
    assert main([*argv, "-o", str(launch)]) == 0
    return launch


def test_srun_places_every_rank(slurm: SlurmCluster, launched: Path, tmp_path: Path) -> None:
    """Each rank's RANK, node and GPU under srun are its row of ranks.txt, inactive ranks too."""
    rows = _ranks(launched / "ranks.txt")
    world = len(rows)
    hostfile = (launched / "slurm-hostfile").read_text().split()
    assert world == len(hostfile) == 2 * 2 * 4
    drained = slurm.block_nodes[1]
    assert drained not in hostfile  # the plan avoids the drained node
    assert any(r[8] == "0" for r in rows)  # a reduced replica: placeholder ranks
    t0 = time.monotonic()
    done = _srun(slurm, launched, world, tmp_path / "env")
    STARTUP["srun_s"] = time.monotonic() - t0
    assert done.returncode == 0, done.stderr
    envs = {int(p.stem): _env(p) for p in (tmp_path / "env").glob("*.env")}
    assert sorted(envs) == list(range(world))
    for rank, host, device, _gpu, _dom, _dp, _pp, _tp, active, *_ in rows:
        env = envs[int(rank)]
        assert (env["RANK"], env["SLURM_PROCID"], env["SLURMD_NODENAME"]) == (rank, rank, host)
        assert env["SLURM_TOPOLOGY_ADDR"].split(".")[-1] == host
        # the GPU's UUID when the instance knows it (the block's nodes, from the
        # nvidia-smi files), else the index (spare hosts), in nvidia-smi's order
        want = gpu_uuid(host, int(device)) if host in slurm.block_nodes else device
        assert env["CUDA_VISIBLE_DEVICES"] == want, (rank, active)
        assert env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
        assert (env["WORLD_SIZE"], env["LOCAL_RANK"]) == (str(world), "0")
    print(
        f"slurm start {STARTUP['start_s']:.2f} s, srun of {world} ranks {STARTUP['srun_s']:.2f} s"
    )


def test_srun_refuses_the_wrong_node(slurm: SlurmCluster, launched: Path, tmp_path: Path) -> None:
    """Two ranks swapped in the host file: bind.sh stops exactly those two under srun."""
    launch = tmp_path / "launch"
    shutil.copytree(launched, launch)
    hosts = (launch / "slurm-hostfile").read_text().split()
    j = next(i for i, h in enumerate(hosts) if h != hosts[0])
    hosts[0], hosts[j] = hosts[j], hosts[0]
    (launch / "slurm-hostfile").write_text("".join(h + "\n" for h in hosts))
    done = _srun(slurm, launch, len(hosts), tmp_path / "env")
    assert done.returncode != 0
    assert f"bind.sh: rank 0 runs on {hosts[0]} but is planned on {hosts[j]}" in done.stderr
    assert f"bind.sh: rank {j} runs on {hosts[j]} but is planned on {hosts[0]}" in done.stderr
    ran = {int(p.stem) for p in (tmp_path / "env").glob("*.env")}
    assert ran == set(range(len(hosts))) - {0, j}


# --- bind.sh without Slurm -----------------------------------------------------------


def _two_hosts(uuids: Mapping[int, object]) -> Instance:
    """One 8-GPU domain on hosts d0.t0, d0.t1 (4 each); ``uuids``: GPU position -> uuid."""
    g = topology.build_cluster(1, 8, 4, 2)
    gpus = [n for n, a in g.nodes(data=True) if a["kind"] == "gpu"]
    for i, u in uuids.items():
        g.nodes[gpus[i]]["uuid"] = u
    job = Job(tp=4, pp=1, dp=2, global_batch=2)
    return Instance("two-hosts", g, job)


def _bind(launch: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    base = {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}
    cmd = [
        str(launch / "bind.sh"),
        "sh",
        "-c",
        'echo "$RANK $CUDA_VISIBLE_DEVICES $CUDA_DEVICE_ORDER"',
    ]
    return subprocess.run(
        cmd, env={**base, **env}, capture_output=True, text=True, timeout=60, check=False
    )


def test_bind_uuid_or_index(tmp_path: Path) -> None:
    """UUID where the instance has one, else the index with PCI bus order; host from srun."""
    known = {0: "GPU-11111111-2222-3333-4444-555555555555", 2: "MIG-GPU-0a1b2c3d/1/0"}
    inst = _two_hosts(known)
    res = solve(inst, "optimal-megatron", time_limit=HANG_GUARD)
    assert res.plan is not None
    export_megatron(inst, res.plan, tmp_path)
    rows = _ranks(tmp_path / "ranks.txt")
    by_gpu = {f"d0.t0.g{i}": u for i, u in known.items()}
    assert len(rows) == 8
    for rank, host, device, gpu, *_ in rows:
        out = _bind(
            tmp_path, {"SLURM_PROCID": rank, "SLURMD_NODENAME": host, "NTP_HOST": "elsewhere"}
        )
        assert out.returncode == 0, out.stderr
        want = by_gpu.get(gpu, device)
        assert out.stdout.split() == [rank, want, "PCI_BUS_ID"]
        wrong = "d0.t1" if host == "d0.t0" else "d0.t0"
        bad = _bind(tmp_path, {"SLURM_PROCID": rank, "SLURMD_NODENAME": wrong})
        assert bad.returncode == 1 and not bad.stdout
        assert f"rank {rank} runs on {wrong} but is planned on {host}" in bad.stderr
    # an edited data file with a UUID that is not one is refused at run time
    text = (tmp_path / UUIDS_NAME).read_text()
    (tmp_path / UUIDS_NAME).write_text(text.replace(known[0], "GPU-1;touch x"))
    host0 = rows[0][1]
    bad = _bind(tmp_path, {"SLURM_PROCID": "0", "SLURMD_NODENAME": host0})
    assert bad.returncode == 1 and "bad UUID" in bad.stderr and not (tmp_path / "x").exists()
    # srun without SLURMD_NODENAME: refused, not guessed
    bad = _bind(tmp_path, {"SLURM_PROCID": "0"})
    assert bad.returncode == 1 and "SLURMD_NODENAME" in bad.stderr


def test_bind_without_uuids_and_bad_uuid(tmp_path: Path) -> None:
    """No UUID in the instance: no data file, indices; a UUID a shell would read: refused."""
    inst = _two_hosts({})
    res = solve(inst, "optimal-megatron", time_limit=HANG_GUARD)
    assert res.plan is not None
    ex = export_megatron(inst, res.plan, tmp_path / "plain")
    assert UUIDS_NAME not in ex.files
    rank, host, device = _ranks(tmp_path / "plain" / "ranks.txt")[5][:3]
    out = _bind(tmp_path / "plain", {"SLURM_PROCID": rank, "SLURMD_NODENAME": host})
    assert out.stdout.split() == [rank, device, "PCI_BUS_ID"]
    for bad in ("GPU-1,GPU-2", "$(reboot)", "GPU-a b", "nvidia0"):
        inst = _two_hosts({1: bad})
        with pytest.raises(MegatronError, match="megatron-uuids"):
            export_megatron(inst, res.plan, tmp_path / "bad")
