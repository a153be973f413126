"""``ntp-opt import slurm`` from saved text: tree topologies, the node-state table, caps, -o.

The real-Slurm counterparts are in ``tests/app/test_import_slurm_live.py``; states a
local slurmctld cannot make (not responding, completing, cloud, ...) are tested
here from recorded text. The hostile inputs each record that the import ends
with one error line after little work: the assertions are on sizes and counts
(the line that fails, the memory traced), never on seconds.
"""

from __future__ import annotations

import json
import os
import re
import stat
import tracemalloc
from pathlib import Path

import pytest

from ntp_opt.app.cli import main
from ntp_opt.app.importers import slurm_nodes, slurm_topology
from ntp_opt.app.importers.compose import PowerDefault
from ntp_opt.app.importers.hostlist import MAX_HOSTS, Budget, HostlistError, expand
from ntp_opt.app.importers.slurm import import_slurm
from ntp_opt.app.importers.slurm_nodes import (
    ALLOW_KINDS,
    STATE_WORDS,
    classify_state,
    read_nodes,
    scontrol,
)
from ntp_opt.app.importers.slurm_topology import read_topology
from ntp_opt.model.files import MAX_NODES, InputError

ROOT = Path(__file__).resolve().parents[2]
GB = ROOT / "tests" / "fixtures" / "import" / "gb200-slurm"
JOB = {"tp": 8, "pp": 1, "dp": 1, "global_batch": 4}

#: ``scontrol show topology`` as Slurm 22.05.8 prints it (copied from the real one,
#: tests/app/test_import_slurm_live.py checks the format): an upper switch lists every
#: node below it besides its Switches.
SCONTROL_TOPOLOGY = """\
SwitchName=leaf1 Level=0 LinkSpeed=1 Nodes=dgx[01-02]
SwitchName=leaf2 Level=0 LinkSpeed=1 Nodes=dgx[03-04],login1
SwitchName=spine Level=1 LinkSpeed=1 Nodes=dgx[01-04],login1 Switches=leaf[1-2]
"""
TOPOLOGY_CONF = """\
# the same tree as topology.conf
SwitchName=leaf1 Nodes=dgx[01-02]
SwitchName=leaf2 Nodes=dgx[03-04],login1 LinkSpeed=1
SwitchName=spine Switches=leaf[1-2]
"""


def node_line(name: str, gres: str = "gpu:h100:8(S:0-1)", state: str = "IDLE", **kw: str) -> str:
    """One ``scontrol show node --oneliner`` record (fields in scontrol's order)."""
    reason = f" Reason={kw['reason']}" if "reason" in kw else ""
    return (
        f"NodeName={name} Arch=x86_64 CoresPerSocket=56 CPUAlloc=0 Gres={gres} "
        f"NodeAddr={name} NodeHostName={name} Version=22.05.8 State={state} "
        f"ThreadsPerCore=2 Partitions=batch{reason}\n"
    )


def dgx_nodes(states: dict[str, str] | None = None, gres: str = "gpu:h100:8(S:0-1)") -> str:
    states = states or {}
    text = "".join(node_line(h, gres, states.get(h, "IDLE")) for h in DGX)
    return text + node_line("login1", "(null)")


DGX = ["dgx01", "dgx02", "dgx03", "dgx04"]


def quiet(_: str) -> None:
    pass


def _kinds(G: object) -> dict[str, dict[str, dict[str, object]]]:
    out: dict[str, dict[str, dict[str, object]]] = {}
    for n, d in G.nodes(data=True):  # type: ignore[attr-defined]
        out.setdefault(d["kind"], {})[n] = d
    return out


# --- tree topologies --------------------------------------------------------------


