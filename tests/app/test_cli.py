"""The ntp-opt command line: the documented workflow and clear errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ntp_opt.app.cli import main

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "instances" / "tiny.json")


def test_gen_solve_validate_evaluate(tmp_path, capsys):
    inst = tmp_path / "i.json"
    plan = tmp_path / "p.json"
    assert (
        main(
            [
                "gen",
                "--builder",
                "nvl32",
                "--gpus",
                "512",
                "--fail-count",
                "3",
                "--stragglers",
                "2",
                "--tp",
                "32",
                "--pp",
                "2",
                "--batch-policy",
                "elastic",
                "-o",
                str(inst),
            ]
        )
        == 0
    )
    assert "512 GPUs (3 failed, 2 stragglers)" in capsys.readouterr().out
    assert main(["solve", str(inst), "--policy", "ntp", "-o", str(plan)]) == 0
    out = capsys.readouterr().out
    assert "ntp" in out and f"wrote {plan}" in out
    assert main(["validate", str(inst), str(plan)]) == 0
    assert "valid plan" in capsys.readouterr().out
    assert main(["evaluate", str(inst), str(plan), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["feasible"] is True and 0 < data["relative_goodput"] <= 1
    assert data["relative_goodput"] == pytest.approx(
        json.loads(plan.read_text())["metrics"]["relative_goodput"]
    )


def test_solve_all_and_compare(capsys):
    assert main(["solve", TINY, "--planner", "all"]) == 0
    out = capsys.readouterr().out
    for name in ("dp-drop", "ntp", "ntp-pw"):
        assert name in out
    assert main(["compare", TINY]) == 0
    assert "0.7500" in capsys.readouterr().out


def test_planner_options_and_their_old_names(tmp_path, capsys):
    # --planner / --planners are the documented options; --policy / --policies (their
    # names before issue 34) still work, to the same effect, and are not listed
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    assert main(["solve", TINY, "--planner", "ntp", "-o", str(a)]) == 0
    assert main(["solve", TINY, "--policy", "ntp", "-o", str(b)]) == 0
    new, old = json.loads(a.read_text()), json.loads(b.read_text())
    assert new["metrics"]["policy"] == "ntp" and new["replicas"] == old["replicas"]
    capsys.readouterr()
    assert main(["compare", TINY, "--planners", "dp-drop,ntp"]) == 0
    listed = capsys.readouterr().out
    assert main(["compare", TINY, "--policies", "dp-drop,ntp"]) == 0
    assert capsys.readouterr().out == listed and "ntp-pw" not in listed
    for args, shown, hidden in (
        (["solve", "--help"], "--planner", "--policy"),
        (["compare", "--help"], "--planners", "--policies"),
        (["watch", "k8s", "--help"], "--planner", "--policy"),
    ):
        with pytest.raises(SystemExit):
            main(args)
        text = capsys.readouterr().out
        assert shown in text and hidden not in text


def test_validate_reports_violations(tmp_path, capsys):
    plan = json.loads((ROOT / "instances" / "plans" / "tiny-optimal.json").read_text())
    plan["replicas"][1]["stages"][0]["gpus"][0] = "d0.t0.g0"  # the failed GPU
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(plan))
    assert main(["validate", TINY, str(path)]) == 1
    out = capsys.readouterr().out
    assert "[gpu-failed] replica 1 stage 0: GPU 'd0.t0.g0' has failed" in out


@pytest.mark.parametrize(
    ("content", "expect"),
    [
        ("{not json", "malformed JSON at line 1"),
        (
            '{"format": "ntp-opt/instance@1", "name": "x", "cluster": {"nodes": []}, '
            '"job": {"tp": 0, "pp": 1, "dp": 1, "global_batch": 1}}',
            "job.tp",
        ),
    ],
)
def test_bad_input_one_clear_line(tmp_path, capsys, content, expect):
    path = tmp_path / "bad.json"
    path.write_text(content)
    assert main(["info", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"ntp-opt: error: {path}: ")
    assert expect in err
    assert "Traceback" not in err


def test_bad_arguments(tmp_path, capsys):
    assert (
        main(
            [
                "gen",
                "--builder",
                "nvl32",
                "--gpus",
                "100",
                "--tp",
                "32",
                "-o",
                str(tmp_path / "x.json"),
            ]
        )
        == 2
    )
    assert "multiple of the nvl32 domain size (32)" in capsys.readouterr().err
    assert main(["gen", "--gpus", "64", "--tp", "64", "-o", str(tmp_path / "x.json")]) == 2
    assert "job.tp=64 is larger than" in capsys.readouterr().err
    assert main(["solve", str(tmp_path / "missing.json")]) == 2
    assert "cannot read file" in capsys.readouterr().err


def test_schema_command(capsys):
    assert main(["schema", "plan"]) == 0
    schema = json.loads(capsys.readouterr().out)
    assert schema["properties"]["format"]["const"] == "ntp-opt/plan@1"


def test_console_script_help():
    out = subprocess.run(
        [sys.executable, "-m", "ntp_opt.app.cli", "--help"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    for cmd in ("gen", "solve", "validate", "evaluate", "compare", "schema", "examples:"):
        assert cmd in out
