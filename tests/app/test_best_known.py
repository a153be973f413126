"""The best-known table: only improves, checks the file's hash, writes atomically; CLI defaults."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest

from ntp_opt.app import best_known as bk
from ntp_opt.app.bench import read_rows
from ntp_opt.app.cli import main

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "instances" / "tiny.json"
# instances/README.md: the optimum of tiny.json and what the heuristics get
TINY_OPT = 0.75 * 1.3**0.65 / 1.01
TINY_NTP = 0.75


@pytest.fixture
def lib(tmp_path: Path) -> Path:
    """A library folder holding a copy of tiny.json."""
    d = tmp_path / "instances"
    d.mkdir()
    shutil.copy(TINY, d / "tiny.json")
    return d


def _row(file: Path, planner: str, goodput: float | None, bound: float | None = None, **kw: Any):
    row: dict[str, Any] = {
        "instance": "tiny",
        "file": str(file),
        "gpus": 12,
        "failed": 1,
        "planner": planner,
        "seed": 0,
        "status": "feasible",
        "relative_goodput": goodput,
        "bound": bound,
        "validated": goodput is not None,
        "sha256": bk.file_sha256(file),
        "started_at": "2026-01-01T00:00:00+00:00",
    }
    row.update(kw)
    return row


def test_only_improves(lib: Path) -> None:
    f = lib / "tiny.json"
    path = lib / "best_known.json"
    changes = bk.update(path, [_row(f, "ntp", 0.70), _row(f, "optimal", 0.80, bound=0.95)])
    assert changes == [
        "tiny: goodput - -> 0.700000 (ntp)",
        "tiny: goodput 0.700000 -> 0.800000 (optimal)",
        "tiny: bound - -> 0.950000 (optimal)",
    ]
    entry = bk.load(path)["instances"]["tiny"]
    assert (entry["goodput"], entry["goodput_planner"]) == (0.80, "optimal")
    assert (entry["bound"], entry["bound_planner"]) == (0.95, "optimal")
    assert entry["gap"] == pytest.approx((0.95 - 0.80) / 0.95)
    assert entry["file"] == "tiny.json"
    before = path.read_bytes()
    rejected = [
        _row(f, "ntp-pw", 0.79),  # lower goodput
        _row(f, "cpsat", 0.80 + 1e-12, bound=0.96),  # equal within tolerance, higher bound
        _row(f, "ntp", 0.99, validated=False),  # plan not checked by the validator
        _row(f, "ntp", 0.99, status="timeout"),
        _row(f, "ntp", 0.99, status="error"),
        _row(f, "ntp", 0.99, sha256="0" * 64),  # computed on another version of the file
        _row(f, "ntp", None, bound=0.5),  # a heuristic proves no bound
        _row(f, "tests.x:planner", None, bound=0.5),  # nor does a custom planner
        _row(f, "optimal-nopower", 0.6, bound=0.6),  # a bound without boost only
        _row(f, "optimal-megatron", 0.6, bound=0.6),  # a bound of one reduced degree only
    ]
    assert bk.update(path, rejected) == []
    assert path.read_bytes() == before  # nothing changed: not even rewritten
    changes = bk.update(path, [_row(f, "highs", 0.85, bound=0.90), _row(f, "ntp", 0.84)])
    assert len(changes) == 2
    entry = bk.load(path)["instances"]["tiny"]
    assert (entry["goodput"], entry["goodput_planner"], entry["bound"]) == (0.85, "highs", 0.90)
    md = (lib / "best_known.md").read_text()
    assert "| tiny | 12 | 1 | 0.850000 | highs | 0.900000 | highs | 5.56e-02 |" in md
    # the fast planner's bound is proven for the instance as it is: it counts
    assert len(bk.update(path, [_row(f, "fast", 0.84, bound=0.89)])) == 1
    assert bk.load(path)["instances"]["tiny"]["bound_planner"] == "fast"


def test_changed_instance_file_starts_afresh(lib: Path) -> None:
    f = lib / "tiny.json"
    path = lib / "best_known.json"
    bk.update(path, [_row(f, "optimal", 0.9, bound=0.9)])
    data = json.loads(f.read_text())
    data["job"]["global_batch"] = 6
    f.write_text(json.dumps(data))
    changes = bk.update(path, [_row(f, "ntp", 0.5)])  # lower, but on the new file
    assert any("changed" in c for c in changes)
    entry = bk.load(path)["instances"]["tiny"]
    assert (entry["goodput"], entry["bound"]) == (0.5, None)
    assert entry["sha256"] == bk.file_sha256(f)


def test_write_is_atomic(lib: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    f = lib / "tiny.json"
    path = lib / "best_known.json"
    bk.update(path, [_row(f, "ntp", 0.7)])
    before = path.read_bytes()

    def broken(src: Any, dst: Any) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", broken)
    with pytest.raises(OSError, match="disk full"):
        bk.update(path, [_row(f, "optimal", 0.9)])
    assert path.read_bytes() == before
    assert not [p for p in lib.iterdir() if p.name.endswith(".tmp")]


def test_bad_table_names_the_file(tmp_path: Path) -> None:
    p = tmp_path / "best_known.json"
    p.write_text('{"format": "nope"}')
    with pytest.raises(ValueError, match=r"best_known.json: format"):
        bk.load(p)


def test_default_path(lib: Path) -> None:
    large = lib / "large"
    large.mkdir()
    assert bk.default_path(lib / "tiny.json") is None
    (lib / "best_known.json").write_text(json.dumps(bk.empty()))
    assert bk.default_path(lib / "tiny.json") == (lib / "best_known.json").resolve()
    assert bk.default_path(large / "x.json.gz") == (lib / "best_known.json").resolve()


def test_cli_bench_updates_the_default_table(lib: Path, tmp_path: Path, capsys) -> None:
    table = lib / "best_known.json"
    table.write_text(json.dumps(bk.empty()))
    argv = ["bench", str(lib), "--planners", "ntp,optimal", "--time-limit", "600"]  # a hang guard
    assert main([*argv[:3], "ntp", "-o", str(tmp_path / "a"), "--no-best-known"]) == 0
    assert bk.load(table)["instances"] == {}
    assert main([*argv, "-o", str(tmp_path / "b")]) == 0
    assert "3 improvements" in capsys.readouterr().out  # ntp, then optimal and its bound
    rows = read_rows(tmp_path / "b" / "results.jsonl")
    assert [r["instance"] for r in rows] == ["tiny", "tiny"]  # the table is not an instance
    entry = bk.load(table)["instances"]["tiny"]
    assert entry["goodput"] == pytest.approx(TINY_OPT, rel=1e-9)
    assert entry["goodput_planner"] == "optimal"
    assert entry["bound"] == pytest.approx(TINY_OPT, rel=1e-4)
    # an explicit path: a new table, only heuristics, no bound
    other = tmp_path / "elsewhere" / "bk.json"
    assert main([*argv[:3], "ntp", "-o", str(tmp_path / "c"), "--best-known", str(other)]) == 0
    entry = bk.load(other)["instances"]["tiny"]
    assert entry["goodput"] == pytest.approx(TINY_NTP) and entry["bound"] is None
    assert "| tiny | 12 | 1 | 0.750000 | ntp | - | - | - |" in other.with_suffix(".md").read_text()
