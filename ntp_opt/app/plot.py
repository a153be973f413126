"""Pictures of a plan: the GPU map, rack power, goodput over time.

The functions draw on a matplotlib ``Axes`` (``ax``; a new figure when
``None``) and return it, so they compose into any figure::

    fig, (top, bottom) = plt.subplots(2, 1)
    plot_plan(instance, plan, ax=top)
    plot_rack_power(instance, plan, ax=bottom)

matplotlib is only needed here (``pip install 'ntp-opt[plot]'``); it is
imported when a function is called. :func:`plan_html` needs nothing: it writes
one self-contained HTML page (inline SVG and JavaScript, no network access)
with an overview per rack and a drill-down to the domains and GPUs of a rack.

What the map shows (``docs/plot.md``):

- the title gives the degrees (DP, TP and the reduced replicas by degree, PP);
- every GPU is a square, grouped by tray (host, outlined) and NVLink domain
  inside its rack; its colour is its replica (hue) and pipeline stage
  (shade); replica ``r`` is DP rank ``r`` (labelled ``r.stage`` where legible);
- GPUs of a reduced replica (TP below ``job.tp``) carry a black dot;
- failed GPUs are crossed, stragglers (``speed < 1``) hatched, healthy GPUs
  the plan does not use (spares) grey;
- GPUs of a boosted stage (power multiplier above 1) have an orange edge and,
  when the map is small enough to read, a label with their watts
  (``tdp_w`` times the multiplier);
- with ``diff=OLD_PLAN``, GPUs whose role changed (see :func:`plan_layout`)
  have a magenta edge.

Above :data:`GPU_LEVEL_MAX` GPUs the map draws one cell per domain (per rack
part of a domain) instead, coloured by the replica holding most of its GPUs,
crossed when it holds a failed GPU, hatched when it holds a straggler.
"""

from __future__ import annotations

import colorsys
import html
import json
import math
from collections import Counter
from collections.abc import Hashable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from ntp_opt.model.instance import Instance
from ntp_opt.model.plan import Plan
from ntp_opt.rules.validate import evaluate

if TYPE_CHECKING:  # pragma: no cover
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

    from ntp_opt.workflows.simulate import SimResult

__all__ = [
    "FIGURE_SIZE_IN",
    "GPU_LEVEL_MAX",
    "PlanLayout",
    "plan_figure",
    "plan_html",
    "plan_layout",
    "plot_goodput_over_time",
    "plot_plan",
    "plot_rack_power",
    "replica_color",
    "tp_summary",
]

GPU_LEVEL_MAX = 4096
"""Largest cluster :func:`plot_plan` draws GPU by GPU with ``level="auto"``."""

SPARE_COLOR = "#c8c8c8"
FAILED_COLOR = "#ffffff"
BOOST_EDGE = "#ff7f0e"
MOVED_EDGE = "#d62fd6"
FIGURE_SIZE_IN = (11, 10)
"""Width and height of :func:`plan_figure` in inches."""
LABEL_MAX = 64
"""Boost labels (watts) are written on the map only up to this many boosted stage parts."""

USED, SPARE, FAILED = 0, 1, 2
STATE_NAMES = ("used", "spare", "failed")


def _pyplot() -> Any:
    try:
        import matplotlib.pyplot as plt
    except ImportError:  # pragma: no cover - depends on the environment
        raise ImportError(
            "ntp_opt.plot needs matplotlib: pip install 'ntp-opt[plot]'", name="matplotlib"
        ) from None
    return plt


def replica_color(replica: int, stage: int = 0, n_stages: int = 1) -> str:
    """The colour of a replica's stage, as ``#rrggbb``.

    Replicas get hues spread by the golden ratio (neighbours differ most);
    later stages of a replica are darker shades of its hue.

    Parameters
    ----------
    replica
        Replica index (0-based); negative means unused (spare grey).
    stage
        Stage index in the replica.
    n_stages
        Stages of the replica.

    Returns
    -------
    str
    """
    if replica < 0:
        return SPARE_COLOR
    hue = (replica * 0.618033988749895) % 1.0
    value = 0.95 - 0.4 * (stage / (n_stages - 1) if n_stages > 1 else 0.0)
    r, g, b = colorsys.hsv_to_rgb(hue, 0.6, value)
    return f"#{round(r * 255):02x}{round(g * 255):02x}{round(b * 255):02x}"


@dataclass(frozen=True, eq=False)
class PlanLayout:
    """Per-GPU view of a plan on its instance (arrays in GPU order).

    Attributes
    ----------
    replica, stage
        Replica and stage index of every GPU; -1 when the plan does not use it.
    multiplier
        Power multiplier of the GPU's stage; 0 when unused.
    watts
        Power the GPU runs at: ``tdp_w * multiplier`` when used, the idle draw
        ``idle_power_fraction * tdp_w`` for a healthy spare, 0 when failed.
    state
        ``USED`` (0), ``SPARE`` (1) or ``FAILED`` (2).
    straggler
        ``speed < 1``.
    boosted
        Used with a multiplier above 1.
    moved
        Role changed against ``diff`` (all False without it).
    n_stages
        Stages of every replica.
    tp
        TP degree of every replica (in plan order: replica ``r`` is DP rank ``r``).
    tp_base
        The job's nominal degree ``job.tp``; a replica with ``tp < tp_base``
        is *reduced*.
    """

    replica: np.ndarray
    stage: np.ndarray
    multiplier: np.ndarray
    watts: np.ndarray
    state: np.ndarray
    straggler: np.ndarray
    boosted: np.ndarray
    moved: np.ndarray
    n_stages: tuple[int, ...]
    tp: tuple[int, ...] = ()
    tp_base: int = 0

    @property
    def reduced(self) -> np.ndarray:
        """Per GPU: used by a replica running below ``tp_base``."""
        tps = np.asarray((*self.tp, self.tp_base), dtype=np.int64)
        return (self.replica >= 0) & (tps[self.replica] < self.tp_base)

    def color(self, g: int) -> str:
        """Fill colour of GPU ``g``."""
        if self.state[g] == FAILED:
            return FAILED_COLOR
        r = int(self.replica[g])
        return replica_color(r, int(self.stage[g]), self.n_stages[r] if r >= 0 else 1)


