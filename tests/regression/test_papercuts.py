"""Small things a new user tripped over (issue 17, item 5), one test each."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ntp_opt import load_instance
from ntp_opt.app.cli import build_parser, main
from ntp_opt.model.files import json_schema
from ntp_opt.solve import solve
from ntp_opt.workflows.replan import ClusterEvent

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "instances" / "tiny.json")
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


def test_solve_all_with_output_is_refused_before_solving(tmp_path, capsys):
    out = tmp_path / "p.json"
    assert main(["solve", TINY, "--planner", "all", "-o", str(out)]) == 2
    cap = capsys.readouterr()
    assert cap.out == ""  # refused up front: nothing loaded, nothing solved
    assert "-o/--output writes one plan: name one --planner" in cap.err
    assert not out.exists()


def test_policy_all_says_which_planners_it_runs(capsys):
    assert main(["solve", TINY, "--policy", "all", "--time-limit", "600"]) == 0
    out = capsys.readouterr().out
    # the five policies of docs/model.md, spec section 5, and the 14 planners of README's table
    assert "dp-drop, ntp, ntp-pw, optimal-nopower, optimal" in out
    assert "any of the 14 planners" in out
    for name in ("dp-drop", "ntp-pw", "optimal-nopower"):
        assert f"│ {name} " in out


def test_schema_into_a_closed_pipe_is_quiet() -> None:
    """`ntp-opt schema instance | head`: the reader is gone before the first write."""
    read, write = os.pipe()
    os.close(read)  # deterministic: every write fails with EPIPE
    try:
        done = subprocess.run(
            [sys.executable, "-m", "ntp_opt.app.cli", "schema", "instance"],
            cwd=ROOT,
            env=ENV,
            stdout=write,
            stderr=subprocess.PIPE,
            text=True,
        )
    finally:
        os.close(write)
    assert done.returncode == 141  # 128 + SIGPIPE, like `yes | head`
    assert done.stderr == ""


def test_switch_without_tier_gets_the_schema_default(tmp_path):
    schema = json_schema("instance")
    assert schema["$defs"]["SwitchNode"]["properties"]["tier"]["default"] == "leaf"
    path = tmp_path / "d.json"
    argv = ["gen", "--builder", "dgx-h100", "--gpus", "64", "--tp", "8", "-o", str(path)]
    assert main(argv) == 0
    data = json.loads(path.read_text())
    switches = [n for n in data["cluster"]["nodes"] if n["kind"] == "switch"]
    assert switches
    for n in switches:
        n.pop("tier", None)
    path.write_text(json.dumps(data))
    inst = load_instance(path)  # was: "attached to switch 'leaf0' of tier None"
    tiers = {d["tier"] for _, d in inst.cluster.nodes(data=True) if d["kind"] == "switch"}
    assert tiers == {"leaf"}


def test_cluster_event_takes_a_single_id():
    assert ClusterEvent("fail", "d2.t0.g0").nodes == ("d2.t0.g0",)
    assert ClusterEvent("fail", 7).nodes == (7,)
    assert ClusterEvent("repair", ["a", "b"]).nodes == ("a", "b")
    with pytest.raises(ValueError, match="at least one"):
        ClusterEvent("fail", [])


def test_replan_without_instance_out_says_how_to_validate(tmp_path, capsys):
    running = tmp_path / "running.json"
    assert main(["solve", TINY, "--policy", "ntp", "-o", str(running)]) == 0
    new, after = tmp_path / "new.json", tmp_path / "after.json"
    # tiny.json: d0.t0.g0 is the failed GPU; once repaired the best plan uses it
    argv = ["replan", TINY, str(running), "--event", "repair:d0.t0.g0", "--tolerance", "0"]
    capsys.readouterr()
    assert main([*argv, "-o", str(new)]) == 0
    out = capsys.readouterr().out
    assert "--instance-out FILE" in out
    # ntp gets 0.75 (instances/README.md); with every GPU healthy the re-plan does better
    assert "relative goodput rose from 0.750000" in out
    assert main(["validate", TINY, str(new)]) == 1  # the hint's reason
    assert "gpu-failed" in capsys.readouterr().out
    assert main([*argv, "-o", str(new), "--instance-out", str(after)]) == 0
    assert "--instance-out FILE" not in capsys.readouterr().out
    assert main(["validate", str(after), str(new)]) == 0


def test_relative_goodput_above_one_is_explained(capsys):
    # GB200 NVL72 with a site budget above the GPUs' TDP: boost beats the nominal,
    # failure-free job (the 1.0561 was optimal's; fast gets above 1 too)
    path = str(ROOT / "instances" / "gb200-nvl72-9k-trays.json.gz")
    res = solve(load_instance(path), "fast")
    assert res.relative_objective is not None and res.relative_objective > 1.01
    assert main(["solve", path, "--policy", "fast"]) == 0
    assert "relative goodput > 1: power boost" in capsys.readouterr().out
    assert main(["solve", TINY, "--policy", "ntp"]) == 0  # 0.75: no footnote
    assert "relative goodput > 1" not in capsys.readouterr().out


def test_cli_and_python_defaults_are_documented():
    solve_help = next(
        a.help
        for a in build_parser()._subparsers._group_actions[0].choices["solve"]._actions  # type: ignore[union-attr]
        if "--planner" in a.option_strings
    )
    assert "default ntp-pw" in solve_help and "solve() defaults to optimal" in solve_help
    readme = (ROOT / "README.md").read_text()
    assert "defaults to `ntp-pw`" in readme


def test_no_progress_bar_when_not_a_terminal(capsys):
    assert main(["compare", TINY, "--policies", "ntp"]) == 0
    cap = capsys.readouterr()
    assert "ETA" not in cap.err and "tiny" in cap.out
    assert main(["compare", TINY, "--policies", "ntp", "--quiet"]) == 0
