"""Kubernetes import read faithfully and safely: kubectl --live, no guessed power, racks,
empty nvidia-smi files, hostile files (FIFOs, bombs, out-of-range values).

Expected values are read off the fixture descriptions (tests/fixtures/import/make_fixtures.py)
and the documented caps, never computed by the importer.
"""

from __future__ import annotations

import gzip
import json
import os
import re
import shutil
import socket
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from ntp_opt.app.cli import main
from ntp_opt.app.importers import compose, k8s, nvidia_smi
from ntp_opt.app.importers.k8s import KubectlOutput, import_k8s, run_kubectl
from ntp_opt.model.files import InputError, caps, load_instance

FIX = Path(__file__).parents[1] / "fixtures" / "import"
H100 = FIX / "h100-k8s"
GB = FIX / "gb200-slurm"
ROOT = Path(__file__).resolve().parents[2]


def quiet(_msg: str) -> None:
    pass


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    rc = main(argv)
    out = capsys.readouterr()
    return rc, out.out, out.err


def k8s_argv(out: Path, *extra: str, nodes: Path | None = H100 / "nodes.json") -> list[str]:
    argv = ["import", "k8s", "--job", str(H100 / "job.json"), "-o", str(out), *extra]
    return [*argv, "--nodes", str(nodes)] if nodes is not None else argv


def refused(argv: list[str], out: Path, pattern: str, capsys: pytest.CaptureFixture[str]) -> str:
    """Run ``argv``: exit 2, one error line matching ``pattern``, ``out`` untouched."""
    out.write_text("previous contents\n")
    rc, _, err = run(argv, capsys)
    assert rc == 2, err
    errors = [ln for ln in err.splitlines() if ln.startswith("ntp-opt: error: ")]
    assert len(errors) == 1 and err.strip().splitlines()[-1] == errors[0], err
    assert re.search(pattern, errors[0]), errors[0]
    assert "Traceback" not in err
    assert out.read_text() == "previous contents\n"
    return errors[0]


def nodes_json(tmp: Path, edit: Any, name: str = "nodes.json") -> Path:
    data = json.loads((H100 / "nodes.json").read_text())
    edit(data)
    p = tmp / name
    p.write_text(json.dumps(data))
    return p


def gpu_items(data: dict[str, Any]) -> list[dict[str, Any]]:
    return [it for it in data["items"] if "nvidia.com/gpu.count" in it["metadata"]["labels"]]


def no_product(data: dict[str, Any]) -> None:
    """Nodes without GPU feature discovery labels: only the device plugin's capacity."""
    for it in data["items"]:
        labels = it["metadata"]["labels"]
        for key in [k for k in labels if k.startswith("nvidia.com/")]:
            del labels[key]


def smi_copy(tmp: Path) -> Path:
    d = tmp / "smi"
    shutil.copytree(H100 / "nvidia-smi", d)
    return d


# --- kubectl --live ---------------------------------------------------------------


def fake_kubectl(tmp: Path, monkeypatch: pytest.MonkeyPatch, body: str) -> Path:
    """A ``kubectl`` script first on PATH; it records its arguments and KUBECONFIG."""
    bindir = tmp / "bin"
    bindir.mkdir(exist_ok=True)
    script = bindir / "kubectl"
    script.write_text(
        f'#!/bin/sh\nprintf "%s\\n" "$*" "$KUBECONFIG" > "{tmp}/kubectl-args"\n' + body + "\n"
    )
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ['PATH']}")
    return script