@pytest.mark.parametrize("text", [SCONTROL_TOPOLOGY, TOPOLOGY_CONF])
def test_tree_dgx_each_host_a_domain_leaf_a_rack(text: str, tmp_path: Path) -> None:
    (tmp_path / "topo.txt").write_text(text)
    (tmp_path / "nodes.txt").write_text(dgx_nodes())
    warnings: list[str] = []
    G = import_slurm(tmp_path / "topo.txt", tmp_path / "nodes.txt", warn=warnings.append)
    k = _kinds(G)
    assert {d: v["size"] for d, v in k["domain"].items()} == {f"{h}/nvlink": 8 for h in DGX}
    assert set(k["rack"]) == {"leaf1", "leaf2"}
    assert set(G["dgx03"]) >= {"leaf2", "dgx03/nvlink"}
    assert len(k["gpu"]) == 32 and set(k["tray"]) == set(DGX)  # login1 (no GPU) left out
    assert k["rack"]["leaf1"]["power_budget_w"] == 16 * 700.0  # H100 SXM from the Gres type
    assert any("each 8-GPU host is taken as one NVLink domain" in w for w in warnings)


def test_tree_scontrol_and_conf_agree(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text(SCONTROL_TOPOLOGY)
    (tmp_path / "b.conf").write_text(TOPOLOGY_CONF)
    a, b = read_topology(tmp_path / "a.txt"), read_topology(tmp_path / "b.conf")
    assert [(x.name, x.hosts, x.kind) for x in a] == [(x.name, x.hosts, x.kind) for x in b]
    assert [(x.name, x.hosts) for x in a] == [
        ("leaf1", ["dgx01", "dgx02"]),
        ("leaf2", ["dgx03", "dgx04", "login1"]),
    ]


TOPOLOGY_YAML = """\
- topology: ib
  cluster_default: true
  tree:
    switches:
      - switch: spine
        children: leaf[1-2]
      - switch: leaf1
        nodes: dgx[01-02]
      - switch: leaf2
        nodes: dgx[03-04],login1
- topology: flat
  flat: true
"""


def test_tree_from_topology_yaml(tmp_path: Path) -> None:
    """topology.yaml's tree section (newer Slurm) reads as topology.conf does."""
    (tmp_path / "topology.yaml").write_text(TOPOLOGY_YAML)
    (tmp_path / "b.conf").write_text(TOPOLOGY_CONF)
    a, b = read_topology(tmp_path / "topology.yaml"), read_topology(tmp_path / "b.conf")
    assert [(x.name, x.hosts, x.kind) for x in a] == [(x.name, x.hosts, x.kind) for x in b]
    assert a[0].where.endswith("topology.yaml:7")
    # a block topology beside the tree is preferred; --topology-name picks the tree
    both = TOPOLOGY_YAML + "- topology: nvl\n  block:\n    blocks:\n      - block: b\n" \
        "        nodes: dgx[01-04]\n"  # fmt: skip
    (tmp_path / "topology.yaml").write_text(both)
    assert [x.kind for x in read_topology(tmp_path / "topology.yaml")] == ["block"]
    picked = read_topology(tmp_path / "topology.yaml", topology_name="ib")
    assert [x.name for x in picked] == ["leaf1", "leaf2"]
    (tmp_path / "topology.yaml").write_text(TOPOLOGY_YAML.replace("nodes: dgx[01-02]", "x: 1"))
    with pytest.raises(InputError, match=r"topology\.yaml:7: switch 'leaf1' has neither"):
        read_topology(tmp_path / "topology.yaml")


def test_tree_nodes_on_an_upper_switch_form_their_own_leaf(tmp_path: Path) -> None:
    p = tmp_path / "t.conf"
    p.write_text("SwitchName=l1 Nodes=a[1-2]\nSwitchName=top Nodes=b1 Switches=l1\n")
    assert [(b.name, b.hosts) for b in read_topology(p)] == [("l1", ["a1", "a2"]), ("top", ["b1"])]


#: Block b01 of the GB200 fixture names no GPU product without its XML files.
GB200_POWER = PowerDefault(1200.0, 1200.0)


def _gb200_tree(tmp_path: Path) -> tuple[Path, Path]:
    topo = tmp_path / "topology.conf"
    topo.write_text(
        "SwitchName=rack1 Nodes=gb-[001-018]\nSwitchName=rack2 Nodes=gb-[019-036]\n"
        "SwitchName=ib Switches=rack[1-2]\n"
    )
    lines = (GB / "nodes.txt").read_text().splitlines()
    nodes = tmp_path / "nodes.txt"
    nodes.write_text("\n".join(ln for ln in lines if not ln.startswith("NodeName=login")) + "\n")
    return topo, nodes


def test_tree_gb200_needs_a_choice(tmp_path: Path) -> None:
    topo, nodes = _gb200_tree(tmp_path)
    with pytest.raises(InputError, match=r"topology\.conf:1: topology/tree says nothing about "
                       r"NVLink, and host gb-001 has 4 GPUs.*--nvlink leaf"):  # fmt: skip
        import_slurm(topo, nodes, warn=quiet, power=GB200_POWER)
    G = import_slurm(topo, nodes, warn=quiet, nvlink="leaf", power=GB200_POWER)
    k = _kinds(G)
    assert {d: v["size"] for d, v in k["domain"].items()} == {"rack1": 72, "rack2": 72}
    assert set(k["rack"]) == {"rack1/rack", "rack2/rack"}
    H = import_slurm(topo, nodes, warn=quiet, nvlink="host", power=GB200_POWER)
    assert len(_kinds(H)["domain"]) == 36 and set(_kinds(H)["rack"]) == {"rack1", "rack2"}


def test_nvlink_is_refused_with_blocks(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="--nvlink is for topology/tree"):
        import_slurm(GB / "topology.conf", GB / "nodes.txt", warn=quiet, nvlink="host")


@pytest.mark.parametrize(
    ("text", "pattern"),
    [
        ("BlockName=b1 Nodes=dgx01\nSwitchName=s Nodes=dgx02\n", r":2: BlockName= and SwitchName="),
        ("SwitchName=s Switches=t\n", r":1: switch 's' lists an undefined switch 't'"),
        ("SwitchName=a Switches=b\nSwitchName=b Switches=a\n", r"is below itself"),
        ("SwitchName=s\n", r":1: switch 's' has neither Nodes= nor Switches="),
        (
            "SwitchName=l Nodes=dgx01\nSwitchName=a Switches=l\nSwitchName=b Switches=l\n",
            r":3: switch 'l' is below both 'a' and 'b'",
        ),
        ("SwitchName=s Nodes=dgx01\nSwitchName=s Nodes=dgx02\n", r":2: switch 's' defined twice"),
        ("SwitchName=s Nodes=dgx01 Speed=4\n", r"unknown parameter\(s\) on a switch line: speed"),
        (
            "SwitchName=a Nodes=dgx01\nSwitchName=b Nodes=dgx01\n",
            r":2: host dgx01 of switch .b. is also in switch .a.",
        ),
        ("SwitchName=a Nodes=dgx09\n", r":1: unknown host dgx09 in switch 'a'.*--future"),
        ("SwitchName=a Nodes=login1\n", r"topo\.txt: no GPU host in the topology"),
    ],
)
def test_bad_trees(text: str, pattern: str, tmp_path: Path) -> None:
    (tmp_path / "topo.txt").write_text(text)
    (tmp_path / "nodes.txt").write_text(dgx_nodes())
    with pytest.raises(InputError, match=pattern):
        import_slurm(tmp_path / "topo.txt", tmp_path / "nodes.txt", warn=quiet)


def test_deep_switch_chain(tmp_path: Path) -> None:
    """100,000 switches, each below the next: read without recursion."""
    n = 100_000
    lines = [f"SwitchName=s{i} Switches=s{i + 1}\n" for i in range(n)]
    (tmp_path / "t.conf").write_text("".join(lines) + f"SwitchName=s{n} Nodes=dgx01\n")
    assert [(b.name, b.hosts) for b in read_topology(tmp_path / "t.conf")] == [(f"s{n}", ["dgx01"])]


# --- node states ----------------------------------------------------------------------

#: Recorded State= values (the issue's list, Slurm 22.05-24.x) -> usable by default,
#: usable with every --allow kind.
STATES = [
    ("IDLE", True, True),
    ("MIXED", True, True),
    ("ALLOCATED", True, True),
    ("ALLOCATED+COMPLETING", True, True),
    ("IDLE+COMPLETING", True, True),
    ("IDLE+PLANNED", True, True),
    ("IDLE+CLOUD", True, True),
    ("IDLE+INVALID_REG", False, False),
    ("IDLE+MAINTENANCE+RESERVED", False, True),
    ("IDLE+RESERVED", False, True),
    ("IDLE+REBOOT_REQUESTED", False, True),
    ("DOWN+DRAIN+REBOOT_ISSUED", False, False),
    ("IDLE+POWERED_DOWN", False, True),
    ("IDLE+CLOUD+POWERED_DOWN", False, True),
    ("IDLE+POWERING_UP", False, True),
    ("IDLE+DRAIN+POWERED_DOWN", False, False),
    ("FAIL", False, False),
    ("IDLE+FAIL", False, False),
    ("ALLOCATED+FAIL", False, False),
    ("FUTURE", False, False),
    ("UNKNOWN", False, False),
    ("IDLE+NOT_RESPONDING", False, False),
    ("IDLE*", False, False),
    ("MIXED~", False, True),
    ("idle$", False, True),
    ("DOWN*+DRAIN", False, False),
    ("ERROR", False, False),
    ("IDLE+DYNAMIC_FUTURE", False, False),
    ("IDLE+EXTERNAL", False, False),
    ("drained", False, False),
    ("draining", False, False),
    ("inval", False, False),
    ("IDLE+WEIRD_NEW_FLAG", False, False),
    ("", False, False),
]


@pytest.mark.parametrize(("state", "usable", "allowed"), STATES)
def test_state_classification(state: str, usable: bool, allowed: bool) -> None:
    assert classify_state(state).usable is usable
    assert classify_state(state, tuple(ALLOW_KINDS)).usable is allowed


def test_state_reasons_name_the_words_and_the_allow() -> None:
    v = classify_state("IDLE+MAINTENANCE+RESERVED")
    assert v.why == "MAINTENANCE: in a maintenance reservation; RESERVED: in an advance reservation"
    assert v.allow == ("reserved",)
    assert classify_state("DOWN+POWERED_DOWN").allow == ()  # DOWN stays whatever is allowed
    assert classify_state("IDLE+WEIRD").unknown == ("WEIRD",)


def test_unknown_word_warns_and_fails_the_host(tmp_path: Path) -> None:
    (tmp_path / "topo.conf").write_text("BlockName=b Nodes=dgx[01-04]\n")
    (tmp_path / "nodes.txt").write_text(dgx_nodes({"dgx02": "IDLE+SHINY", "dgx03": "IDLE*"}))
    warnings: list[str] = []
    G = import_slurm(tmp_path / "topo.conf", tmp_path / "nodes.txt", warn=warnings.append)
    failed = {d["host"] for _, d in G.nodes(data=True) if d.get("state") == "failed"}
    assert failed == {"dgx02", "dgx03"}
    assert any(
        "word(s) SHINY this importer does not know: taken as unusable" in w for w in warnings
    )
    assert any(
        "host dgx03 is IDLE* in Slurm (NOT_RESPONDING: not responding)" in w for w in warnings
    )


def _doc_state_table() -> dict[str, str]:
    """The node-state table of docs/import.md: word -> its column (usable / unusable / --allow)."""
    text = (ROOT / "docs" / "import.md").read_text()
    start = text.index("| state word |")
    rows: dict[str, str] = {}
    for line in text[start:].splitlines()[2:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        for word in re.findall(r"`([A-Z_]+)`", cells[0]):
            rows[word] = cells[1]
    return rows


def test_docs_state_table_is_the_code_table() -> None:
    doc = _doc_state_table()
    assert set(doc) == set(STATE_WORDS)
    for word, (use, _) in STATE_WORDS.items():
        want = use if use in ("usable", "unusable") else f"--allow {use}"
        assert doc[word] == want, word


# --- caps: hostile inputs end early ------------------------------------------------------


def _traced(fn: object) -> tuple[BaseException, int]:
    """The exception ``fn()`` raises and the peak memory it traced, in bytes."""
    tracemalloc.start()
    try:
        try:
            fn()  # type: ignore[operator]
        except (InputError, HostlistError) as err:
            return err, tracemalloc.get_traced_memory()[1]
        raise AssertionError("no error")
    finally:
        tracemalloc.stop()


def test_hostlist_long_prefix_times_a_million(tmp_path: Path) -> None:
    p = tmp_path / "topology.conf"
    p.write_text(f"BlockName=b Nodes={'x' * 20_000}[0-999999]\n")
    err, peak = _traced(lambda: read_topology(p))
    assert "makes names of up to 20006 characters, more than 255" in str(err)
    assert peak < 2_000_000  # refused before one name was made (the line is 20 kB)
    # short names, but a prefix that makes the total too long
    with pytest.raises(HostlistError, match="characters of host names a file may expand to"):
        expand(f"{'x' * 200}[0-999999]")


def test_hostlist_budget_is_per_file(tmp_path: Path) -> None:
    p = tmp_path / "topology.conf"
    p.write_text("".join(f"BlockName=b{i} Nodes=n{i}x[0-999999]\n" for i in range(60)))
    msg = r"expands to 1000000 names: more than the 1000000 host names a file may expand to"
    with pytest.raises(InputError, match=r"topology\.conf:2: bad hostlist: .* " + msg):
        read_topology(p)
    b = Budget()
    assert len(expand("a[1-3],b", b)) == 4 and b.names == MAX_HOSTS - 4
    assert MAX_HOSTS == MAX_NODES  # a file names no more hosts than an instance holds nodes


@pytest.mark.parametrize(
    ("gres", "pattern"),
    [
        ("gpu:100000000", r"counts more GPUs than an instance may have nodes \(1000000\)"),
        ("gpu:99999999999999999999", r"counts more GPUs than an instance may have nodes"),
        ("gpu:a:600000,gpu:b:600000", r"counts more GPUs"),
    ],
)
def test_gres_beyond_the_node_cap(gres: str, pattern: str, tmp_path: Path) -> None:
    (tmp_path / "topo.conf").write_text("BlockName=b Nodes=dgx01\n")
    (tmp_path / "nodes.txt").write_text(node_line("dgx01", gres))
    err, peak = _traced(
        lambda: import_slurm(tmp_path / "topo.conf", tmp_path / "nodes.txt", warn=quiet)
    )
    assert re.search(r"nodes\.txt:1: Gres '.*' " + pattern, str(err)), str(err)
    assert peak < 2_000_000


def test_cluster_beyond_the_node_cap_is_refused_at_import(tmp_path: Path) -> None:
    (tmp_path / "topo.conf").write_text("BlockName=b Nodes=dgx[01-02]\n")
    (tmp_path / "nodes.txt").write_text(
        node_line("dgx01", "gpu:600000") + node_line("dgx02", "gpu:600000")
    )
    err, peak = _traced(
        lambda: import_slurm(tmp_path / "topo.conf", tmp_path / "nodes.txt", warn=quiet)
    )
    assert "the cluster would have 1200004 nodes (GPUs, hosts, domains, racks): more than an " \
        "instance may hold (1000000)" in str(err)  # fmt: skip
    assert peak < 2_000_000  # refused before one GPU node was built


YAML_HEAD = "- topology: t\n  block:\n    blocks:\n"


def test_yaml_alias_bomb(tmp_path: Path) -> None:
    p = tmp_path / "topology.yaml"
    aliases = ", ".join(["*a"] * 200)
    p.write_text(YAML_HEAD + f"      - block: x\n        nodes: [&a 'n[0-999999]', {aliases}]\n")
    assert p.stat().st_size < 1000  # the 888-byte file: 200 million names
    with pytest.raises(InputError, match=r"topology\.yaml:\d+: more than 100 YAML aliases"):
        read_topology(p)
    # fewer aliases, each a million names: the hostlist budget stops the second
    p.write_text(YAML_HEAD + "      - block: x\n        nodes: [&a 'n[0-999999]', *a, *a]\n")
    with pytest.raises(InputError, match=r"topology\.yaml:5: bad hostlist: .* 1000000 names"):
        read_topology(p)


def test_yaml_deep_nesting(tmp_path: Path) -> None:
    p = tmp_path / "topology.yaml"
    p.write_text("[" * 200_000 + "]" * 200_000)
    with pytest.raises(InputError, match=r"topology\.yaml:1: YAML nested more than 64 deep"):
        read_topology(p)


def test_yaml_size_cap(tmp_path: Path) -> None:
    p = tmp_path / "topology.yaml"
    pad = "#" * slurm_topology.MAX_YAML_BYTES
    p.write_text(YAML_HEAD + "      - block: b\n        nodes: n1\n" + pad)
    with pytest.raises(InputError, match=r"topology\.yaml: file is \d+ bytes, more than 1048576"):
        read_topology(p)


def test_continuation_lines_are_read_in_linear_time(tmp_path: Path) -> None:
    """800k continuation lines: a quadratic join took 35 s; this one reads them once."""
    p = tmp_path / "nodes.txt"
    with p.open("w") as fh:
        fh.write("NodeName=dgx01 Gres=gpu:8 State=IDLE\n")
        fh.writelines("   X=1\n" for _ in range(800_000))
    (node,) = read_nodes(p)
    assert (node.name, node.gpus, node.state) == ("dgx01", 8, "IDLE")


# --- --live: scontrol bounded ----------------------------------------------------------------


def _fake_scontrol(tmp_path: Path, body: str, monkeypatch: pytest.MonkeyPatch) -> None:
    d = tmp_path / "bin"
    d.mkdir(exist_ok=True)
    exe = d / "scontrol"
    exe.write_text("#!/bin/sh\n" + body + "\n")
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", str(d) + os.pathsep + os.environ.get("PATH", ""))
    monkeypatch.delenv("SLURM_CONF", raising=False)


def test_scontrol_failing_slow_and_flooding(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _fake_scontrol(
        tmp_path,
        'echo "slurm_load_node error: Unable to contact slurm controller" >&2; exit 1',
        monkeypatch,
    )
    with pytest.raises(InputError, match=r"^scontrol show node: exit status 1: slurm_load_node "
                       r"error: Unable to contact slurm controller$"):  # fmt: skip
        scontrol("show", "node")
    _fake_scontrol(tmp_path, "exec sleep infinity", monkeypatch)  # never answers
    with pytest.raises(InputError, match=r"scontrol show node: did not finish within 0\.2 s"):
        scontrol("show", "node", timeout=0.2)
    _fake_scontrol(tmp_path, "exec yes NodeName=x", monkeypatch)
    monkeypatch.setattr(slurm_nodes, "MAX_INPUT_BYTES", 1 << 20)
    with pytest.raises(InputError, match=r"scontrol show node: printed more than 1048576 bytes"):
        scontrol("show", "node")
    _fake_scontrol(tmp_path, f"cat {tmp_path / 'out.txt'}", monkeypatch)
    (tmp_path / "out.txt").write_text(dgx_nodes())
    assert [n.name for n in read_nodes(scontrol("show", "node"))] == [*DGX, "login1"]


def test_cli_live_with_a_fake_scontrol(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "nodes.txt").write_text(dgx_nodes({"dgx04": "DOWN+NOT_RESPONDING"}))
    (tmp_path / "topo.txt").write_text(SCONTROL_TOPOLOGY)
    script = (
        f'case "$2" in node) cat {tmp_path / "nodes.txt"};; '
        f"topology) cat {tmp_path / 'topo.txt'};; *) exit 1;; esac"
    )
    _fake_scontrol(tmp_path, script, monkeypatch)
    (tmp_path / "job.json").write_text(json.dumps(JOB))
    out = tmp_path / "inst.json"
    argv = ["import", "slurm", "--live", "--job", str(tmp_path / "job.json"), "-o", str(out)]
    assert main(argv) == 0
    assert "32 GPUs (8 failed) on 4 hosts, 4 NVLink domains, 2 racks" in capsys.readouterr().out
    meta = json.loads(out.read_text())["meta"]
    assert meta["nodes"] == "scontrol show node --oneliner --future"
    assert meta["topology"] == "scontrol show topology"
    assert main([*argv[:3], "--nodes", str(tmp_path / "nodes.txt"), *argv[3:]]) == 2
    assert "--nodes is a saved file" in capsys.readouterr().err
    assert main(["import", "slurm", "--job", str(tmp_path / "job.json"), "-o", str(out)]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "ntp-opt: error: import slurm: --topology and --nodes required (or --live)"
    ]


# --- -o never onto an input ----------------------------------------------------------------


def _slurm_argv(d: Path, out: Path) -> list[str]:
    return [
        "import", "slurm", "--topology", str(d / "topology.conf"), "--nodes", str(d / "nodes.txt"),
        "--nvidia-smi", str(d / "nvidia-smi"), "--job", str(d / "job.json"), "-o", str(out),
    ]  # fmt: skip


def _k8s_argv(d: Path, out: Path) -> list[str]:
    return [
        "import", "k8s", "--nodes", str(d / "nodes.json"), "--nvidia-smi", str(d / "nvidia-smi"),
        "--rack-label", "example.com/rack", "--job", str(d / "job.json"), "-o", str(out),
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("kind", "target"),
    [
        ("slurm", "nodes.txt"),
        ("slurm", "topology.conf"),
        ("slurm", "job.json"),
        ("slurm", "nvidia-smi/gb-001.xml"),
        ("slurm", "link"),
        ("k8s", "nodes.json"),
        ("k8s", "job.json"),
        ("k8s", "nvidia-smi/dgx-h100-01.xml"),
    ],
)
def test_output_onto_an_input_is_refused(
    kind: str, target: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import shutil

    src = GB if kind == "slurm" else ROOT / "tests" / "fixtures" / "import" / "h100-k8s"
    d = tmp_path / "d"
    shutil.copytree(src, d)
    if target == "link":
        os.link(d / "nodes.txt", d / "link")  # a hard link to an input
    out = d / target
    before = out.read_bytes()
    argv = _slurm_argv(d, out) if kind == "slurm" else _k8s_argv(d, out)
    assert main(argv) == 2
    err = capsys.readouterr().err.splitlines()
    assert err == [f"ntp-opt: error: {out}: refusing to write: the output is an input file of "
                   "this command"]  # fmt: skip
    assert out.read_bytes() == before


# --- the recorded DGX tree (tests/fixtures/import/dgx-tree) ------------------------------


def test_recorded_dgx_tree(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Real Slurm 22.05 output (the test cluster, names substituted): 4 DGX-like nodes."""
    d = ROOT / "tests" / "fixtures" / "import" / "dgx-tree"
    out = tmp_path / "dgx.json"
    argv = ["import", "slurm", "--topology", str(d / "topology.txt"), "--tdp-w", "700", "--nodes"]
    assert main([*argv, str(d / "nodes.txt"), "--job", str(d / "job.json"), "-o", str(out)]) == 0
    captured = capsys.readouterr()
    assert "32 GPUs (16 failed) on 4 hosts, 4 NVLink domains, 2 racks" in captured.out
    assert "host dgx-02 is DOWN in Slurm (DOWN: down)" in captured.err
    assert "host dgx-04 is drained for a GPU reason ('GPU 3 Xid 79" in captured.err
    inst = json.loads(out.read_text())
    racks = {n["id"] for n in inst["cluster"]["nodes"] if n["kind"] == "rack"}
    assert racks == {"nvl0", "nvl1"}
