"""The GPU map of a plan: :func:`plot_plan`.

The map is built in three steps: :func:`_map_shape` sizes the blocks (a rack
is a column of domain parts), :func:`_collect_marks` walks the racks and
gathers the shapes to draw (:class:`_Marks`), and the ``_draw_*`` functions
add them, the text, the title and the legend to the axes.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

import numpy as np

from ntp_opt.app.plotting.layout import Part, PlanLayout, domain_parts, plan_layout, tp_summary
from ntp_opt.app.plotting.style import (
    BOOST_EDGE,
    FAILED,
    FAILED_COLOR,
    GPU_LEVEL_MAX,
    LABEL_MAX,
    MOVED_EDGE,
    SPARE,
    SPARE_COLOR,
    literal,
    pyplot,
    replica_color,
)
from ntp_opt.model.instance import Instance
from ntp_opt.model.plan import Plan

if TYPE_CHECKING:  # pragma: no cover
    from matplotlib.axes import Axes
    from matplotlib.patches import Circle, Rectangle


def _grid_cols(n: int, cell_w: float, cell_h: float, aspect: float = 2.0) -> int:
    """Columns so that ``n`` blocks of ``cell_w x cell_h`` fill about ``aspect`` : 1."""
    if n <= 0:
        return 1
    return max(1, min(n, round(math.sqrt(n * aspect * cell_h / cell_w))))


def _cross(x: float, y: float, w: float, h: float) -> list[list[tuple[float, float]]]:
    return [[(x, y), (x + w, y + h)], [(x, y + h), (x + w, y)]]


def _tray_shape(instance: Instance) -> tuple[int, int, int]:
    """(GPU columns of a tray, rows of a tray, trays side by side) on the GPU map."""
    a = instance.arrays
    size = int(np.bincount(a.gpu_tray).max(initial=1)) if a.n_gpus else 1
    width = min(size, 8)
    return width, math.ceil(size / width), max(1, 8 // width)


@dataclass(frozen=True)
class _MapShape:
    """Block sizes of the map.

    At the GPU level a domain part is a grid of trays, each a ``tw x th``
    block of GPU squares, ``per`` side by side, ``tgap`` apart; parts are
    ``pgap`` apart. At the domain level a part is one cell.
    """

    level: Literal["gpu", "domain"]
    tw: int
    th: int
    per: int
    tgap: float
    pgap: float
    trays: list[list[list[np.ndarray]]]  # per rack, per part: the GPUs of each tray
    block_w: float
    block_h: float
    gap: float
    cols: int


def _part_trays(instance: Instance, part: Part) -> list[np.ndarray]:
    """The GPUs of each tray of a domain part, trays in index order."""
    a = instance.arrays
    gpus = part.gpus[np.argsort(a.gpu_tray[part.gpus], kind="stable")]
    cut = np.flatnonzero(np.diff(a.gpu_tray[gpus])) + 1
    return list(np.split(gpus, cut))


def _map_shape(
    instance: Instance, racks: list[list[Part]], level: Literal["gpu", "domain"]
) -> _MapShape:
    tw, th, per = _tray_shape(instance)
    tgap, pgap = 0.3, 0.7
    trays: list[list[list[np.ndarray]]]
    if level == "gpu":
        trays = [[_part_trays(instance, p) for p in parts] for parts in racks]
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
    return _MapShape(level, tw, th, per, tgap, pgap, trays, block_w, block_h, gap, cols)


@dataclass
class _Marks:
    """What the map draws, gathered rack by rack (positions in map units)."""

    rects: list[Rectangle] = field(default_factory=list)
    colors: list[str] = field(default_factory=list)
    crosses: list[list[tuple[float, float]]] = field(default_factory=list)
    hatch_rects: list[Rectangle] = field(default_factory=list)
    boost_rects: list[Rectangle] = field(default_factory=list)
    moved_rects: list[Rectangle] = field(default_factory=list)
    tray_rects: list[Rectangle] = field(default_factory=list)
    part_rects: list[Rectangle] = field(default_factory=list)
    dots: list[Circle] = field(default_factory=list)
    labels: list[tuple[float, float, str]] = field(default_factory=list)
    ranks: list[tuple[float, float, str]] = field(default_factory=list)
    rack_labels: list[tuple[float, float, str]] = field(default_factory=list)
    seen: set[tuple[int, int, int]] = field(default_factory=set)

    def gpu_square(
        self, lay: PlanLayout, reduced: np.ndarray, g: int, x: float, yy: float, pi: int
    ) -> None:
        """GPU ``g`` as a square at ``(x, yy)`` in domain part ``pi``."""
        from matplotlib.patches import Circle, Rectangle

        self.rects.append(Rectangle((x + 0.05, yy + 0.05), 0.9, 0.9))
        self.colors.append(lay.color(g))
        if lay.state[g] == FAILED:
            self.crosses.extend(_cross(x + 0.15, yy + 0.15, 0.7, 0.7))
        if lay.straggler[g]:
            self.hatch_rects.append(Rectangle((x + 0.05, yy + 0.05), 0.9, 0.9))
        if reduced[g]:
            self.dots.append(Circle((x + 0.78, yy + 0.78), 0.13))
        if lay.moved[g]:
            self.moved_rects.append(Rectangle((x + 0.1, yy + 0.1), 0.8, 0.8))
        r, s = int(lay.replica[g]), int(lay.stage[g])
        if r >= 0 and (r, s, pi) not in self.seen:  # first GPU of a stage in a domain part
            self.seen.add((r, s, pi))
            self.ranks.append((x + 0.5, yy + 0.5, f"{r}.{s}"))
            if lay.boosted[g] and (r, s, -1) not in self.seen:
                self.seen.add((r, s, -1))
                self.labels.append((x + 0.5, yy + 0.5, f"{lay.watts[g]:.0f} W"))
        if lay.boosted[g]:
            self.boost_rects.append(Rectangle((x + 0.05, yy + 0.05), 0.9, 0.9))

    def domain_cell(
        self, lay: PlanLayout, reduced: np.ndarray, gpus: np.ndarray, x0: float, y: float
    ) -> None:
        """A domain part as one cell at ``(x0, y)``, coloured by its dominant replica."""
        from matplotlib.patches import Circle, Rectangle

        self.rects.append(Rectangle((x0, y), 0.9, 0.9))
        used = lay.replica[gpus]
        used = used[used >= 0]
        if len(used):
            r = int(np.bincount(used).argmax())
            stages = lay.stage[gpus][lay.replica[gpus] == r]
            s = int(np.bincount(stages).argmax())
            self.colors.append(replica_color(r, s, lay.n_stages[r]))
        elif (lay.state[gpus] == FAILED).all():
            self.colors.append(FAILED_COLOR)
        else:
            self.colors.append(SPARE_COLOR)
        if (lay.state[gpus] == FAILED).any():
            self.crosses.extend(_cross(x0 + 0.1, y + 0.1, 0.7, 0.7))
        if lay.straggler[gpus].any():
            self.hatch_rects.append(Rectangle((x0, y), 0.9, 0.9))
        if lay.boosted[gpus].any():
            self.boost_rects.append(Rectangle((x0, y), 0.9, 0.9))
        if reduced[gpus].any():
            self.dots.append(Circle((x0 + 0.7, y + 0.7), 0.15))
        if lay.moved[gpus].any():
            self.moved_rects.append(Rectangle((x0 + 0.08, y + 0.08), 0.74, 0.74))


def _collect_marks(
    instance: Instance, lay: PlanLayout, racks: list[list[Part]], shape: _MapShape
) -> _Marks:
    from matplotlib.patches import Rectangle

    a = instance.arrays
    reduced = lay.reduced
    sh = shape
    marks = _Marks()
    pi = 0
    for ri, parts in enumerate(racks):
        x0 = (ri % sh.cols) * (sh.block_w + sh.gap)
        y0 = (ri // sh.cols) * (sh.block_h + sh.gap)
        marks.rack_labels.append((x0, y0, str(a.rack_ids[ri])))
        y = y0
        for k_part, part in enumerate(parts):
            if sh.level == "domain":
                marks.domain_cell(lay, reduced, part.gpus, x0, y)
                y += 1.0
                continue
            pt = sh.trays[ri][k_part]
            h = math.ceil(len(pt) / sh.per) * (sh.th + sh.tgap) - sh.tgap
            marks.part_rects.append(Rectangle((x0 - 0.15, y - 0.15), sh.block_w + 0.3, h + 0.3))
            for t, tg in enumerate(pt):
                tx = x0 + (t % sh.per) * (sh.tw + sh.tgap)
                ty = y + (t // sh.per) * (sh.th + sh.tgap)
                marks.tray_rects.append(
                    Rectangle((tx, ty), min(len(tg), sh.tw), math.ceil(len(tg) / sh.tw))
                )
                for k, g in enumerate(tg):
                    marks.gpu_square(lay, reduced, int(g), tx + k % sh.tw, ty + k // sh.tw, pi)
            pi += 1
            y += h + sh.tgap + sh.pgap
    return marks


def _draw_marks(ax: Axes, marks: _Marks, level: str) -> None:
    from matplotlib.collections import LineCollection, PatchCollection

    small = len(marks.rects) <= 1024
    if marks.part_rects:
        pcol = PatchCollection(
            marks.part_rects, facecolors="#eef2f8", edgecolors="#9aa7bd", linewidths=0.5
        )
        pcol.set_gid("domain_parts")
        ax.add_collection(pcol)
    cells = PatchCollection(marks.rects, facecolors=marks.colors, edgecolors="none", linewidths=0)
    cells.set_gid("gpus" if level == "gpu" else "domains")
    ax.add_collection(cells)
    if level == "gpu":
        tcol = PatchCollection(
            marks.tray_rects,
            facecolors="none",
            edgecolors="#333333",
            linewidths=0.8 if small else 0.4,
        )
        tcol.set_gid("trays")
        ax.add_collection(tcol)
    hatch = PatchCollection(
        marks.hatch_rects, facecolors="none", edgecolors="#333333", linewidths=0, hatch="////"
    )
    hatch.set_gid("stragglers")
    ax.add_collection(hatch)
    edge_w = 1.5 if small else 0.6
    boost = PatchCollection(
        marks.boost_rects, facecolors="none", edgecolors=BOOST_EDGE, linewidths=edge_w
    )
    boost.set_gid("boosted")
    ax.add_collection(boost)
    moved = PatchCollection(
        marks.moved_rects, facecolors="none", edgecolors=MOVED_EDGE, linewidths=edge_w
    )
    moved.set_gid("moved")
    ax.add_collection(moved)
    dcol = PatchCollection(marks.dots, facecolors="black", edgecolors="white", linewidths=0.3)
    dcol.set_gid("reduced")
    ax.add_collection(dcol)
    cross = LineCollection(marks.crosses, colors="black", linewidths=1.0 if small else 0.5)
    cross.set_gid("failed")
    ax.add_collection(cross)


def _draw_text(ax: Axes, marks: _Marks, shape: _MapShape, n_racks: int) -> None:
    """Set the map's extent, then write the rack names, ranks and watts where they fit."""
    sh = shape
    rows = math.ceil(n_racks / sh.cols) if n_racks else 1
    width_units = sh.cols * (sh.block_w + sh.gap)
    ax.set_xlim(-sh.gap / 2, width_units - sh.gap / 2)
    ax.set_ylim(rows * (sh.block_h + sh.gap) - sh.gap / 2, -sh.gap / 2)  # rack 0 at the top left
    ax.set_aspect("equal")
    # Text only where it fits: a map unit is about this many points wide.
    fig_w = float(ax.get_figure(root=True).get_size_inches()[0])  # type: ignore[union-attr]
    unit_pt = 72 * fig_w * ax.get_position().width / width_units
    rack_pt = min(
        9.0,
        (sh.block_w + sh.gap) * unit_pt / max([3, *(len(t) for *_, t in marks.rack_labels)]) * 1.6,
    )
    if rack_pt >= 5:
        for x, y, text in marks.rack_labels:
            ax.text(x, y - 0.2, literal(text), fontsize=rack_pt, va="bottom", gid="rack_label")
    cell_pt = unit_pt * 0.9
    if sh.level == "gpu" and cell_pt >= 9 and len(marks.ranks) <= 512:
        # DP rank.stage on the first GPU of every stage in a domain part
        for x, y, text in marks.ranks:
            ax.text(
                x,
                y,
                text,
                fontsize=min(7.0, cell_pt / 2.2),
                ha="center",
                va="center",
                gid="dp_rank",
            )
    if sh.level == "gpu" and len(marks.labels) <= LABEL_MAX and cell_pt >= 8:
        for x, y, text in marks.labels:
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