def test_live_runs_kubectl_with_context_and_kubeconfig(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    fake_kubectl(tmp_path, monkeypatch, f'cat "{H100 / "nodes.json"}"')
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "kubeconfig"))
    out = tmp_path / "h.json"
    argv = k8s_argv(
        out, "--live", "--context", "prod", "--rack-label", "example.com/rack", nodes=None
    )
    rc, stdout, err = run([*argv, "--nvidia-smi", str(H100 / "nvidia-smi")], capsys)
    assert rc == 0, err
    assert "64 GPUs (25 failed) on 8 hosts, 8 NVLink domains, 2 racks" in stdout
    args, kubeconfig = (tmp_path / "kubectl-args").read_text().splitlines()
    assert args == "get nodes -o json --context prod"
    assert kubeconfig == str(tmp_path / "kubeconfig")
    assert load_instance(out).meta["nodes"] == "kubectl get nodes -o json (context prod)"
    # the same cluster as from the file
    argv = k8s_argv(tmp_path / "f.json", "--rack-label", "example.com/rack")
    rc, _, err = run([*argv, "--nvidia-smi", str(H100 / "nvidia-smi")], capsys)
    assert rc == 0, err
    assert load_instance(out).cluster.nodes(data=True) == load_instance(
        tmp_path / "f.json"
    ).cluster.nodes(data=True)


@pytest.mark.parametrize(
    ("body", "pattern"),
    [
        (
            'echo "error: context \\"prod\\" does not exist" >&2; exit 1',
            r"^ntp-opt: error: kubectl get nodes -o json: failed \(exit status 1\): "
            r'error: context "prod" does not exist$',
        ),
        ("exit 0", r"kubectl get nodes -o json: printed nothing$"),
        ("echo '{\"items\": ['", r"kubectl get nodes -o json: malformed JSON"),
        # hangs: killed at --kubectl-timeout, with the child it started
        ("sleep 600 & wait", r"kubectl get nodes -o json: no answer within 0\.5 s"),
    ],
)
def test_live_failures_are_one_line(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    body: str,
    pattern: str,
) -> None:
    fake_kubectl(tmp_path, monkeypatch, body)
    out = tmp_path / "h.json"
    refused(k8s_argv(out, "--live", "--kubectl-timeout", "0.5", nodes=None), out, pattern, capsys)