def _assignment(instance: Instance, plan: Plan) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    a = instance.arrays
    replica = np.full(a.n_gpus, -1, dtype=np.int64)
    stage = np.full(a.n_gpus, -1, dtype=np.int64)
    mult = np.zeros(a.n_gpus, dtype=float)
    for r, rep in enumerate(plan.replicas):
        for s, st in enumerate(rep.stages):
            for gid in st.gpus:
                g = a.gpu_index.get(gid)
                if g is None:
                    raise ValueError(
                        f"replicas[{r}].stages[{s}].gpus: GPU {gid!r} is not in instance "
                        f"{instance.name!r}"
                    )
                replica[g], stage[g], mult[g] = r, s, float(st.power)
    return replica, stage, mult


def _moved(
    replica: np.ndarray, stage: np.ndarray, old_replica: np.ndarray, old_stage: np.ndarray
) -> np.ndarray:
    # Replicas are matched to the old replica sharing most GPUs with them, so a
    # renumbering alone moves nothing.
    match: dict[int, int] = {}
    used = replica >= 0
    for r in np.unique(replica[used]):
        olds = old_replica[(replica == r) & (old_replica >= 0)]
        match[int(r)] = int(np.bincount(olds).argmax()) if len(olds) else -2
    mapped = np.array([match.get(int(r), -1) if r >= 0 else -1 for r in replica], dtype=np.int64)
    return (mapped != old_replica) | (stage != old_stage)


def plan_layout(instance: Instance, plan: Plan, diff: Plan | None = None) -> PlanLayout:
    """Where every GPU is in ``plan``: replica, stage, power, state.

    Parameters
    ----------
    instance
        The instance.
    plan
        A plan for it (every GPU it names must be in the instance).
    diff
        An earlier plan for the same cluster. A GPU has *moved* when it
        became used or unused, or its stage index or replica changed;
        replicas are matched to the earlier replica that shares most of
        their GPUs, so renumbering replicas moves nothing.

    Returns
    -------
    PlanLayout

    Raises
    ------
    ValueError
        A plan names a GPU that is not in the instance.
    """
    a = instance.arrays
    replica, stage, mult = _assignment(instance, plan)
    state = np.where(~a.healthy, FAILED, np.where(replica >= 0, USED, SPARE)).astype(np.int64)
    idle = instance.job.idle_power_fraction
    watts = np.where(replica >= 0, mult, np.where(a.healthy, idle, 0.0)) * a.tdp
    if diff is None:
        moved = np.zeros(a.n_gpus, dtype=bool)
    else:
        old_r, old_s, _ = _assignment(instance, diff)
        moved = _moved(replica, stage, old_r, old_s)
    return PlanLayout(
        replica=replica,
        stage=stage,
        multiplier=mult,
        watts=watts,
        state=state,
        straggler=a.speed < 1.0,
        boosted=(replica >= 0) & (mult > 1.0 + 1e-9),
        moved=moved,
        n_stages=tuple(len(rep.stages) for rep in plan.replicas),
        tp=tuple(int(rep.tp) for rep in plan.replicas),
        tp_base=int(instance.job.tp),
    )


def tp_summary(plan: Plan, tp_base: int) -> str:
    """The degree line of the headers: ``8 replicas (DP), TP 32, 3 reduced (TP 31 x 3)``.

    Parameters
    ----------
    plan
        The plan.
    tp_base
        The job's nominal degree ``job.tp``.

    Returns
    -------
    str
    """
    n = plan.n_replicas
    if n == 0:
        return "no replica (paused)"
    low = sorted((r.tp for r in plan.replicas if r.tp < tp_base), reverse=True)
    text = f"{n} replica{'s' if n != 1 else ''} (DP), TP {tp_base}"
    if not low:
        return text + ", none reduced"
    counts = ", ".join(f"TP {t} x {low.count(t)}" for t in sorted(set(low), reverse=True))
    return text + f", {len(low)} reduced ({counts})"


# ------------------------------------------------------------------ geometry


@dataclass(frozen=True)
class _Part:
    """The GPUs of one domain inside one rack."""

    rack: int
    domain: int
    gpus: np.ndarray


def _parts(instance: Instance) -> list[list[_Part]]:
    """Per rack (in rack order), its domain parts (in domain order)."""
    a = instance.arrays
    order = np.lexsort((np.arange(a.n_gpus), a.gpu_domain, a.gpu_rack))
    racks: list[list[_Part]] = [[] for _ in a.rack_ids]
    key = a.gpu_rack[order] * (a.n_domains + 1) + a.gpu_domain[order]
    starts = np.flatnonzero(np.r_[True, key[1:] != key[:-1]]) if len(order) else np.array([])
    ends = np.r_[starts[1:], len(order)]
    for s, e in zip(starts, ends, strict=True):
        g = order[s:e]
        racks[int(a.gpu_rack[g[0]])].append(
            _Part(int(a.gpu_rack[g[0]]), int(a.gpu_domain[g[0]]), g)
        )
    return racks


def _grid_cols(n: int, cell_w: float, cell_h: float, aspect: float = 2.0) -> int:
    """Columns so that ``n`` blocks of ``cell_w x cell_h`` fill about ``aspect`` : 1."""
    if n <= 0:
        return 1
    return max(1, min(n, round(math.sqrt(n * aspect * cell_h / cell_w))))


def _cross(x: float, y: float, w: float, h: float) -> list[list[tuple[float, float]]]:
    return [[(x, y), (x + w, y + h)], [(x, y + h), (x + w, y)]]


def _lit(text: str) -> str:
    """``text`` as literal matplotlib text: a ``$`` never starts mathtext."""
    return text.replace("$", r"\$")


