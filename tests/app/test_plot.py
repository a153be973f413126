"""Pictures of a plan (ntp_opt.app.plotting): the artists drawn, the CLI, the HTML page."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from ntp_opt.app.cli import main
from ntp_opt.model.files import load_instance, load_plan, save_plan
from ntp_opt.model.plan import Plan, Replica, Stage
from ntp_opt.rules.validate import evaluate
from ntp_opt.workflows.simulate import SimResult, SimStep
from tests.helpers import make_instance

matplotlib = pytest.importorskip("matplotlib")
matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.colors import to_hex  # noqa: E402

from ntp_opt.app import plotting as nplot  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "instances" / "tiny.json"
TINY_PLAN = ROOT / "instances" / "plans" / "tiny-optimal.json"
BIG = ROOT / "instances" / "paper-nvl32-32k-0.4pct.json.gz"


@pytest.fixture
def tiny():
    # tiny: racks r0, r1, r2 hold domains d0, d1, d2 of 4 GPUs (1000 W each,
    # rack budget 4000 W); d0.t0.g0 failed, d1.t1.g1 a straggler (speed 0.5).
    # The plan: replica 0 on d2 at power 1.0, replica 1 on d0's 3 healthy GPUs
    # at power 1.3; d1 is spare.
    return load_instance(TINY), load_plan(TINY_PLAN)


def _by_gid(ax, gid):
    found = [c for c in ax.collections if c.get_gid() == gid]
    assert len(found) == 1, gid
    return found[0]


def _stage(domain, gpus, power=1.0):
    return Stage(domain, tuple(gpus), power)


def test_plan_map_tiny_artists(tiny):
    inst, plan = tiny
    fig, ax = plt.subplots()
    assert nplot.plot_plan(inst, plan, ax=ax) is ax
    cells = _by_gid(ax, "gpus")
    colors = Counter(to_hex(c) for c in cells.get_facecolors())
    assert sum(colors.values()) == 12
    assert colors.pop(nplot.SPARE_COLOR) == 4  # d1, straggler included
    assert colors.pop(nplot.FAILED_COLOR) == 1  # d0.t0.g0
    # what is left: the two replicas, 4 and 3 GPUs, each one colour
    assert sorted(colors.values()) == [3, 4]
    assert len(_by_gid(ax, "failed").get_segments()) == 2  # one cross
    assert len(_by_gid(ax, "stragglers").get_paths()) == 1
    assert len(_by_gid(ax, "boosted").get_paths()) == 3
    assert len(_by_gid(ax, "moved").get_paths()) == 0
    watts = [t.get_text() for t in ax.texts if t.get_gid() == "watts"]
    assert watts == ["1300 W"]  # 1000 W tdp x 1.3, one label per boosted stage
    plt.close(fig)


def test_replica_colours_differ_and_stages_shade():
    hues = {nplot.replica_color(r) for r in range(16)}
    assert len(hues) == 16
    assert nplot.replica_color(3, 0, 4) != nplot.replica_color(3, 3, 4)
    assert nplot.replica_color(-1) == nplot.SPARE_COLOR


def test_plan_map_colour_per_replica_and_stage():
    # 2 replicas x 2 stages on a 4-domain cluster: four distinct colours, and
    # every GPU of a stage has its stage's colour
    inst = make_instance(domains=4, size=4, tray=2, tp=4, pp=2, dp=2, global_batch=8)
    d = inst.arrays.domain_ids
    gpus = [[inst.arrays.gpu_ids[g] for g in inst.arrays.domain_gpus[i]] for i in range(4)]
    plan = Plan(
        inst.name,
        (
            Replica(4, 4, (_stage(d[0], gpus[0]), _stage(d[1], gpus[1]))),
            Replica(4, 4, (_stage(d[2], gpus[2]), _stage(d[3], gpus[3]))),
        ),
    )
    fig, ax = plt.subplots()
    nplot.plot_plan(inst, plan, ax=ax, level="gpu")
    colors = Counter(to_hex(c) for c in _by_gid(ax, "gpus").get_facecolors())
    assert sorted(colors.values()) == [4, 4, 4, 4]
    assert set(colors) == {nplot.replica_color(r, s, 2) for r in (0, 1) for s in (0, 1)}
    plt.close(fig)


def test_domain_level_one_cell_per_domain_and_rack():
    inst = make_instance(domains=16, size=8, tray=4, failed=5, stragglers=3, seed=4)
    a = inst.arrays
    plan = Plan(inst.name, ())
    fig, ax = plt.subplots()
    nplot.plot_plan(inst, plan, ax=ax, level="domain")
    pairs = {(int(r), int(d)) for r, d in zip(a.gpu_rack, a.gpu_domain, strict=True)}
    assert len(_by_gid(ax, "domains").get_paths()) == len(pairs)
    failed_pairs = {
        (int(r), int(d))
        for r, d, h in zip(a.gpu_rack, a.gpu_domain, a.healthy, strict=True)
        if not h
    }
    assert len(_by_gid(ax, "failed").get_segments()) == 2 * len(failed_pairs)
    slow_pairs = {
        (int(r), int(d)) for r, d, s in zip(a.gpu_rack, a.gpu_domain, a.speed, strict=True) if s < 1
    }
    assert len(_by_gid(ax, "stragglers").get_paths()) == len(slow_pairs) > 0
    plt.close(fig)


def test_rack_power_bars_are_the_rack_sums(tiny):
    inst, plan = tiny
    fig, ax = plt.subplots()
    nplot.plot_rack_power(inst, plan, ax=ax)
    heights = [b.get_height() for b in ax.containers[0]]
    # r0: 3 GPUs x 1300 W, failed 0; r1: 4 spares x 100 W idle; r2: 4 x 1000 W
    assert heights == pytest.approx([3.9, 0.4, 4.0])
    assert heights == pytest.approx([w / 1e3 for w in evaluate(inst, plan).rack_power_w])
    budget = _by_gid(ax, "rack_budget")
    assert [seg[0][1] for seg in budget.get_segments()] == pytest.approx([4.0, 4.0, 4.0])
    plt.close(fig)


def test_rack_power_over_budget_is_red(tiny):
    inst, _ = tiny
    gpus = ("d2.t0.g0", "d2.t0.g1", "d2.t1.g0", "d2.t1.g1")
    plan = Plan("tiny", (Replica(4, 8, (_stage("d2", gpus, 1.3),)),))
    fig, ax = plt.subplots()
    nplot.plot_rack_power(inst, plan, ax=ax)
    bars = list(ax.containers[0])
    assert bars[2].get_height() == pytest.approx(5.2)  # 4 x 1300 W > 4000 W
    assert to_hex(bars[2].get_facecolor()) == "#d62728"
    assert to_hex(bars[1].get_facecolor()) != "#d62728"
    plt.close(fig)


def test_diff_marks_moved_gpus(tiny):
    inst, old = tiny
    d2 = ("d2.t0.g0", "d2.t0.g1", "d2.t1.g0", "d2.t1.g1")
    # replica on d0 moves to d1; the d2 replica stays but is renumbered
    new = Plan(
        "tiny",
        (
            Replica(3, 4, (_stage("d1", ("d1.t0.g0", "d1.t0.g1", "d1.t1.g0"), 1.3),)),
            Replica(4, 4, (_stage("d2", d2),)),
        ),
    )
    lay = nplot.plan_layout(inst, new, diff=old)
    moved = {inst.arrays.gpu_ids[g] for g in np.flatnonzero(lay.moved)}
    assert moved == {
        "d0.t0.g1",
        "d0.t1.g0",
        "d0.t1.g1",
        "d1.t0.g0",
        "d1.t0.g1",
        "d1.t1.g0",
    }
    assert not nplot.plan_layout(inst, old, diff=old).moved.any()
    fig, ax = plt.subplots()
    nplot.plot_plan(inst, new, ax=ax, diff=old)
    assert len(_by_gid(ax, "moved").get_paths()) == 6
    plt.close(fig)


def test_unknown_gpu_is_a_clear_error(tiny):
    inst, _ = tiny
    plan = Plan("tiny", (Replica(3, 4, (_stage("d0", ("d0.t0.g1", "nope", "d0.t1.g1")),)),))
    with pytest.raises(ValueError, match=r"replicas\[0\].stages\[0\].gpus: GPU 'nope' is not in"):
        nplot.plan_layout(inst, plan)


def test_goodput_over_time_steps():
    steps = (
        SimStep(0.0, 0.98, 0, None, "optimal"),
        SimStep(10.0, 0.95, 2, None, "optimal"),
        SimStep(30.0, 0.97, 1, None, "optimal"),
    )
    res = SimResult("ntp", 40.0, (0.98 * 10 + 0.95 * 20 + 0.97 * 10) / 40, 0.0, 3, 3, steps)
    fig, ax = plt.subplots()
    nplot.plot_goodput_over_time(res, ax=ax)
    (line,) = [ln for ln in ax.lines if ln.get_gid() == "goodput"]
    assert list(line.get_xdata()) == [0.0, 10.0, 30.0, 40.0]
    assert list(line.get_ydata()) == [0.98, 0.95, 0.97, 0.97]
    assert line.get_drawstyle() == "steps-post"
    (mean,) = [ln for ln in ax.lines if ln.get_gid() == "mean"]
    assert mean.get_ydata()[0] == pytest.approx(0.9625)
    lo, hi = ax.get_ylim()
    assert 0.9 < lo < 0.95 and 0.98 < hi < 1.0  # zoomed to the data, not 0..1
    plt.close(fig)


# ----------------------------------------------------------------------- CLI


def test_cli_plot_svg_png_html_and_diff(tmp_path, capsys):
    for suffix in ("svg", "png", "html"):
        out = tmp_path / f"p.{suffix}"
        assert main(["plot", str(TINY), str(TINY_PLAN), "-o", str(out)]) == 0
        data = out.read_bytes()
        assert data
    assert b"<svg" in (tmp_path / "p.svg").read_bytes()
    assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    page = (tmp_path / "p.html").read_text()
    assert "http://" not in page.replace("http://www.w3.org/2000/svg", "")
    assert "https://" not in page and "<link" not in page and " src=" not in page
    out = tmp_path / "d.html"
    assert main(["plot", str(TINY), str(TINY_PLAN), "-o", str(out), "--diff", str(TINY_PLAN)]) == 0
    data = json.loads(
        re.search(r'type="application/json">(.*?)</script>', out.read_text()).group(1)
    )
    assert data["diff"] is True and sum(data["gpu"]["moved"]) == 0


def test_cli_plot_bad_suffix_is_one_line(tmp_path, capsys):
    assert main(["plot", str(TINY), str(TINY_PLAN), "-o", str(tmp_path / "p.txt")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("ntp-opt: error: ") and ".html" in err[0]


def test_cli_plot_plan_of_other_instance(tmp_path, capsys):
    other = tmp_path / "o.json"
    plan = Plan(
        "x",
        (Replica(1, 1, (_stage("d0", ("zz",)),)),),
        {"goodput": 1.0, "relative_goodput": 1.0},
    )
    save_plan(plan, other)
    assert main(["plot", str(TINY), str(other), "-o", str(tmp_path / "p.svg")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    want = f"ntp-opt: error: {other}: replicas[0].stages[0].gpus: GPU 'zz' is not in instance"
    assert len(err) == 1 and err[0].startswith(want)


# --------------------------------------------------------- HTML in Chromium


def _chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    return None


@pytest.fixture(scope="module")
def chromium():
    path = _chromium()
    if path is None:
        if os.environ.get("CI") == "true":
            pytest.fail("CI=true but chromium is missing (.ci/run installs it)")
        pytest.skip("chromium is not installed (apt-get install chromium); runs in CI")
    return path


def _run_chromium(browser: str, url: str, tmp: Path, *args: str) -> tuple[str, list[str]]:
    """Run headless Chromium on ``url``; returns stdout and the page's console lines."""
    proc = subprocess.run(
        [
            browser,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--hide-scrollbars",
            "--no-first-run",
            f"--user-data-dir={tmp / 'profile'}",
            "--window-size=1280,900",
            "--enable-logging=stderr",
            "--v=0",
            *args,
            url,
        ],
        capture_output=True,
        text=True,
        timeout=600,  # a hang guard only; nothing is asserted on time
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    console = [ln for ln in proc.stderr.splitlines() if ":CONSOLE" in ln]
    return proc.stdout, console


def _check_page(browser: str, page: Path, tmp: Path, racks: int, rack_id: str, gpus: int):
    url = page.as_uri() + f"#rack={rack_id}"
    shot = tmp / "shot.png"
    dom, console = _run_chromium(browser, url, tmp, f"--screenshot={shot}", "--dump-dom")
    assert console == []
    assert dom.count('class="rack"') == racks
    assert dom.count('class="gpu"') == gpus  # the drill-down of that rack
    from PIL import Image

    rgb = np.asarray(Image.open(shot).convert("RGB"))
    img = rgb.astype(float)
    assert img.shape[0] > 100 and img.std() > 20  # not blank
    # distinct colours, each (r, g, b) as one 24-bit integer (np.unique(axis=0) on
    # the pixel rows counts the same but sorts a million rows: seconds per page)
    colours = (
        (rgb[..., 0].astype(np.int64) << 16) | (rgb[..., 1].astype(np.int64) << 8) | rgb[..., 2]
    )
    assert len(np.unique(colours)) > 20
    return dom


def test_console_error_detection_works(chromium, tmp_path):
    bad = tmp_path / "bad.html"
    bad.write_text("<html><body>x<script>console.error('boom'); nope();</script></body></html>")
    _, console = _run_chromium(chromium, bad.as_uri(), tmp_path, "--dump-dom")
    assert len(console) == 2 and "boom" in console[0] and "nope" in console[1]


def test_html_tiny_in_chromium(chromium, tmp_path):
    page = tmp_path / "tiny.html"
    assert main(["plot", str(TINY), str(TINY_PLAN), "-o", str(page)]) == 0
    _check_page(chromium, page, tmp_path, racks=3, rack_id="r0", gpus=4)


def test_html_diff_in_chromium(chromium, tmp_path):
    # the d0 replica (boosted to 1.3) moves to d1; the page opened at rack r1
    new = Plan(
        "tiny",
        (
            Replica(3, 4, (_stage("d1", ("d1.t0.g0", "d1.t0.g1", "d1.t1.g0"), 1.3),)),
            Replica(4, 4, (_stage("d2", ("d2.t0.g0", "d2.t0.g1", "d2.t1.g0", "d2.t1.g1")),)),
        ),
    )
    new = new.with_metrics(**evaluate(load_instance(TINY), new).as_metrics())
    plan_file = tmp_path / "new.json"
    save_plan(new, plan_file)
    page = tmp_path / "diff.html"
    argv = ["plot", str(TINY), str(plan_file), "-o", str(page), "--diff", str(TINY_PLAN)]
    assert main(argv) == 0
    dom = _check_page(chromium, page, tmp_path, racks=3, rack_id="r1", gpus=4)
    # moved: racks r0 and r1 in the overview, the 3 used GPUs of d1 in the drill-down
    assert dom.count(f'stroke="{nplot.MOVED_EDGE}"') == 2 + 3
    # boosted: rack r1 in the overview and its 3 GPUs at 1300 W
    assert dom.count(f'stroke="{nplot.BOOST_EDGE}"') == 1 + 3
    assert dom.count(">1300 W<") == 3


def test_html_32k_in_chromium(chromium, tmp_path):
    from ntp_opt import solve

    inst = load_instance(BIG)
    plan = solve(inst, "fast").plan
    plan_file = tmp_path / "plan.json"
    save_plan(plan, plan_file)
    page = tmp_path / "big.html"
    assert main(["plot", str(BIG), str(plan_file), "-o", str(page)]) == 0
    assert len(inst.arrays.rack_ids) == 1024
    _check_page(chromium, page, tmp_path, racks=1024, rack_id="r1023", gpus=32)


def test_plot_module_imports_without_matplotlib():
    # the HTML page needs no matplotlib; the module imports it lazily
    code = (
        "import sys; sys.modules['matplotlib'] = None\n"
        "import ntp_opt.app.plotting as p\n"
        "try:\n"
        "    p.plot_plan(None, None)\n"
        "except ImportError as e:\n"
        "    print(e)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert "pip install 'ntp-opt[plot]'" in out


# ------------------------------------------------------- bench figures


def _row(inst, planner, g, gap=None, gpus=8, runtime=1.0):
    return {
        "instance": inst,
        "planner": planner,
        "relative_goodput": g,
        "gap": gap,
        "gpus": gpus,
        "runtime_s": runtime,
        "status": "optimal" if gap == 0 else "feasible",
    }


BENCH_ROWS = [
    _row("a", "ntp", 0.99),
    _row("a", "optimal", 0.995, gap=0.0),
    _row("a", "dp-drop", 0.0),
    _row("b", "ntp", 0.5),
    _row("b", "ntp", 0.7),  # two seeds: mean 0.6
    _row("b", "optimal", 0.8, gap=0.01),
]


def test_bench_goodput_losses_by_hand():
    from ntp_opt.app.bench import goodput_losses

    got = goodput_losses(BENCH_ROWS)
    assert got[("a", "optimal")] == 0.0 and got[("b", "optimal")] == 0.0
    assert got[("a", "ntp")] == pytest.approx(100 * (1 - 0.99 / 0.995))  # 0.5025 %
    assert got[("a", "dp-drop")] == pytest.approx(100.0)
    assert got[("b", "ntp")] == pytest.approx(25.0)  # 1 - 0.6 / 0.8


def test_bench_figures_are_labelled(tmp_path, monkeypatch):
    from ntp_opt.app.bench import LOSS_FLOOR, plot_gap, plot_goodput

    captured = []
    monkeypatch.setattr(plt, "close", captured.append)  # keep the figures to inspect
    plot_goodput(BENCH_ROWS, tmp_path / "goodput.png", plt)
    plot_gap(BENCH_ROWS, tmp_path / "gap.png", plt)
    monkeypatch.undo()
    good, gap = captured
    ax = good.axes[0]
    assert ax.get_title() and ax.get_xlabel()
    assert [t.get_text() for t in ax.get_yticklabels()] == ["a (8 GPUs)", "b (8 GPUs)"]
    xs = sorted(float(x) for c in ax.collections for x, _ in c.get_offsets())
    want = sorted([LOSS_FLOOR, 100 * (1 - 0.99 / 0.995), 100.0, 25.0, LOSS_FLOOR])
    assert xs == pytest.approx(want)
    lo, hi = ax.get_xlim()
    assert lo == 0 and hi >= 100
    left, right = gap.axes
    assert left.get_title() and right.get_title() and left.get_xlabel() and right.get_ylabel()
    assert [t.get_text() for t in left.get_yticklabels()] == ["a", "b"]
    assert (tmp_path / "goodput.png").read_bytes()[:4] == b"\x89PNG"
    plt.close(good)
    plt.close(gap)


# ------------------------------------------- NTP on the pictures, hostile input


def _hostile_tiny(tmp: Path, **swap: str) -> tuple[Path, Path]:
    """tiny.json and its plan with ids swapped: ``{"d0": "<!--<script>"}`` renames ``"d0"``."""
    inst, plan = TINY.read_text(), TINY_PLAN.read_text()
    for old, new in swap.items():
        inst = inst.replace(json.dumps(old), json.dumps(new))
        plan = plan.replace(json.dumps(old), json.dumps(new))
    (tmp / "i.json").write_text(inst)
    (tmp / "p.json").write_text(plan)
    return tmp / "i.json", tmp / "p.json"


def test_map_shows_trays_tp_and_dp_ranks(tiny):
    # tiny: 6 trays of 2 GPUs; replica 0 on d2 at TP 4, replica 1 on d0 at TP 3
    # (reduced, job.tp = 4): 3 reduced GPUs, one label per stage "0.0", "1.0"
    inst, plan = tiny
    fig, ax = plt.subplots(figsize=(11, 8))
    nplot.plot_plan(inst, plan, ax=ax)
    assert len(_by_gid(ax, "trays").get_paths()) == 6
    assert len(_by_gid(ax, "reduced").get_paths()) == 3
    assert sorted(t.get_text() for t in ax.texts if t.get_gid() == "dp_rank") == ["0.0", "1.0"]
    assert "2 replicas (DP), TP 4, 1 reduced (TP 3 x 1)" in ax.get_title()
    plt.close(fig)


def test_cli_plot_reorder_draws_launch_dp_ranks(tmp_path):
    # tiny-optimal lists the TP 4 replica first; --reorder (as export --reorder)
    # makes the reduced TP 3 replica DP rank 0
    def data(*extra):
        out = tmp_path / "p.html"
        assert main(["plot", str(TINY), str(TINY_PLAN), "-o", str(out), *extra]) == 0
        text = out.read_text()
        return json.loads(re.search(r'type="application/json">(.*?)</script>', text).group(1))

    plain, reordered = data(), data("--reorder")
    g = plain["gpu"]["id"].index("d0.t0.g1")
    assert (plain["tp"], plain["gpu"]["rep"][g]) == ([4, 3], 1)
    assert (reordered["tp"], reordered["gpu"]["rep"][g]) == ([3, 4], 0)
    assert reordered["tp_summary"].startswith("2 replicas (DP), TP 4, 1 reduced (TP 3 x 1)")


def test_html_escapes_script_in_data(tmp_path):
    inst, plan = _hostile_tiny(tmp_path, d0="<!--<script>", r1="</script><b>x")
    out = tmp_path / "p.html"
    assert main(["plot", str(inst), str(plan), "-o", str(out)]) == 0
    block = re.search(r'type="application/json">(.*?)</script>', out.read_text(), re.S).group(1)
    assert "<" not in block and ">" not in block
    data = json.loads(block)
    assert data["racks"][0]["domains"][0]["id"] == "<!--<script>"
    assert data["racks"][1]["id"] == "</script><b>x"


def test_html_hostile_ids_in_chromium(chromium, tmp_path):
    inst, plan = _hostile_tiny(tmp_path, d0="<!--<script>")
    page = tmp_path / "p.html"
    assert main(["plot", str(inst), str(plan), "-o", str(page)]) == 0
    dom = _check_page(chromium, page, tmp_path, racks=3, rack_id="r0", gpus=4)
    assert "domain &lt;!--&lt;script&gt; (4 GPUs in this rack)" in dom
    # the rack's replicas as strips: r0 holds replica 1 (reduced, one dot), r2 replica 0
    assert dom.count('class="share"') == 2 and dom.count('class="reduced"') == 1
    assert dom.count('class="host"') == 2 and dom.count('class="tray"') == 2  # r0's 2 trays


def test_plot_dollar_text_is_literal(tmp_path, capsys):
    inst, plan = _hostile_tiny(tmp_path, tiny="$\\frac{$", r0="cost $5 and $6")
    for suffix in ("svg", "png", "pdf"):
        out = tmp_path / f"x.{suffix}"
        assert main(["plot", str(inst), str(plan), "-o", str(out)]) == 0, capsys.readouterr()
    fig = nplot.plan_figure(load_instance(inst), load_plan(plan))
    svg = tmp_path / "text.svg"
    with matplotlib.rc_context({"svg.fonttype": "none"}):  # text kept as text
        fig.savefig(svg)
    plt.close(fig)
    text = svg.read_text()
    assert "cost $5 and $6" in text and "$\\frac{$: 12 GPUs" in text


def test_cli_plot_dpi_is_bounded(tmp_path, capsys):
    out = tmp_path / "x.png"
    assert main(["plot", str(TINY), str(TINY_PLAN), "-o", str(out), "--dpi", "6000"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("ntp-opt: error: --dpi 6000: must be 10 .. 600")
    assert not out.exists()
    assert main(["plot", str(TINY), str(TINY_PLAN), "-o", str(out), "--dpi", "600"]) == 0


def test_html_rack_strips_are_replica_shares_in_chromium(chromium, tmp_path):
    # one rack of two domains of 4 GPUs: replica 0 (TP 4) on domain 0, replica
    # 1 (TP 3, reduced) on 3 GPUs of domain 1; the rack square (56 px) is split
    # 4/8 and 3/8 -> strips 28 and 21 px wide, the reduced one dotted
    inst = make_instance(
        domains=2, size=4, tray=2, trays_per_rack=4, tp=4, pp=1, dp=2, global_batch=8, name="shares"
    )
    a = inst.arrays
    assert len(a.rack_ids) == 1
    gpus = [[a.gpu_ids[g] for g in a.domain_gpus[i]] for i in range(2)]
    plan = Plan(
        inst.name,
        (
            Replica(4, 4, (_stage(a.domain_ids[0], gpus[0]),)),
            Replica(3, 4, (_stage(a.domain_ids[1], gpus[1][:3]),)),
        ),
    )
    from ntp_opt.model.files import save_instance

    plan = plan.with_metrics(**evaluate(inst, plan).as_metrics())
    save_instance(inst, tmp_path / "i.json")
    save_plan(plan, tmp_path / "p.json")
    page = tmp_path / "p.html"
    assert main(["plot", str(tmp_path / "i.json"), str(tmp_path / "p.json"), "-o", str(page)]) == 0
    dom = _check_page(chromium, page, tmp_path, racks=1, rack_id=str(a.rack_ids[0]), gpus=8)
    widths = sorted(float(w) for w in re.findall(r'class="share"[^>]*width="([0-9.]+)"', dom))
    assert widths == [21, 28]
    assert dom.count('class="reduced"') == 1
    assert dom.count('class="host"') == 4  # 4 trays of 2 GPUs, one row each
    assert "0 failed, 0 stragglers, 1 spare GPUs; no rack over budget" in dom


def test_map_4k_texts_do_not_overlap():
    # default.json: 4,096 GPUs, 3 boosted replicas; no two texts of the map
    # (rack names, DP labels, watts) may overlap once drawn
    from ntp_opt import solve

    inst = load_instance(ROOT / "instances" / "default.json")
    plan = solve(inst, "fast").plan
    fig = nplot.plan_figure(inst, plan)
    fig.canvas.draw()
    ax = fig.axes[0]
    boxes = [t.get_window_extent() for t in ax.texts if t.get_text()]
    assert len([t for t in ax.texts if t.get_gid() == "rack_label"]) == 128
    for i, b in enumerate(boxes):
        for c in boxes[i + 1 :]:
            assert not b.overlaps(c), (b, c)
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert any(t.startswith("boosted (") and " W x " in t for t in legend)
    plt.close(fig)