def _draw_title(
    ax: Axes, instance: Instance, plan: Plan, lay: PlanLayout, n_racks: int, level: str
) -> None:
    ax.set_xticks([])
    ax.set_yticks([])
    for side in ("top", "right", "bottom", "left"):
        ax.spines[side].set_visible(False)
    what = (
        "one square per GPU, trays outlined" if level == "gpu" else "one cell per domain in a rack"
    )
    ax.set_title(
        literal(
            f"{instance.name}: {instance.arrays.n_gpus:,} GPUs in {n_racks} racks ({what})\n"
            + tp_summary(plan, lay.tp_base)
            + (f", PP {max(lay.n_stages)}" if lay.n_stages else "")
        ),
        fontsize=10,
    )


def _draw_legend(ax: Axes, lay: PlanLayout, level: str, diff: bool) -> None:
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

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
            label=f"reduced TP, below {lay.tp_base} ({int(lay.reduced.sum())} GPUs)",
        ),
    ]
    if level == "gpu":
        handles.append(Patch(facecolor="none", edgecolor="#333333", label="tray (host)"))
    if diff:
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
        plan first, e.g. with :func:`ntp_opt.planners.megatron.megatron_order`, to see
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
    plt = pyplot()
    if ax is None:
        _, ax = plt.subplots(figsize=(10, 6))
    lay = plan_layout(instance, plan, diff)
    racks = domain_parts(instance)
    if level == "auto":
        level = "gpu" if instance.arrays.n_gpus <= GPU_LEVEL_MAX else "domain"
    if level not in ("gpu", "domain"):
        raise ValueError(f"level must be 'auto', 'gpu' or 'domain', not {level!r}")
    shape = _map_shape(instance, racks, level)
    marks = _collect_marks(instance, lay, racks, shape)
    _draw_marks(ax, marks, level)
    _draw_text(ax, marks, shape, len(racks))
    _draw_title(ax, instance, plan, lay, len(racks), level)
    if legend:
        _draw_legend(ax, lay, level, diff is not None)
    return ax