def _tray_shape(instance: Instance) -> tuple[int, int, int]:
    """(GPU columns of a tray, rows of a tray, trays side by side) on the GPU map."""
    a = instance.arrays
    size = int(np.bincount(a.gpu_tray).max(initial=1)) if a.n_gpus else 1
    width = min(size, 8)
    return width, math.ceil(size / width), max(1, 8 // width)


def plot_plan(
    instance: Instance,
    plan: Plan,
    ax: Axes | None = None,
    diff: Plan | None = None,
    *,
    level: Literal["auto", "gpu", "domain"] = "auto",
    legend: bool = True,
) -> Axes:
    """Draw the rack x domain x tray x GPU map of a plan.

    Parameters
    ----------
    instance
        The instance.
    plan
        A plan for it; replica ``r`` is drawn as DP rank ``r`` (reorder the
        plan first, e.g. with :func:`ntp_opt.megatron.megatron_order`, to see
        the ranks of a ``--reorder`` export).
    ax
        Axes to draw on (a new figure when ``None``).
    diff
        An earlier plan: GPUs that moved get a magenta edge (:func:`plan_layout`).
    level
        ``"gpu"``: one square per GPU, trays (hosts) outlined; ``"domain"``:
        one cell per domain part of a rack (dominant replica's colour);
        ``"auto"``: ``"gpu"`` up to :data:`GPU_LEVEL_MAX` GPUs.
    legend
        Draw the legend (below the map).

    Returns
    -------
    matplotlib.axes.Axes
        The axes; its collections carry gids ``"gpus"`` (or ``"domains"``),
        ``"trays"`` (one outline per tray, GPU level), ``"failed"`` (two
        segments per cross), ``"stragglers"``, ``"boosted"``, ``"reduced"``
        (a dot per GPU or cell of a reduced replica) and ``"moved"``. Every
        text is literal (a ``$`` in a name is not mathtext).
    """
    plt = _pyplot()
    from matplotlib.collections import LineCollection, PatchCollection
    from matplotlib.lines import Line2D
    from matplotlib.patches import Circle, Patch, Rectangle

    if ax is None:
        _, ax = plt.subplots(figsize=(10, 6))
    a = instance.arrays
    lay = plan_layout(instance, plan, diff)
    reduced = lay.reduced
    racks = _parts(instance)
    if level == "auto":
        level = "gpu" if a.n_gpus <= GPU_LEVEL_MAX else "domain"
    if level not in ("gpu", "domain"):
        raise ValueError(f"level must be 'auto', 'gpu' or 'domain', not {level!r}")

    # Block sizes: a rack is a column of domain parts; at the GPU level a part
    # is a grid of trays (each a tw x th block of GPU squares, `per` side by
    # side), at the domain level one cell.
    tw, th, per = _tray_shape(instance)
    tgap, pgap = 0.3, 0.7

    def part_trays(part: _Part) -> list[np.ndarray]:
        gpus = part.gpus[np.argsort(a.gpu_tray[part.gpus], kind="stable")]
        cut = np.flatnonzero(np.diff(a.gpu_tray[gpus])) + 1
        return list(np.split(gpus, cut))

    if level == "gpu":
        trays = [[part_trays(p) for p in parts] for parts in racks]
        heights = [
            sum(math.ceil(len(t) / per) * (th + tgap) for t in rt) + pgap * max(0, len(rt) - 1)
            for rt in trays
        ]
        block_w = per * tw + (per - 1) * tgap
    else:
        trays = []
        heights = [float(len(parts)) for parts in racks]
        block_w = 1.0
    block_h = max(heights, default=1.0) or 1.0
    gap = 0.25 * block_w if level == "domain" else 2.0
    cols = _grid_cols(len(racks), block_w + gap, block_h + gap)

    rects: list[Rectangle] = []
    colors: list[str] = []
    crosses: list[list[tuple[float, float]]] = []
    hatch_rects: list[Rectangle] = []
    boost_rects: list[Rectangle] = []
    moved_rects: list[Rectangle] = []
    tray_rects: list[Rectangle] = []
    part_rects: list[Rectangle] = []
    dots: list[Circle] = []
    labels: list[tuple[float, float, str]] = []
    ranks: list[tuple[float, float, str]] = []
    rack_labels: list[tuple[float, float, str]] = []

    def gpu_square(g: int, x: float, yy: float, seen: set[tuple[int, int, int]], pi: int) -> None:
        rects.append(Rectangle((x + 0.05, yy + 0.05), 0.9, 0.9))
        colors.append(lay.color(g))
        if lay.state[g] == FAILED:
            crosses.extend(_cross(x + 0.15, yy + 0.15, 0.7, 0.7))
        if lay.straggler[g]:
            hatch_rects.append(Rectangle((x + 0.05, yy + 0.05), 0.9, 0.9))
        if reduced[g]:
            dots.append(Circle((x + 0.78, yy + 0.78), 0.13))
        if lay.moved[g]:
            moved_rects.append(Rectangle((x + 0.1, yy + 0.1), 0.8, 0.8))
        r, s = int(lay.replica[g]), int(lay.stage[g])
        if r >= 0 and (r, s, pi) not in seen:  # first GPU of a stage in a domain part
            seen.add((r, s, pi))
            ranks.append((x + 0.5, yy + 0.5, f"{r}.{s}"))
            if lay.boosted[g] and (r, s, -1) not in seen:
                seen.add((r, s, -1))
                labels.append((x + 0.5, yy + 0.5, f"{lay.watts[g]:.0f} W"))
        if lay.boosted[g]:
            boost_rects.append(Rectangle((x + 0.05, yy + 0.05), 0.9, 0.9))

    seen: set[tuple[int, int, int]] = set()
    pi = 0
    for ri, parts in enumerate(racks):
        x0 = (ri % cols) * (block_w + gap)
        y0 = (ri // cols) * (block_h + gap)
        rack_labels.append((x0, y0, str(a.rack_ids[ri])))
        y = y0
        for k_part, part in enumerate(parts):
            gpus = part.gpus
            if level == "gpu":
                pt = trays[ri][k_part]
                h = math.ceil(len(pt) / per) * (th + tgap) - tgap
                part_rects.append(Rectangle((x0 - 0.15, y - 0.15), block_w + 0.3, h + 0.3))
                for t, tg in enumerate(pt):
                    tx = x0 + (t % per) * (tw + tgap)
                    ty = y + (t // per) * (th + tgap)
                    tray_rects.append(
                        Rectangle((tx, ty), min(len(tg), tw), math.ceil(len(tg) / tw))
                    )
                    for k, g in enumerate(tg):
                        gpu_square(int(g), tx + k % tw, ty + k // tw, seen, pi)
                pi += 1
                y += h + tgap + pgap
            else:
                rects.append(Rectangle((x0, y), 0.9, 0.9))
                used = lay.replica[gpus]
                used = used[used >= 0]
                if len(used):
                    r = int(np.bincount(used).argmax())
                    stages = lay.stage[gpus][lay.replica[gpus] == r]
                    s = int(np.bincount(stages).argmax())
                    colors.append(replica_color(r, s, lay.n_stages[r]))
                elif (lay.state[gpus] == FAILED).all():
                    colors.append(FAILED_COLOR)
                else:
                    colors.append(SPARE_COLOR)
                if (lay.state[gpus] == FAILED).any():
                    crosses.extend(_cross(x0 + 0.1, y + 0.1, 0.7, 0.7))
                if lay.straggler[gpus].any():
                    hatch_rects.append(Rectangle((x0, y), 0.9, 0.9))
                if lay.boosted[gpus].any():
                    boost_rects.append(Rectangle((x0, y), 0.9, 0.9))
                if reduced[gpus].any():
                    dots.append(Circle((x0 + 0.7, y + 0.7), 0.15))
                if lay.moved[gpus].any():
                    moved_rects.append(Rectangle((x0 + 0.08, y + 0.08), 0.74, 0.74))
                y += 1.0

    small = len(rects) <= 1024
    if part_rects:
        pcol = PatchCollection(
            part_rects, facecolors="#eef2f8", edgecolors="#9aa7bd", linewidths=0.5
        )
        pcol.set_gid("domain_parts")
        ax.add_collection(pcol)
    cells = PatchCollection(rects, facecolors=colors, edgecolors="none", linewidths=0)
    cells.set_gid("gpus" if level == "gpu" else "domains")
    ax.add_collection(cells)
    if level == "gpu":
        tcol = PatchCollection(
            tray_rects, facecolors="none", edgecolors="#333333", linewidths=0.8 if small else 0.4
        )
        tcol.set_gid("trays")
        ax.add_collection(tcol)
    hatch = PatchCollection(
        hatch_rects, facecolors="none", edgecolors="#333333", linewidths=0, hatch="////"
    )
    hatch.set_gid("stragglers")
    ax.add_collection(hatch)
    boost = PatchCollection(
        boost_rects, facecolors="none", edgecolors=BOOST_EDGE, linewidths=1.5 if small else 0.6
    )
    boost.set_gid("boosted")
    ax.add_collection(boost)
    moved = PatchCollection(
        moved_rects, facecolors="none", edgecolors=MOVED_EDGE, linewidths=1.5 if small else 0.6
    )
    moved.set_gid("moved")
    ax.add_collection(moved)
    dcol = PatchCollection(dots, facecolors="black", edgecolors="white", linewidths=0.3)
    dcol.set_gid("reduced")
    ax.add_collection(dcol)
    cross = LineCollection(crosses, colors="black", linewidths=1.0 if small else 0.5)
    cross.set_gid("failed")
    ax.add_collection(cross)

    rows = math.ceil(len(racks) / cols) if racks else 1
    width_units = cols * (block_w + gap)
    ax.set_xlim(-gap / 2, width_units - gap / 2)
    ax.set_ylim(rows * (block_h + gap) - gap / 2, -gap / 2)  # rack 0 at the top left
    ax.set_aspect("equal")
    # Text only where it fits: a map unit is about this many points wide.
    fig_w = float(ax.get_figure(root=True).get_size_inches()[0])  # type: ignore[union-attr]
    unit_pt = 72 * fig_w * ax.get_position().width / width_units
    rack_pt = min(
        9.0, (block_w + gap) * unit_pt / max([3, *(len(t) for *_, t in rack_labels)]) * 1.6
    )
    if rack_pt >= 5:
        for x, y, text in rack_labels:
            ax.text(x, y - 0.2, _lit(text), fontsize=rack_pt, va="bottom", gid="rack_label")
    cell_pt = unit_pt * 0.9
    if level == "gpu" and cell_pt >= 9 and len(ranks) <= 512:
        # DP rank.stage on the first GPU of every stage in a domain part
        for x, y, text in ranks:
            ax.text(
                x,
                y,
                text,
                fontsize=min(7.0, cell_pt / 2.2),
                ha="center",
                va="center",
                gid="dp_rank",
            )
    if level == "gpu" and len(labels) <= LABEL_MAX and cell_pt >= 8:
        for x, y, text in labels:
            ax.text(
                x,
                y + 0.9,
                text,
                fontsize=6,
                ha="left",
                va="center",
                color="black",
                gid="watts",
                bbox={"boxstyle": "square,pad=0.1", "fc": "white", "ec": "none", "alpha": 0.8},
            )
    ax.set_xticks([])
    ax.set_yticks([])
    for side in ("top", "right", "bottom", "left"):
        ax.spines[side].set_visible(False)
    what = (
        "one square per GPU, trays outlined" if level == "gpu" else "one cell per domain in a rack"
    )
    ax.set_title(
        _lit(
            f"{instance.name}: {a.n_gpus:,} GPUs in {len(racks)} racks ({what})\n"
            + tp_summary(plan, lay.tp_base)
            + (f", PP {max(lay.n_stages)}" if lay.n_stages else "")
        ),
        fontsize=10,
    )
    if legend:
        watts = Counter(round(float(lay.watts[g])) for g in np.flatnonzero(lay.boosted))
        boost_text = ", ".join(f"{w} W x {n}" for w, n in sorted(watts.items(), reverse=True)[:3])
        if len(watts) > 3:
            boost_text += ", ..."
        handles = [
            Patch(facecolor=replica_color(0), label="replica (hue), stage (shade); label DP.stage"),
            Patch(facecolor=SPARE_COLOR, label=f"spare ({int((lay.state == SPARE).sum())})"),
            Patch(
                facecolor=FAILED_COLOR,
                edgecolor="black",
                label=f"failed, crossed ({int((lay.state == FAILED).sum())})",
            ),
            Patch(
                facecolor="white",
                hatch="////",
                edgecolor="#333333",
                label=f"straggler ({int(lay.straggler.sum())})",
            ),
            Patch(
                facecolor="white",
                edgecolor=BOOST_EDGE,
                label=f"boosted ({int(lay.boosted.sum())} GPUs"
                + (f": {boost_text})" if boost_text else ")"),
            ),
            Line2D(
                [],
                [],
                marker="o",
                ls="none",
                color="black",
                markersize=4,
                label=f"reduced TP, below {lay.tp_base} ({int(reduced.sum())} GPUs)",
            ),
        ]
        if level == "gpu":
            handles.append(Patch(facecolor="none", edgecolor="#333333", label="tray (host)"))
        if diff is not None:
            handles.append(
                Patch(
                    facecolor="white",
                    edgecolor=MOVED_EDGE,
                    label=f"moved vs old plan ({int(lay.moved.sum())})",
                )
            )
        ax.legend(
            handles=handles,
            loc="upper center",
            bbox_to_anchor=(0.5, -0.01),
            ncol=3,
            fontsize=7,
            frameon=False,
        )
    return ax


def plot_rack_power(instance: Instance, plan: Plan, ax: Axes | None = None) -> Axes:
    """Draw every rack's power draw against its budget.

    Bars are the validator's rack sums (:func:`ntp_opt.validate.evaluate`,
    ``rack_power_w``), red when above budget; the black ticks are the budgets.

    Parameters
    ----------
    instance
        The instance.
    plan
        A plan for it.
    ax
        Axes to draw on (a new figure when ``None``).

    Returns
    -------
    matplotlib.axes.Axes
        The bars (``ax.containers[0]``) carry gid ``"rack_power"``, the budget
        ticks ``"rack_budget"``.
    """
    plt = _pyplot()
    if ax is None:
        _, ax = plt.subplots(figsize=(10, 3))
    a = instance.arrays
    ev = evaluate(instance, plan)
    power = np.asarray(ev.rack_power_w, dtype=float) / 1e3
    budget = a.rack_budget / 1e3
    xs = np.arange(len(power))
    over = power > budget * (1 + 1e-6)
    bars = ax.bar(
        xs,
        power,
        width=0.8 if len(xs) <= 256 else 1.0,
        color=np.where(over, "#d62728", "#4c72b0").tolist(),
        linewidth=0,
        label="draw",
    )
    for bar in bars:
        bar.set_gid("rack_power")
    ticks = ax.hlines(budget, xs - 0.45, xs + 0.45, colors="black", linewidths=1.0, label="budget")
    ticks.set_gid("rack_budget")
    ax.set_xlim(-0.6, len(xs) - 0.4)
    ax.set_ylim(0, max(float(budget.max(initial=0)), float(power.max(initial=0))) * 1.08 or 1)
    ax.set_xlabel(f"rack (0 .. {len(xs) - 1}, in instance order)")
    ax.set_ylabel("power (kW)")
    worst = float((power / np.where(budget > 0, budget, np.inf)).max(initial=0))
    ax.set_title(
        f"rack power against budget: site {ev.site_power_w / 1e3:,.1f} of "
        f"{a.site_budget / 1e3:,.1f} kW; fullest rack at {100 * worst:.1f} %"
        + (f"; {int(over.sum())} over budget" if over.any() else ""),
        fontsize=10,
    )
    if len(xs) <= 40:
        ax.set_xticks(xs, [_lit(str(r)) for r in a.rack_ids], rotation=90, fontsize=7)
    ax.legend(fontsize=7, loc="lower right")
    return ax


def plot_goodput_over_time(sim_result: SimResult, ax: Axes | None = None) -> Axes:
    """Draw the relative goodput of a :func:`ntp_opt.simulate` run over time.

    Parameters
    ----------
    sim_result
        The result of :func:`ntp_opt.simulate.simulate`.
    ax
        Axes to draw on (a new figure when ``None``).

    Returns
    -------
    matplotlib.axes.Axes
        The goodput step line carries gid ``"goodput"``, the GPUs down
        ``"failed_gpus"`` (on a twin axis), the time average ``"mean"``.
    """
    plt = _pyplot()
    if ax is None:
        _, ax = plt.subplots(figsize=(8, 3))
    steps = sim_result.steps
    ts = [s.t_hours for s in steps] + [sim_result.horizon_hours]
    gs = [s.relative_goodput for s in steps]
    gs = [*gs, gs[-1]] if gs else [0.0]
    (line,) = ax.step(ts if steps else [0.0], gs, where="post", color="#1f77b4", lw=1.5)
    line.set_gid("goodput")
    line.set_label(f"relative goodput ({sim_result.policy})")
    mean = ax.axhline(
        sim_result.mean_relative_goodput,
        color="#1f77b4",
        ls="--",
        lw=0.8,
        label=f"time average {sim_result.mean_relative_goodput:.4f}",
    )
    mean.set_gid("mean")
    lo = min(gs)
    hi = max(gs)
    pad = max(0.002, 0.1 * (hi - lo))
    ax.set_ylim(max(0.0, lo - pad), hi + pad)
    ax.set_xlim(0, sim_result.horizon_hours)
    ax.set_xlabel("time (hours)")
    ax.set_ylabel("relative goodput")
    twin = ax.twinx()
    down = [s.failed_gpus for s in steps]
    (dl,) = twin.step(
        ts if steps else [0.0],
        [*down, down[-1]] if down else [0],
        where="post",
        color="#7f7f7f",
        lw=0.8,
        label="GPUs down",
    )
    dl.set_gid("failed_gpus")
    twin.set_ylabel("GPUs down", color="#7f7f7f")
    twin.set_ylim(0, max(1, *down) * 1.15 if down else 1)
    ax.set_zorder(twin.get_zorder() + 1)  # the goodput line above the GPUs down
    ax.patch.set_visible(False)
    handles = [line, mean, dl]
    ax.legend(handles=handles, labels=[h.get_label() for h in handles], fontsize=7, loc="best")
    ax.set_title(
        f"{sim_result.policy}: goodput over {sim_result.horizon_hours:g} h, "
        f"{sim_result.replans} re-plans, "
        f"paused {sim_result.paused_hours:g} h",
        fontsize=10,
    )
    return ax


def plan_figure(instance: Instance, plan: Plan, diff: Plan | None = None) -> Figure:
    """A figure with the plan map (top) and rack power (bottom).

    Parameters
    ----------
    instance, plan, diff
        As for :func:`plot_plan`.

    Returns
    -------
    matplotlib.figure.Figure
    """
    plt = _pyplot()
    fig, (top, bottom) = plt.subplots(
        2, 1, figsize=FIGURE_SIZE_IN, gridspec_kw={"height_ratios": [3.2, 1]}, layout="constrained"
    )
    plot_plan(instance, plan, ax=top, diff=diff)
    plot_rack_power(instance, plan, ax=bottom)
    return fig


# ---------------------------------------------------------------------- HTML


def _html_data(instance: Instance, plan: Plan, diff: Plan | None) -> dict[str, Any]:
    a = instance.arrays
    lay = plan_layout(instance, plan, diff)
    ev = evaluate(instance, plan)
    palette = [[replica_color(r, s, n) for s in range(n)] for r, n in enumerate(lay.n_stages)]

    def ident(x: Hashable) -> str:
        return str(x)

    return {
        "name": instance.name,
        "policy": str(plan.metrics.get("policy", "")),
        "relative_goodput": ev.relative_goodput,
        "feasible": ev.feasible,
        "site_w": ev.site_power_w,
        "site_budget_w": a.site_budget,
        "diff": diff is not None,
        "tp_summary": tp_summary(plan, lay.tp_base)
        + (f", PP {max(lay.n_stages)}" if lay.n_stages else ""),
        "tp": list(lay.tp),
        "tp_base": lay.tp_base,
        "trays": [ident(t) for t in a.tray_ids],
        "palette": palette,
        "spare": SPARE_COLOR,
        "failed_color": FAILED_COLOR,
        "boost": BOOST_EDGE,
        "moved_color": MOVED_EDGE,
        "gpu": {
            "id": [ident(g) for g in a.gpu_ids],
            "rep": lay.replica.tolist(),
            "stage": lay.stage.tolist(),
            "state": lay.state.tolist(),
            "speed": [round(float(x), 4) for x in a.speed],
            "watts": [round(float(x), 1) for x in lay.watts],
            "mult": [round(float(x), 4) for x in lay.multiplier],
            "moved": lay.moved.astype(int).tolist(),
            "tray": a.gpu_tray.tolist(),
        },
        "racks": [
            {
                "id": ident(a.rack_ids[ri]),
                "power": round(ev.rack_power_w[ri], 1),
                "budget": round(float(a.rack_budget[ri]), 1),
                "domains": [
                    {"id": ident(a.domain_ids[p.domain]), "gpus": p.gpus.tolist()} for p in parts
                ],
            }
            for ri, parts in enumerate(_parts(instance))
        ],
    }


_PAGE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>ntp-opt plot: __TITLE__</title>
<style>
body{font:13px system-ui,sans-serif;margin:12px;color:#222;background:#fff}
h1{font-size:16px;margin:0 0 4px} .sub{color:#555;margin-bottom:4px}
#attention{font-weight:bold;margin-bottom:8px}
#legend span{display:inline-block;margin-right:14px}
#legend i{display:inline-block;width:12px;height:12px;vertical-align:-2px;margin-right:4px;
border:1px solid #999}
svg{display:block} .rack{cursor:pointer} .rack:hover>rect.bg{stroke:#000;stroke-width:2}
#detail{margin-top:10px;border-top:1px solid #ccc;padding-top:8px}
#tip{position:fixed;pointer-events:none;background:#fffff0;border:1px solid #888;
padding:4px 6px;font-size:12px;white-space:pre;display:none;z-index:9}
button{font:inherit}
</style></head><body>
<h1 id="title"></h1><div class="sub" id="sub"></div><div id="attention"></div>
<div id="legend"></div>
<div id="overview"></div>
<div id="detail"></div>
<div id="tip"></div>
<script id="data" type="application/json">__DATA__</script>
<script>
"use strict";
const D = JSON.parse(document.getElementById("data").textContent);
const G = D.gpu, NS = "http://www.w3.org/2000/svg";
const STATE = ["used", "spare", "failed"];
function el(tag, attrs, parent) {
  const e = document.createElementNS(NS, tag);
  for (const k in attrs) e.setAttribute(k, attrs[k]);
  if (parent) parent.appendChild(e);
  return e;
}
function color(g) {
  if (G.state[g] === 2) return D.failed_color;
  const r = G.rep[g];
  return r < 0 ? D.spare : D.palette[r][G.stage[g]];
}
const NAME_MAX = 40;  // longer host names are cut on the row label; tooltips give them whole
function short(t) { return t.length > NAME_MAX ? t.slice(0, NAME_MAX - 1) + "\u2026" : t; }
function fmt(x) { return Math.round(x).toLocaleString("en-US"); }
function defs(svg) {
  const d = el("defs", {}, svg);
  const p = el("pattern", {id: "hatch", width: 4, height: 4, patternUnits: "userSpaceOnUse",
    patternTransform: "rotate(45)"}, d);
  el("line", {x1: 0, y1: 0, x2: 0, y2: 4, stroke: "#333", "stroke-width": 1.2}, p);
}
function marks(g, x, y, s, parent, counts) {
  // failed: cross; straggler: hatch; boosted: orange edge; moved: magenta edge
  if (counts.failed) {
    el("path", {d: `M${x + s * .15} ${y + s * .15}L${x + s * .85} ${y + s * .85}` +
      `M${x + s * .85} ${y + s * .15}L${x + s * .15} ${y + s * .85}`,
      stroke: "#000", "stroke-width": g === null ? 1.5 : Math.max(1, s / 10)}, parent);
  }
  if (counts.straggler) el("rect", {x, y, width: s, height: s, fill: "url(#hatch)"}, parent);
  if (counts.boosted) el("rect", {x: x + 1, y: y + 1, width: s - 2, height: s - 2, fill: "none",
    stroke: D.boost, "stroke-width": 2}, parent);
  if (counts.moved) el("rect", {x: x + 3, y: y + 3, width: s - 6, height: s - 6, fill: "none",
    stroke: D.moved_color, "stroke-width": 2}, parent);
}
function rackStats(rack) {
  const st = {gpus: 0, used: 0, spare: 0, failed: 0, straggler: 0, boosted: 0, moved: 0,
    reps: new Map(), byRep: new Map()};
  for (const dom of rack.domains) for (const g of dom.gpus) {
    st.gpus++; st[STATE[G.state[g]]]++;
    if (G.speed[g] < 1) st.straggler++;
    if (G.rep[g] >= 0 && G.mult[g] > 1 + 1e-9) st.boosted++;
    if (G.moved[g]) st.moved++;
    if (G.rep[g] >= 0) {
      st.byRep.set(G.rep[g], (st.byRep.get(G.rep[g]) || 0) + 1);
      const k = G.rep[g] + "," + G.stage[g];
      st.reps.set(k, (st.reps.get(k) || 0) + 1);
    }
  }
  let best = null, n = 0;
  for (const [k, c] of st.reps) if (c > n) { best = k; n = c; }
  st.fill = best === null ? (st.failed === st.gpus ? D.failed_color : D.spare)
    : D.palette[+best.split(",")[0]][+best.split(",")[1]];
  st.replicas = st.byRep.size;
  st.shares = [...st.byRep.entries()].sort((p, q) => q[1] - p[1] || p[0] - q[0]);
  return st;
}
const tip = document.getElementById("tip");
function showTip(ev, text) {
  tip.textContent = text; tip.style.display = "block";
  tip.style.left = Math.min(ev.clientX + 12, window.innerWidth - 260) + "px";
  tip.style.top = (ev.clientY + 12) + "px";
}
function hideTip() { tip.style.display = "none"; }
function tpText(r) {
  return `TP ${D.tp[r]}` + (D.tp[r] < D.tp_base ? ` (reduced from ${D.tp_base})` : "");
}
function gpuText(g, dom) {
  const r = G.rep[g];
  return `GPU ${G.id[g]}\\nhost (tray) ${D.trays[G.tray[g]]}\\ndomain ${dom}` +
    `\\nstate ${STATE[G.state[g]]}${G.speed[g] < 1 ? " (straggler)" : ""}` +
    `\\nspeed ${G.speed[g]}` +
    (r >= 0 ? `\\nDP rank ${r}, stage (PP rank) ${G.stage[g]}, ${tpText(r)}` +
      `\\npower ${fmt(G.watts[g])} W` +
      ` (x${G.mult[g]})` : `\\npower ${fmt(G.watts[g])} W`) +
    (D.diff ? `\\n${G.moved[g] ? "moved" : "unchanged"} vs old plan` : "");
}
function legend() {
  const items = [[D.palette.length ? D.palette[0][0] : D.spare, "replica (hue), stage (shade)"],
    [D.spare, "spare"], [D.failed_color, "failed (crossed)"], ["url", "straggler (hatched)"],
    ["boost", "boosted (orange edge; W = tdp x multiplier)"],
    ["dot", "reduced TP replica (black dot)"]];
  if (D.diff) items.push(["moved", "moved vs old plan (magenta edge)"]);
  const L = document.getElementById("legend");
  for (const [c, t] of items) {
    const s = document.createElement("span"), i = document.createElement("i");
    if (c === "url") {
      i.style.background = "repeating-linear-gradient(45deg,#333 0 1px,#fff 1px 4px)";
    }
    else if (c === "boost") i.style.border = "2px solid " + D.boost;
    else if (c === "dot") {
      i.style.background = "radial-gradient(circle,#000 0 3px,#fff 3.5px)";
    }
    else if (c === "moved") i.style.border = "2px solid " + D.moved_color;
    else i.style.background = c;
    s.appendChild(i); s.appendChild(document.createTextNode(t)); L.appendChild(s);
  }
}
function overview() {
  const n = D.racks.length, W = Math.max(320, Math.min(window.innerWidth - 30, 1400));
  const size = n <= 64 ? 56 : n <= 256 ? 30 : n <= 1024 ? 20 : 12, gap = 3;
  const cols = Math.max(1, Math.floor(W / (size + gap)));
  const rows = Math.ceil(n / cols), h = rows * (size + gap) + 4;
  const svg = el("svg", {width: cols * (size + gap) + 4, height: h, id: "racks"});
  defs(svg);
  D.racks.forEach((rack, i) => {
    const st = rackStats(rack), x = 2 + (i % cols) * (size + gap);
    const y = 2 + Math.floor(i / cols) * (size + gap);
    const grp = el("g", {"class": "rack", "data-rack": i}, svg);
    el("rect", {"class": "bg", x, y, width: size, height: size, fill: st.fill,
      stroke: "#999", "stroke-width": .5}, grp);
    // one vertical strip per replica (replica by replica, its stages' shades),
    // as wide as its share of the rack's GPUs; a dot on a reduced replica
    let sx = x;
    for (const [r] of [...st.shares].sort((p, q) => p[0] - q[0])) {
      const x1 = sx;
      for (let k = 0; k < D.palette[r].length; k++) {
        const n = st.reps.get(r + "," + k) || 0;
        if (!n) continue;
        const w = size * n / st.gpus;
        el("rect", {"class": "share", "data-rep": r, x: sx, y, width: w, height: size - 3,
          fill: D.palette[r][k]}, grp);
        sx += w;
      }
      if (D.tp[r] < D.tp_base && sx - x1 >= 4) {
        el("circle", {"class": "reduced", cx: (x1 + sx) / 2, cy: y + size - 9,
          r: Math.max(1.5, Math.min(4, (sx - x1) / 4)), fill: "#000", stroke: "#fff",
          "stroke-width": 1}, grp);
      }
    }
    // power bar along the bottom: draw / budget
    const frac = rack.budget > 0 ? Math.min(1, rack.power / rack.budget) : 0;
    el("rect", {x, y: y + size - 3, width: size * frac, height: 3,
      fill: rack.power > rack.budget * (1 + 1e-6) ? "#d62728" : "#333"}, grp);
    marks(null, x, y, size, grp, st);
    if (size >= 30) {
      const rl = el("text", {x: x + 2, y: y + 11, "font-size": 10, "class": "rack-id",
        stroke: "#fff", "stroke-width": 2.5, "paint-order": "stroke"}, grp);
      const fit = Math.floor((size - 4) / 6);  // characters that fit the square
      rl.textContent = rack.id.length <= fit ? rack.id : rack.id.slice(0, fit - 1) + "\u2026";
    }
    grp.addEventListener("mousemove", ev => showTip(ev,
      `rack ${rack.id}: ${st.gpus} GPUs in ${rack.domains.length} domain part(s)\\n` +
      `${st.used} used, ${st.spare} spare, ${st.failed} failed, ${st.straggler} stragglers\\n` +
      `${st.boosted} boosted GPUs` + (D.diff ? `, ${st.moved} moved` : "") +
      `\\n${st.replicas} replica(s):` +
      st.shares.slice(0, 8).map(([r, n]) => `\\n  DP rank ${r}: ${n} GPUs, ${tpText(r)}`).join("") +
      (st.shares.length > 8 ? `\\n  ... ${st.shares.length - 8} more` : "") +
      `\\npower ${fmt(rack.power)} of ${fmt(rack.budget)} W\\nclick for its GPUs`));
    grp.addEventListener("mouseleave", hideTip);
    grp.addEventListener("click", () => { location.hash = "rack=" + encodeURIComponent(rack.id); });
  });
  document.getElementById("overview").appendChild(svg);
}
function detail(i) {
  const box = document.getElementById("detail");
  box.textContent = "";
  for (const r of document.querySelectorAll("rect.open")) r.remove();
  if (i < 0) return;
  const bg = document.querySelector(`g[data-rack="${i}"] rect.bg`);
  if (bg) {  // the opened rack, outlined in the overview
    el("rect", {"class": "open", x: +bg.getAttribute("x") - 1.5, y: +bg.getAttribute("y") - 1.5,
      width: +bg.getAttribute("width") + 3, height: +bg.getAttribute("height") + 3,
      fill: "none", stroke: "#000", "stroke-width": 3}, bg.parentNode);
  }
  const rack = D.racks[i], st = rackStats(rack);
  const head = document.createElement("div");
  head.innerHTML = "";
  const b = document.createElement("button");
  b.textContent = "close"; b.addEventListener("click", () => { location.hash = ""; });
  const t = document.createElement("b");
  t.textContent = `rack ${rack.id}: ${st.gpus} GPUs, power ${fmt(rack.power)} of ` +
    `${fmt(rack.budget)} W `;
  head.appendChild(t); head.appendChild(b); box.appendChild(head);
  const s = 40, gap = 3, per = 16, line = 18;
  // a domain: its full id on a line, then one row per tray (host), named
  const blocks = rack.domains.map(dom => {
    const byTray = new Map();
    for (const g of dom.gpus) {
      if (!byTray.has(G.tray[g])) byTray.set(G.tray[g], []);
      byTray.get(G.tray[g]).push(g);
    }
    return {dom, trays: [...byTray.entries()]};
  });
  let lab = 60, height = 4;
  for (const b of blocks) {
    height += line;
    for (const [t, gs] of b.trays) {
      lab = Math.max(lab, 7 * Math.min(String(D.trays[t]).length, NAME_MAX) + 12);
      height += Math.ceil(gs.length / per) * (s + gap) + 4;
    }
    height += 6;
  }
  const svg = el("svg", {width: lab + per * (s + gap) + 8, height, id: "gpus"});
  defs(svg);
  let y = 2;
  for (const {dom, trays} of blocks) {
    const txt = el("text", {x: 0, y: y + 13, "font-size": 13, "font-weight": "bold",
      "class": "domain"}, svg);
    txt.textContent = `domain ${dom.id} (${dom.gpus.length} GPUs in this rack)`;
    y += line;
    for (const [t, gs] of trays) {
      const rows = Math.ceil(gs.length / per);
      el("rect", {x: lab - 3, y: y - 2, width: Math.min(gs.length, per) * (s + gap) + 3,
        height: rows * (s + gap) + 1, fill: "none", stroke: "#333", "class": "tray"}, svg);
      const tl = el("text", {x: 4, y: y + s * .6, "font-size": 12, "class": "host"}, svg);
      tl.textContent = short(String(D.trays[t]));
      gs.forEach((g, k) => {
        const x = lab + (k % per) * (s + gap), yy = y + Math.floor(k / per) * (s + gap);
        const grp = el("g", {"class": "gpu", "data-gpu": g}, svg);
        el("rect", {x, y: yy, width: s, height: s, fill: color(g), stroke: "#999",
          "stroke-width": .5}, grp);
        const r = G.rep[g], boosted = r >= 0 && G.mult[g] > 1 + 1e-9;
        marks(g, x, yy, s, grp, {failed: G.state[g] === 2, straggler: G.speed[g] < 1,
          boosted, moved: G.moved[g]});
        if (r >= 0) {
          const lines = [`${r}.${G.stage[g]}`];
          if (D.tp[r] < D.tp_base) lines.push(`tp${D.tp[r]}`);
          if (boosted) lines.push(Math.round(G.watts[g]) + " W");
          lines.forEach((text, n) => {
            const lt = el("text", {x: x + s / 2, y: yy + 11 + n * 11, "font-size": 10,
              "text-anchor": "middle",
              "font-weight": text.startsWith("tp") ? "bold" : "normal"}, grp);
            lt.textContent = text;
          });
        }
        grp.addEventListener("mousemove", ev => showTip(ev, gpuText(g, dom.id)));
        grp.addEventListener("mouseleave", hideTip);
      });
      y += rows * (s + gap) + 4;
    }
    y += 6;
  }
  box.appendChild(svg);
}
function route() {
  const m = /rack=([^&]*)/.exec(location.hash);
  const id = m ? decodeURIComponent(m[1]) : null;
  detail(id === null ? -1 : D.racks.findIndex(r => r.id === id));
}
document.getElementById("title").textContent = `${D.name}: ${G.id.length.toLocaleString(
  "en-US")} GPUs, ${D.racks.length} racks; ${D.tp_summary}`;
document.getElementById("sub").textContent = (D.policy ? `policy ${D.policy}, ` : "") +
  `relative goodput ${D.relative_goodput.toFixed(4)}` + (D.feasible ? "" : " (INFEASIBLE plan)") +
  `, site power ${fmt(D.site_w)} of ${fmt(D.site_budget_w)} W. One square per rack ` +
  "(one strip per replica, as wide as its share of the rack's GPUs; bar: power / budget);" +
  " click a rack. GPU labels: DP rank.stage, tpN when reduced, watts when boosted.";
// what needs a look, first: failures, stragglers, racks over budget
(() => {
  const n = [0, 0, 0];
  G.state.forEach(s => n[s]++);
  const slow = G.speed.filter(v => v < 1).length;
  const over = D.racks.filter(r => r.power > r.budget * (1 + 1e-6)).map(r => r.id);
  const a = document.getElementById("attention");
  a.textContent = `${n[2]} failed, ${slow} stragglers, ${n[1]} spare GPUs; ` +
    (over.length ? `${over.length} rack(s) over budget: ${over.slice(0, 10).join(", ")}` +
      (over.length > 10 ? ", ..." : "") : "no rack over budget") +
    (D.feasible ? "" : "; the plan is INFEASIBLE");
  if (over.length || !D.feasible) a.style.color = "#b00";
})();
legend();
overview();
window.addEventListener("hashchange", route);
route();
</script></body></html>
"""


def plan_html(instance: Instance, plan: Plan, diff: Plan | None = None) -> str:
    """One self-contained HTML page showing a plan (no network access needed).

    The page shows one square per rack (one strip per replica as wide as its
    share of the rack's GPUs, a dot on reduced replicas, marks for failed,
    straggling, boosted and moved GPUs, a bar for power against budget) and,
    on a click or with ``#rack=ID`` in the address, the rack's domains (full
    ids) and trays (hosts, one row each) with tooltips (GPU id, host, state,
    speed, DP rank, stage, TP degree, power in watts). Ids are data, never
    markup: no ``<`` reaches the page inside the embedded JSON.

    Parameters
    ----------
    instance, plan, diff
        As for :func:`plot_plan`.

    Returns
    -------
    str
        The page.
    """
    data = json.dumps(_html_data(instance, plan, diff), separators=(",", ":"))
    # Inside <script> no "<" may appear at all ("</script>", "<!--" would end
    # or swallow the block): JSON reads the escapes back as the same text.
    data = data.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
    return _PAGE.replace("__TITLE__", html.escape(instance.name)).replace("__DATA__", data)
