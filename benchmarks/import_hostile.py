"""Time and memory of ``ntp-opt import k8s`` on hostile inputs (docs/safety.md, *Importing*).

Usage::

    python benchmarks/import_hostile.py [--repo DIR] [--work DIR] [--only NAME ...]

Writes the hostile inputs into ``--work`` (default a temporary folder): FIFOs,
XML bombs, out-of-range XML values, an empty XML file, oversized GPU counts,
node-count bombs; then runs the import of the H100 fixture with each one under
``/usr/bin/time -f "%e s %M KB"``, ``ulimit -v 6000000`` and ``timeout 30``,
with the code of ``--repo`` (default: this checkout; give another checkout to
compare), and prints one line per case: exit status, whether a file was
written, seconds, peak KB, and the first error line.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
FIX = ROOT / "tests" / "fixtures" / "import" / "h100-k8s"


def _smi(work: Path, name: str, edit: Callable[[str], str] | None = None) -> Path:
    d = work / name
    shutil.rmtree(d, ignore_errors=True)
    shutil.copytree(FIX / "nvidia-smi", d)
    if edit is not None:
        f = d / "dgx-h100-01.xml"
        f.write_text(edit(f.read_text()))
    return d


def _log(body: str) -> Callable[[str], str]:
    return lambda _t: f"<nvidia_smi_log>{body}</nvidia_smi_log>"


def _nodes(work: Path, name: str, edit: Callable[[dict[str, Any]], None]) -> Path:
    data = json.loads((FIX / "nodes.json").read_text())
    edit(data)
    p = work / name
    p.write_text(json.dumps(data))
    return p


def _many(gpus: str, n: int) -> Callable[[dict[str, Any]], None]:
    def edit(d: dict[str, Any]) -> None:
        items = []
        for k in range(n):
            it = json.loads(json.dumps(d["items"][1]))
            it["metadata"]["name"] = f"n{k}"
            it["metadata"]["labels"]["nvidia.com/gpu.count"] = gpus
            it["status"]["capacity"]["nvidia.com/gpu"] = gpus
            it["status"]["allocatable"]["nvidia.com/gpu"] = gpus
            items.append(it)
        d["items"] = items

    return edit


def _minimal(work: Path, name: str, n: int) -> Path:
    p = work / name
    item = '{"metadata":{"name":"n%d","labels":{"nvidia.com/gpu.count":"8"}}}'
    with p.open("w") as f:
        f.write('{"kind":"List","items":[' + ",".join(item % i for i in range(n)) + "]}")
    return p


def cases(work: Path) -> dict[str, list[str]]:
    """Each case's extra command-line arguments (the hostile inputs written into ``work``)."""
    nodes = ["--nodes", str(FIX / "nodes.json"), "--rack-label", "example.com/rack"]
    fifo_dir = _smi(work, "fifo")
    (fifo_dir / "dgx-h100-01.xml").unlink()
    os.mkfifo(fifo_dir / "dgx-h100-01.xml")
    fifo = work / "nodes.fifo"
    if not fifo.exists():
        os.mkfifo(fifo)

    def replicas(d: dict[str, Any]) -> None:
        d["items"][1]["metadata"]["labels"]["nvidia.com/gpu.replicas"] = "9" * 5000
        d["items"][1]["status"]["capacity"]["nvidia.com/gpu"] = "16"

    smi = {
        "xml-fifo": fifo_dir,
        "xml-10M-gpu": _smi(work, "bomb", _log("<gpu/>" * 10_000_000)),
        "xml-2.7M-gpu": _smi(work, "bomb2", _log("<gpu/>" * 2_700_000)),
        "xml-4M-a": _smi(work, "bomb3", _log("<a/>" * 4_000_000)),
        "xml-998k-tags": _smi(work, "bomb4", _log("<gpu/>" * 1000 + "<a/>" * 998_000)),
        "xml-minor": _smi(
            work,
            "minor",
            lambda t: t.replace("<minor_number>0<", "<minor_number>99999999999999999999<", 1),
        ),
        "xml-uuid-340": _smi(
            work, "uuid", lambda t: t.replace("<uuid>GPU-", "<uuid>GPU-" + "a" * 300, 1)
        ),
        "xml-watts": _smi(
            work,
            "watts",
            lambda t: t.replace(
                "<default_power_limit>700.00 W", "<default_power_limit>99999999999.00 W", 1
            ),
        ),
        "xml-empty": _smi(work, "empty", lambda _t: ""),
    }
    out = {k: [*nodes, "--nvidia-smi", str(d)] for k, d in smi.items()}
    count = _nodes(
        work,
        "count.json",
        lambda d: d["items"][1]["metadata"]["labels"].update({"nvidia.com/gpu.count": "100000000"}),
    )
    out["nodes-fifo"] = ["--nodes", str(fifo)]
    out["nodes-gpu-count"] = ["--nodes", str(count)]
    out["nodes-replicas"] = ["--nodes", str(_nodes(work, "replicas.json", replicas))]
    out["nodes-250x4096"] = ["--nodes", str(_nodes(work, "nodecap.json", _many("4096", 250)))]
    out["nodes-1000x1024"] = ["--nodes", str(_nodes(work, "nodecap2.json", _many("1024", 1000)))]
    out["nodes-1M-objects"] = ["--nodes", str(_minimal(work, "million.json", 1_000_000))]
    out["nodes-2.4M-objects"] = ["--nodes", str(_minimal(work, "worst.json", 2_400_000))]
    return out


def measure(repo: Path, work: Path, name: str, extra: list[str]) -> str:
    """One case under time, ulimit and timeout: a summary line."""
    target = work / f"out-{name}.json"
    target.unlink(missing_ok=True)
    argv = [sys.executable, "-m", "ntp_opt.app.cli", "import", "k8s", *extra]
    argv += ["--job", str(FIX / "job.json"), "-o", str(target)]
    script = 'ulimit -v 6000000; exec /usr/bin/time -f "%e s %M KB" timeout 30 "$@"'
    p = subprocess.run(
        ["bash", "-c", script, "bash", *argv],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(repo)},
        cwd=repo,
        check=False,
    )
    lines = p.stderr.strip().splitlines()
    usage = lines[-1] if lines else ""
    error = next((ln for ln in lines if "error" in ln or "Error" in ln or "terminated" in ln), "")
    written = "written" if target.exists() else "-"
    return f"{name:20} exit {p.returncode:3} {written:7} {usage:22} {error[:140]}"


def main() -> None:
    """Write the cases and print one measured line each."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repo", type=Path, default=ROOT, help="checkout whose code runs")
    parser.add_argument("--work", type=Path, help="folder for the inputs (default: temporary)")
    parser.add_argument("--only", nargs="*", help="case names to run")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        for name, extra in cases(work).items():
            if not args.only or name in args.only:
                print(measure(args.repo.resolve(), work, name, extra), flush=True)


if __name__ == "__main__":
    main()