def test_live_without_kubectl_and_bad_options(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # no kubectl there
    out = tmp_path / "h.json"
    refused(k8s_argv(out, "--live", nodes=None), out, r"kubectl not found on PATH", capsys)
    refused(k8s_argv(out, "--context", "x"), out, r"--context: only used with --live", capsys)
    for bad in ("0", "-1", "nan", "x"):
        with pytest.raises(SystemExit) as exc:
            main(k8s_argv(out, "--live", "--kubectl-timeout", bad, nodes=None))
        assert exc.value.code == 2
    with pytest.raises(SystemExit):  # --nodes and --live exclude each other
        main(k8s_argv(out, "--live"))


def test_live_output_is_bounded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_kubectl(tmp_path, monkeypatch, "exec yes")  # endless output
    with pytest.raises(InputError, match=r"kubectl get nodes -o json: output exceeds 100000 bytes"):
        run_kubectl(max_bytes=100_000, timeout=60)


# --- no guessed power -------------------------------------------------------------


def test_unknown_power_is_refused_unless_stated(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    nodes = nodes_json(tmp_path, no_product)
    out = tmp_path / "h.json"
    line = refused(
        k8s_argv(out, nodes=nodes),
        out,
        r"nodes\.json: items\[1\]: host dgx-h100-01: the power of its GPUs is not known: no GPU "
        r"product is named .*\(and 7 more host\(s\)\); give --nvidia-smi output for it, or "
        r"--tdp-w W",
        capsys,
    )
    assert "1000" not in line  # the old guess is gone
    # --tdp-w alone: no boost
    rc, _, err = run(k8s_argv(out, "--tdp-w", "700", nodes=nodes), capsys)
    assert rc == 0, err
    assert "--tdp-w 700 W applies to the GPUs of 8 host(s) of unknown product" in err
    gpus = [d for _, d in load_instance(out).cluster.nodes(data=True) if d["kind"] == "gpu"]
    assert {(d["tdp_w"], d["max_power_w"]) for d in gpus} == {(700.0, 700.0)}
    # with --max-power-w; and the XML of hosts 01 and 02 still wins for them
    argv = k8s_argv(out, "--tdp-w", "650", "--max-power-w", "690", nodes=nodes)
    rc, _, err = run([*argv, "--nvidia-smi", str(H100 / "nvidia-smi")], capsys)
    assert rc == 0, err
    g = load_instance(out).cluster.nodes
    assert (g["dgx-h100-01:gpu0"]["tdp_w"], g["dgx-h100-01:gpu0"]["max_power_w"]) == (700.0, 700.0)
    assert (g["dgx-h100-07:gpu0"]["tdp_w"], g["dgx-h100-07:gpu0"]["max_power_w"]) == (650.0, 690.0)
    rc, stdout, _ = run(["info", str(out)], capsys)
    assert "--tdp-w 650 W stated the power of GPUs of unknown product" in stdout
    assert "(from nvidia-smi)" in stdout and "(from --tdp-w)" in stdout


def test_power_options_are_checked(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "h.json"
    refused(k8s_argv(out, "--max-power-w", "700"), out, r"--max-power-w: needs --tdp-w", capsys)
    refused(
        k8s_argv(out, "--tdp-w", "700", "--max-power-w", "600"),
        out,
        r"--max-power-w: 600 W is below --tdp-w 700 W",
        capsys,
    )
    for bad in ("0", "nan", "inf", "1e9", "-700"):
        with pytest.raises(SystemExit) as exc:
            main(k8s_argv(out, "--tdp-w", bad))
        assert exc.value.code == 2
        assert "argument --tdp-w: must be 1 to 100000 W" in capsys.readouterr().err
    # a product the table does not know is named
    nodes = nodes_json(
        tmp_path,
        lambda d: [
            it["metadata"]["labels"].update({"nvidia.com/gpu.product": "NVIDIA-A100-SXM4-80GB"})
            for it in gpu_items(d)
        ],
    )
    refused(
        k8s_argv(out, nodes=nodes),
        out,
        r"GPU product 'NVIDIA-A100-SXM4-80GB' is not in the hardware table",
        capsys,
    )
    # given but not needed: said so
    rc, _, err = run(k8s_argv(out, "--tdp-w", "700"), capsys)
    assert rc == 0 and "--tdp-w / --max-power-w unused" in err


def test_slurm_takes_the_power_options(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "gb.json"
    argv = ["import", "slurm", "--topology", str(GB / "topology.yaml")]
    argv += ["--nodes", str(GB / "nodes.txt"), "--job", str(GB / "job.json"), "-o", str(out)]
    refused(argv, out, r"nodes\.txt:1: host gb-001: the power of its GPUs is not known", capsys)
    rc, _, err = run([*argv, "--tdp-w", "1000", "--max-power-w", "1200"], capsys)
    assert rc == 0, err
    g = load_instance(out).cluster.nodes
    # gb-001 (Gres gpu:4, no type): the options; gb-005 (gpu:gb200:4): the table's GB200 row
    assert (g["gb-001:gpu0"]["tdp_w"], g["gb-001:gpu0"]["max_power_w"]) == (1000.0, 1200.0)
    assert (g["gb-005:gpu0"]["tdp_w"], g["gb-005:gpu0"]["max_power_w"]) == (1200.0, 1200.0)
    # with the XML (the documented example) nothing is needed
    rc, _, err = run([*argv, "--nvidia-smi", str(GB / "nvidia-smi")], capsys)
    assert rc == 0, err


# --- racks ----------------------------------------------------------------------


def rack_labels(key: str, value: Any, skip: tuple[str, ...] = ()) -> Any:
    def edit(d: dict[str, Any]) -> None:
        for it in gpu_items(d):
            name = it["metadata"]["name"]
            if name not in skip:
                it["metadata"]["labels"][key] = value(name)

    return edit


def test_well_known_rack_label_is_used_and_said(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    def rack(name: str) -> str:
        return "rack-a" if name <= "dgx-h100-04" else "rack-b"

    nodes = nodes_json(tmp_path, rack_labels("topology.kubernetes.io/rack", rack))
    out = tmp_path / "h.json"
    rc, stdout, err = run(k8s_argv(out, nodes=nodes), capsys)
    assert rc == 0, err
    assert "2 racks" in stdout
    assert "racks from node label topology.kubernetes.io/rack (2 rack(s))" in err
    g = load_instance(out).cluster.nodes
    assert g["rack-a"]["power_budget_w"] == 4 * 8 * 700
    assert g["rack-a"]["budget_source"] == (
        "node label topology.kubernetes.io/rack; sum of its GPUs' tdp_w (from the hardware table)"
    )
    rc, stdout, _ = run(["info", str(out)], capsys)
    assert "rack budgets: 2 rack(s): node label topology.kubernetes.io/rack" in stdout
    # GKE's sub-block label; two nodes without it get a rack of their own
    nodes = nodes_json(
        tmp_path,
        rack_labels(
            "cloud.google.com/gce-topology-subblock",
            lambda n: "sb-1",
            skip=("dgx-h100-07", "dgx-h100-08"),
        ),
    )
    rc, stdout, err = run(k8s_argv(out, nodes=nodes), capsys)
    assert rc == 0, err
    assert "3 racks" in stdout
    assert "2 GPU node(s) without it (dgx-h100-07, dgx-h100-08) get one rack per NVLink" in err
    g = load_instance(out).cluster.nodes
    assert g["sb-1"]["power_budget_w"] == 6 * 8 * 700
    assert g["dgx-h100-07/nvlink/rack"]["budget_source"].startswith("one rack per NVLink domain")
    # --rack-label wins over the well-known label
    rc, stdout, _ = run(k8s_argv(out, "--rack-label", "example.com/rack", nodes=nodes), capsys)
    assert rc == 0 and "2 racks" in stdout


def test_rack_and_label_values_out_of_range(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "h.json"
    nodes = nodes_json(tmp_path, rack_labels("topology.kubernetes.io/rack", lambda n: "r" * 64))
    refused(
        k8s_argv(out, nodes=nodes),
        out,
        r'items\[1\]\.metadata\.labels\["topology\.kubernetes\.io/rack"\]: expected a label value '
        r"of 1 to 63 characters",
        capsys,
    )
    nodes = nodes_json(tmp_path, rack_labels("topology.kubernetes.io/rack", lambda n: 7))
    refused(k8s_argv(out, nodes=nodes), out, r"expected a label value .*got 7$", capsys)


# --- empty nvidia-smi files -------------------------------------------------------


def test_empty_xml_of_a_usable_host_is_an_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    smi = smi_copy(tmp_path)
    (smi / "dgx-h100-01.xml").write_text("")
    out = tmp_path / "h.json"
    refused(
        k8s_argv(out, "--nvidia-smi", str(smi)),
        out,
        r"smi/dgx-h100-01\.xml: empty file, but host dgx-h100-01 is usable \(.*items\[1\]\): "
        r"run nvidia-smi -q -x on dgx-h100-01 again and rewrite the file, or remove the file",
        capsys,
    )
    (smi / "dgx-h100-01.xml").write_text(" \n\n")  # white space only: empty too
    refused(k8s_argv(out, "--nvidia-smi", str(smi)), out, r"empty file, but host", capsys)


def test_empty_xml_of_an_unusable_host_is_a_warning(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    smi = smi_copy(tmp_path)
    (smi / "dgx-h100-03.xml").write_text("")  # NotReady in the fixture (ssh to it failed)
    out = tmp_path / "h.json"
    rc, stdout, err = run(k8s_argv(out, "--nvidia-smi", str(smi)), capsys)
    assert rc == 0, err
    assert "smi/dgx-h100-03.xml: empty file; ignored: host dgx-h100-03 is NotReady" in err
    assert "64 GPUs (25 failed)" in stdout


# --- hostile files ----------------------------------------------------------------


def cli_in_subprocess(argv: list[str]) -> subprocess.CompletedProcess[str]:
    """The CLI in a child process, bounded in time: a blocking open fails the test, not hangs."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "ntp_opt.app.cli", *argv],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        check=False,
    )


def test_fifo_and_socket_are_refused_without_blocking(tmp_path: Path) -> None:
    smi = smi_copy(tmp_path)
    (smi / "dgx-h100-01.xml").unlink()
    os.mkfifo(smi / "dgx-h100-01.xml")
    fifo = tmp_path / "nodes.json"
    os.mkfifo(fifo)
    sock = tmp_path / "nodes.sock"
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(sock))
        out = tmp_path / "h.json"
        for argv, pattern in (
            (
                k8s_argv(out, "--nvidia-smi", str(smi)),
                r"dgx-h100-01\.xml: not a regular file \(a FIFO\)",
            ),
            (k8s_argv(out, nodes=fifo), r"nodes\.json: not a regular file \(a FIFO\)"),
            (k8s_argv(out, nodes=sock), r"nodes\.sock: not a regular file \(a socket\)"),
            (k8s_argv(out, nodes=Path("/dev/zero")), r"/dev/zero: not a regular file \(a char"),
        ):
            p = cli_in_subprocess(argv)
            assert p.returncode == 2, p.stderr
            errors = [ln for ln in p.stderr.splitlines() if "warning" not in ln]
            assert len(errors) == 1 and re.search(pattern, errors[0]), p.stderr
            assert not out.exists()


def test_read_capped_checks_the_opened_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the path checked is swapped for a FIFO before the open: the descriptor is checked
    # again, and opened non-blocking, so the read never waits for a writer
    fifo = tmp_path / "f.xml"
    os.mkfifo(fifo)
    real_stat = os.stat

    def regular_stat(path: Any, *a: Any, **kw: Any) -> Any:
        st = real_stat(path, *a, **kw)
        if Path(path) == fifo:
            return os.stat_result((stat.S_IFREG | 0o644, *tuple(st)[1:]))
        return st

    monkeypatch.setattr(compose.os, "stat", regular_stat)
    with pytest.raises(InputError, match=r"f\.xml: not a regular file \(a FIFO\)"):
        compose.read_capped(fifo, 1000)


def xml_of(gpus: str) -> str:
    return f'<?xml version="1.0" ?>\n<nvidia_smi_log>{gpus}</nvidia_smi_log>\n'


@pytest.mark.parametrize(
    ("edit", "pattern"),
    [
        (
            lambda t: t.replace("<minor_number>0<", "<minor_number>99999999999999999999<", 1),
            r"dgx-h100-01\.xml: /nvidia_smi_log/gpu\[1\]/minor_number: minor_number "
            r"'99999999999999999999' is not a device number \(0 to 1000000\)",
        ),
        (
            lambda t: t.replace("<minor_number>0<", "<minor_number>-3<", 1),
            r"gpu\[1\]/minor_number: minor_number '-3' is not a device number",
        ),
        (
            lambda t: t.replace("<uuid>GPU-", "<uuid>GPU-" + "a" * 300, 1),
            r"gpu\[1\]/uuid: GPU 1: uuid of 340 characters, more than 200",
        ),
        (
            lambda t: t.replace("<default_power_limit>700.00 W", "<default_power_limit>1e9 W", 1),
            r"gpu\[1\]/gpu_power_readings/default_power_limit: expected a power like",
        ),
        (
            lambda t: t.replace(
                "<default_power_limit>700.00 W", "<default_power_limit>99999999999.00 W", 1
            ),
            r"default_power_limit: power 99999999999\.00 W out of range \(1 to 100000 W\)",
        ),
        (
            lambda t: t.replace("<max_power_limit>700.00 W", "<max_power_limit>-700.00 W", 1),
            r"gpu\[1\]/gpu_power_readings/max_power_limit: expected a power like '700\.00 W', "
            r"got '-700\.00 W'",
        ),
        (
            lambda t: t.replace("<default_power_limit>700.00 W", "<default_power_limit>0.5 W", 1),
            r"default_power_limit: power 0\.5 W out of range",
        ),
        (
            lambda t: xml_of("<gpu/>" * 1025),
            r"dgx-h100-01\.xml: 1025 <gpu> elements, more than 1024$",
        ),
    ],
)
def test_xml_values_out_of_range(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], edit: Any, pattern: str
) -> None:
    smi = smi_copy(tmp_path)
    f = smi / "dgx-h100-01.xml"
    f.write_text(edit(f.read_text()))
    out = tmp_path / "h.json"
    refused(k8s_argv(out, "--nvidia-smi", str(smi)), out, pattern, capsys)


def test_xml_size_and_tag_caps(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    smi = smi_copy(tmp_path)
    f = smi / "dgx-h100-01.xml"
    out = tmp_path / "h.json"
    assert nvidia_smi.MAX_XML_BYTES == 16 * 1024**2 and nvidia_smi.MAX_XML_TAGS == 1_000_000
    monkeypatch.setattr(nvidia_smi, "MAX_XML_BYTES", 30_000)  # the fixture file is ~22 KB
    f.write_text(xml_of("<a/>" * 8000))
    refused(
        k8s_argv(out, "--nvidia-smi", str(smi)),
        out,
        r"dgx-h100-01\.xml: file is 32\d{3} bytes, more than 30000 bytes",
        capsys,
    )
    monkeypatch.setattr(nvidia_smi, "MAX_XML_TAGS", 5000)
    f.write_text(xml_of("<a/>" * 5000))
    refused(
        k8s_argv(out, "--nvidia-smi", str(smi)),
        out,
        r"5003 tags, more than 5000 \(a real file has about 10,000\)",
        capsys,
    )


@pytest.mark.parametrize(
    ("edit", "pattern"),
    [
        (
            lambda d: d["items"][1]["metadata"]["labels"].update(
                {"nvidia.com/gpu.count": "100000000"}
            ),
            r'items\[1\]\.metadata\.labels\["nvidia\.com/gpu\.count"\]: GPU count 100000000 out '
            r"of range \(0 to 1024\)",
        ),
        (
            lambda d: d["items"][1]["metadata"]["labels"].update({"nvidia.com/gpu.count": "1025"}),
            r"GPU count 1025 out of range \(0 to 1024\)",
        ),
        (
            lambda d: d["items"][1]["metadata"]["labels"].update(
                {"nvidia.com/gpu.count": "9" * 99}
            ),
            r"expected a GPU count \(0 to 1024\), got '9{50}",
        ),
        (
            lambda d: d["items"][1]["status"]["capacity"].update({"nvidia.com/gpu": -8}),
            r'capacity\["nvidia\.com/gpu"\]: GPU count -8 out of range',
        ),
        (
            lambda d: (
                d["items"][1]["metadata"]["labels"].update({"nvidia.com/gpu.replicas": "9" * 5000}),
                d["items"][1]["status"]["capacity"].update({"nvidia.com/gpu": "16"}),
            ),
            r"node dgx-h100-01: 16 GPUs in status\.capacity but the label nvidia\.com/gpu\.count "
            r"says 8$",
        ),
        (
            lambda d: d["items"][1]["metadata"].update({"name": "n" * 254}),
            r"items\[1\]\.metadata\.name: node name of 254 characters, more than 253",
        ),
    ],
)
def test_nodes_json_values_out_of_range(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], edit: Any, pattern: str
) -> None:
    out = tmp_path / "h.json"
    line = refused(k8s_argv(out, nodes=nodes_json(tmp_path, edit)), out, pattern, capsys)
    assert len(line) < 400


def test_nodes_json_caps(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "h.json"
    assert k8s.MAX_NODES_JSON_BYTES == 256 * 1024**2 and k8s.MAX_K8S_NODES == 100_000
    monkeypatch.setattr(k8s, "MAX_NODES_JSON_BYTES", 10_000)  # the fixture is ~24 KB
    refused(
        k8s_argv(out),
        out,
        r"nodes\.json: file is \d+ bytes, more than 10000 bytes \(a node object takes",
        capsys,
    )
    gz = tmp_path / "nodes.json.gz"  # compressed: the cap holds for the decompressed bytes
    gz.write_bytes(gzip.compress((H100 / "nodes.json").read_bytes()))
    assert gz.stat().st_size < 10_000
    refused(
        k8s_argv(out, nodes=gz), out, r"nodes\.json\.gz: decompresses to more than 10000", capsys
    )
    monkeypatch.undo()
    rc, _, err = run(k8s_argv(out, "--rack-label", "example.com/rack", nodes=gz), capsys)
    assert rc == 0, err
    monkeypatch.setattr(k8s, "MAX_K8S_NODES", 8)  # the fixture has 9 nodes
    refused(k8s_argv(out), out, r"nodes\.json: items: 9 nodes, more than 8$", capsys)


def test_instance_node_cap_is_refused_at_import(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # 8 hosts x 8 GPUs + 8 trays + 8 domains + 8 racks = 88 nodes; the cap lowered to 87
    monkeypatch.setattr(caps, "MAX_NODES", 87)
    out = tmp_path / "h.json"
    refused(
        k8s_argv(out),
        out,
        r"items\[8\]: the cluster would have 88 nodes \(64 GPUs on 8 hosts, domains, racks\): "
        r"more than the 87 an instance file may hold",
        capsys,
    )
    monkeypatch.setattr(caps, "MAX_NODES", 88)
    rc, _, err = run(k8s_argv(out), capsys)
    assert rc == 0, err


def test_import_k8s_takes_kubectl_output() -> None:
    raw = (H100 / "nodes.json").read_bytes()
    G = import_k8s(KubectlOutput(raw, "kubectl get nodes -o json"), warn=quiet)
    assert sum(1 for _, k in G.nodes(data="kind") if k == "gpu") == 64
    with pytest.raises(InputError, match=r"^kubectl get nodes -o json: malformed JSON"):
        import_k8s(KubectlOutput(b"{", "kubectl get nodes -o json"), warn=quiet)


def test_empty_xml_rule_holds_for_slurm_too(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    smi = tmp_path / "smi"
    shutil.copytree(GB / "nvidia-smi", smi)
    (smi / "gb-005.xml").write_text("")  # gb-005 is DOWN+NOT_RESPONDING: ssh wrote nothing
    out = tmp_path / "gb.json"
    argv = ["import", "slurm", "--topology", str(GB / "topology.yaml"), "--nodes"]
    argv += [str(GB / "nodes.txt"), "--nvidia-smi", str(smi), "--job", str(GB / "job.json")]
    rc, stdout, err = run([*argv, "-o", str(out)], capsys)
    assert rc == 0, err
    assert "gb-005.xml: empty file; ignored: host gb-005 is DOWN+NOT_RESPONDING in Slurm" in err
    assert "144 GPUs (14 failed)" in stdout
    (smi / "gb-004.xml").write_text("")  # gb-004 is usable
    refused(
        [*argv, "-o", str(out)],
        out,
        r"smi/gb-004\.xml: empty file, but host gb-004 is usable \(.*nodes\.txt:4\): run "
        r"nvidia-smi -q -x on gb-004 again",
        capsys,
    )


def test_xml_without_max_limit_of_an_unknown_product_is_not_boosted(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    smi = smi_copy(tmp_path)
    f = smi / "dgx-h100-01.xml"
    text = f.read_text().replace("NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB")
    f.write_text(re.sub(r"<max_power_limit>[^<]*<", "<max_power_limit>N/A<", text))
    nodes = nodes_json(tmp_path, no_product)
    out = tmp_path / "h.json"
    # dgx-h100-02's XML gives its power; the six hosts without XML need --tdp-w
    refused(
        k8s_argv(out, "--nvidia-smi", str(smi), nodes=nodes),
        out,
        r"items\[3\]: host dgx-h100-03: the power of its GPUs is not known: .*\(and 5 more",
        capsys,
    )
    argv = k8s_argv(out, "--nvidia-smi", str(smi), "--tdp-w", "400", nodes=nodes)
    rc, _, err = run(argv, capsys)
    assert rc == 0, err
    assert "nvidia-smi: 8 GPU(s) without a max power limit, of a product not in the hardware" in err
    g = load_instance(out).cluster.nodes
    assert (g["dgx-h100-01:gpu0"]["tdp_w"], g["dgx-h100-01:gpu0"]["max_power_w"]) == (700.0, 700.0)
    assert (g["dgx-h100-03:gpu0"]["tdp_w"], g["dgx-h100-03:gpu0"]["max_power_w"]) == (400.0, 400.0)


def test_rack_label_option_length(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "h.json"
    refused(
        k8s_argv(out, "--rack-label", "k" * 318),
        out,
        r"--rack-label: a label key has 1 to 317 characters, got 318",
        capsys,
    )
