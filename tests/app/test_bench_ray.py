"""The Ray backend of the batch runner, on a local two-CPU Ray (``ray.init(num_cpus=2)``)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ntp_opt.app.bench import RESULTS, read_rows, run_bench
from tests.helpers import HANG_GUARD

ray = pytest.importorskip("ray")

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "instances" / "tiny.json"
SLEEPY = "tests.app.test_bench:sleepy"


@pytest.fixture(scope="module", autouse=True)
def local_ray() -> Iterator[None]:
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def test_ray_rows_timeout_and_resume(tmp_path: Path) -> None:
    out = tmp_path / "out"
    kw: dict[str, Any] = {"time_limit": HANG_GUARD, "progress": False, "backend": "ray"}
    # ntp and optimal must finish: their timeout only guards against a hang
    run_bench([TINY], ["ntp", "optimal"], [0], out, timeout=HANG_GUARD, **kw)
    # the sleeper never finishes: whatever the load, the 3 s timeout kills it
    rows = run_bench([TINY], ["ntp", "optimal", SLEEPY], [0], out, timeout=3, **kw)
    by = {r["planner"]: r for r in rows}
    assert by[SLEEPY]["status"] == "timeout"
    assert by[SLEEPY]["gpus"] in (12, None)  # streamed by the task if it loaded in time
    assert by["ntp"]["status"] == "feasible"
    # instances/README.md: ntp gets 0.75 and the optimum is 2 v / 1.01 with
    # v = 0.75 * 1.3**0.65 (relative: divided by R = 2)
    assert by["ntp"]["relative_goodput"] == pytest.approx(0.75)
    assert by["optimal"]["status"] == "optimal"
    assert by["optimal"]["relative_goodput"] == pytest.approx(0.75 * 1.3**0.65 / 1.01, rel=1e-9)
    assert by["optimal"]["validated"] is True
    # killed mid-write: the driver resumes, reruns only the lost run, keeps the rest
    results = out / RESULTS
    lines = results.read_text().splitlines(keepends=True)
    assert len(lines) == 3
    lines.sort(key=lambda x: json.loads(x)["planner"] == "ntp")  # lose ntp's row, not the sleeper's
    results.write_text("".join(lines[:-1]) + lines[-1][:10])
    lost = json.loads(lines[-1])["key"]
    run_bench([TINY], ["ntp", "optimal", SLEEPY], [0], out, timeout=HANG_GUARD, **kw)
    text = results.read_text()
    assert all(line in text for line in lines[:-1])
    keys = [r["key"] for r in read_rows(results)]
    assert len(keys) == 3 == len(set(keys)) and keys[-1] == lost


def test_ray_workers_cap_and_bad_file(tmp_path: Path) -> None:
    bad = tmp_path / "broken.json"
    bad.write_text("{")
    rows = run_bench(
        [bad, TINY],
        ["ntp"],
        [0, 1],
        tmp_path / "out",
        time_limit=HANG_GUARD,
        timeout=HANG_GUARD,
        workers=1,
        progress=False,
        backend="ray",
    )
    assert [r["status"] for r in rows] == ["error", "error", "feasible", "feasible"]
    assert "broken.json" in rows[0]["message"]
