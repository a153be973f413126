"""GPU products and the board power limits they accept.

A table of data-centre GPU products with their nominal board power (the
power limit a board runs at by default, which the model calls ``tdp_w``) and
the largest power limit the board accepts (``max_power_w``: what
``nvidia-smi -q`` prints as *Max Power Limit*; ``nvidia-smi -pl`` refuses any
higher value). Importers use it when a cluster description names a product
but no ``nvidia-smi -q -x`` output is given, and ``ntp-opt gen --product``
builds a cluster with real board powers.

=========  ==============  ==========  ================================================
product    ``tdp_w`` (W)   max (W)     sources
=========  ==============  ==========  ================================================
H100 SXM   700             700         NVIDIA H100 Tensor Core GPU datasheet (SXM: "up
                                       to 700 W, configurable"); public ``nvidia-smi -q``
                                       output of a 700 W SXM board shows Default Power
                                       Limit 700.00 W = Max Power Limit 700.00 W
H200 SXM   700             700         NVIDIA H200 Tensor Core GPU datasheet (SXM: "up
                                       to 700 W, configurable")
B200       1000            1000        NVIDIA HGX B200 / DGX B200 documentation: each
(HGX)                                  GPU configurable up to 1 kW
GB200      1200            1200        NVIDIA GB200 NVL72 documentation: Blackwell GPU
                                       at 1200 W in the GB200 superchip
=========  ==============  ==========  ================================================

Decision where the sources are silent: the vendor documents give one figure
per product, "up to" that power; no public NVIDIA document found gives a
maximum accepted limit above it. The table therefore sets the maximum equal
to the nominal power for every product: such boards cannot be boosted. A
board whose operator runs it below its maximum (``nvidia-smi -pl``) has
headroom, which the ``nvidia-smi -q -x`` importer reads per GPU (enforced
vs. max power limit); ``tdp_w`` and ``max_power_w`` can also be set per GPU in
an instance file.

Product names are matched as ``nvidia-smi`` prints them (``--query-gpu=name``,
``<product_name>`` in ``-q -x``: "NVIDIA H100 80GB HBM3") and as the GPU
operator's ``nvidia.com/gpu.product`` node label spells them (spaces replaced
by dashes, possibly with a ``-SHARED`` or MIG suffix: "NVIDIA-H100-80GB-HBM3").
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["PRODUCTS", "GpuProduct", "lookup", "product"]


@dataclass(frozen=True)
class GpuProduct:
    """One GPU product's board power.

    Attributes
    ----------
    key
        Short name used by ``ntp-opt gen --product`` (e.g. ``"h100-sxm"``).
    name
        Human-readable product name.
    tdp_w
        Nominal board power (default power limit), in watts.
    max_power_w
        Largest power limit the board accepts, in watts (>= ``tdp_w``).
    """

    key: str
    name: str
    tdp_w: float
    max_power_w: float

    @property
    def max_multiplier(self) -> float:
        """``max_power_w / tdp_w``: the largest power multiplier the board accepts."""
        return self.max_power_w / self.tdp_w


#: The table, by key.
PRODUCTS: dict[str, GpuProduct] = {
    p.key: p
    for p in (
        GpuProduct("h100-sxm", "NVIDIA H100 SXM", 700.0, 700.0),
        GpuProduct("h200-sxm", "NVIDIA H200 SXM", 700.0, 700.0),
        GpuProduct("b200", "NVIDIA B200 (HGX)", 1000.0, 1000.0),
        GpuProduct("gb200", "NVIDIA GB200", 1200.0, 1200.0),
    )
}

# Patterns on the normalised name (upper case, dashes and underscores as spaces, the
# "NVIDIA" prefix removed). Order matters: GB200 before B200, GH200 is not H200.
_PATTERNS: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r"^GB200\b"), "gb200"),
    (re.compile(r"^B200\b"), "b200"),
    (re.compile(r"^H200\b(?!.*\bNVL\b)(?!.*\bPCIE\b)"), "h200-sxm"),
    # H100 SXM: "H100 80GB HBM3" (nvidia-smi), "H100 SXM5 80GB"; not PCIe, NVL or H100L.
    (re.compile(r"^H100\b(?!.*\bPCIE\b)(?!.*\bNVL\b)"), "h100-sxm"),
)


def _normalise(name: str) -> str:
    s = re.sub(r"[-_\s]+", " ", name.strip()).upper()
    return re.sub(r"^NVIDIA\s+", "", s)


def lookup(name: str) -> GpuProduct | None:
    """The table entry for a product name, or ``None`` for an unknown product.

    Parameters
    ----------
    name
        A product name as ``nvidia-smi`` prints it ("NVIDIA H100 80GB HBM3",
        "NVIDIA GB200"), as the ``nvidia.com/gpu.product`` label spells it
        ("NVIDIA-H100-80GB-HBM3", "NVIDIA-GB200"), or a table key ("h100-sxm").

    Returns
    -------
    GpuProduct or None
        ``None`` when the name matches no product of the table (PCIe and NVL
        variants, whose power differs, are deliberately not matched).
    """
    if not isinstance(name, str):
        return None
    key = name.strip().lower()
    if key in PRODUCTS:
        return PRODUCTS[key]
    norm = _normalise(name)
    for pattern, k in _PATTERNS:
        if pattern.search(norm):
            return PRODUCTS[k]
    return None


def product(key: str) -> GpuProduct:
    """The table entry for a key of :data:`PRODUCTS` or a product name.

    Raises
    ------
    KeyError
        If the product is unknown; the message lists the known keys.
    """
    found = lookup(key)
    if found is None:
        raise KeyError(f"unknown GPU product {key!r}; known: {', '.join(PRODUCTS)}")
    return found
