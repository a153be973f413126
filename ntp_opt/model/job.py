"""The training job: the fields of docs/model.md, spec section 2, validated and immutable.

Defaults that the spec leaves open are decided here and documented in
``docs/decisions.md``:

* ``tp_min`` defaults to ``ceil(7 T / 8)`` and ``tp_allowed`` to every integer
  from ``tp_min`` to ``T``; ``T`` itself must be allowed.
* ``max_local_batch`` defaults to ``ceil(B / R)`` (equal to ``b0 = B / R`` when
  ``R`` divides ``B``), so that ``R`` replicas can always carry ``B``.
* ``tp_efficiency`` maps a degree to its relative per-GPU efficiency; degrees
  that are not listed have efficiency 1.
"""

from __future__ import annotations

import math
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

BatchPolicy = Literal["fixed", "elastic"]

#: Range of a ``tp_efficiency`` value (so that derived speeds stay finite).
ETA_MIN, ETA_MAX = 1e-6, 1e6


class Job(BaseModel):
    """A data-parallel training job with tensor and pipeline parallelism.

    Parameters
    ----------
    tp
        Nominal TP degree ``T``.
    pp
        Pipeline stages per replica ``S``; each stage is one TP group inside
        one NVLink domain.
    dp
        Number of data-parallel replicas ``R`` the job is built for.
    global_batch
        Sequences per step ``B``.
    seq_time_s
        Seconds a healthy full-TP replica spends per sequence (``c``).
    tp_allowed, tp_min, dp_max, max_local_batch, batch_policy, tp_efficiency,
    power_exponent, max_boost, idle_power_fraction, reshard_overhead
        See docs/model.md, spec section 2; defaults are filled in on construction.
    micro_batch
        Megatron-LM's ``--micro-batch-size`` (default 1): only the Megatron
        planner (``optimal-megatron``) and the Megatron export use it; every
        replica's local batch must then be a multiple of it.

    Examples
    --------
    >>> job = Job(tp=32, pp=8, dp=128, global_batch=2048, seq_time_s=1.0)
    >>> job.tp_min, job.tp_allowed[:2], job.max_local_batch
    (28, (28, 29), 16)
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    tp: int = Field(ge=1, le=4096)
    pp: int = Field(ge=1, le=4096)
    dp: int = Field(ge=1, le=1_000_000)
    global_batch: int = Field(ge=1, le=1_000_000_000)
    seq_time_s: float = Field(default=1.0, ge=1e-9, le=1e9, allow_inf_nan=False)
    tp_min: int | None = Field(default=None, ge=1)
    tp_allowed: tuple[int, ...] | None = None
    dp_max: int | None = Field(default=None, ge=0, le=1_000_000)
    max_local_batch: int | None = Field(default=None, ge=1, le=1_000_000_000)
    batch_policy: BatchPolicy = "fixed"
    tp_efficiency: dict[int, float] = Field(default_factory=dict)
    power_exponent: float = Field(default=0.65, ge=0.0, le=1.0, allow_inf_nan=False)
    max_boost: float = Field(default=0.30, ge=0.0, le=10.0, allow_inf_nan=False)
    idle_power_fraction: float = Field(default=0.1, ge=0.0, le=1.0, allow_inf_nan=False)
    reshard_overhead: float = Field(default=0.01, ge=0.0, le=10.0, allow_inf_nan=False)
    micro_batch: int = Field(default=1, ge=1, le=1_000_000_000)

    @model_validator(mode="after")
    def _fill_defaults(self) -> Job:
        tp_min = self.tp_min if self.tp_min is not None else math.ceil(7 * self.tp / 8)
        if tp_min > self.tp:
            raise ValueError(f"tp_min ({tp_min}) must not exceed tp ({self.tp})")
        if self.tp_allowed is None:
            allowed = tuple(range(tp_min, self.tp + 1))
        else:
            allowed = tuple(sorted(set(self.tp_allowed)))
            bad = [t for t in allowed if t < tp_min or t > self.tp]
            if bad:
                raise ValueError(
                    f"tp_allowed: degrees {bad} lie outside [tp_min={tp_min}, tp={self.tp}]"
                )
            if self.tp not in allowed:
                raise ValueError(f"tp_allowed must contain the nominal degree tp={self.tp}")
        for t, eta in self.tp_efficiency.items():
            # bounded so that t * eta(t) / (T * eta(T)) and goodputs stay finite
            if not (math.isfinite(eta) and ETA_MIN <= eta <= ETA_MAX):
                raise ValueError(
                    f"tp_efficiency[{t}] must be a number in "
                    f"[{ETA_MIN:g}, {ETA_MAX:g}], got {eta!r}"
                )
        dp_max = self.dp if self.dp_max is None else self.dp_max
        mlb = (
            self.max_local_batch
            if self.max_local_batch is not None
            else -(-self.global_batch // self.dp)
        )
        object.__setattr__(self, "tp_min", tp_min)
        object.__setattr__(self, "tp_allowed", allowed)
        object.__setattr__(self, "dp_max", dp_max)
        object.__setattr__(self, "max_local_batch", mlb)
        return self

    # The validator fills every optional field; these accessors give them
    # non-optional types for callers and for mypy.
    @property
    def allowed(self) -> tuple[int, ...]:
        """Allowed TP degrees, ascending."""
        assert self.tp_allowed is not None
        return self.tp_allowed

    @property
    def min_tp(self) -> int:
        """Smallest TP degree whose shards fit in memory."""
        assert self.tp_min is not None
        return self.tp_min

    @property
    def replicas_max(self) -> int:
        """Largest number of replicas a plan may have."""
        assert self.dp_max is not None
        return self.dp_max

    @property
    def local_batch_max(self) -> int:
        """Largest local batch of one replica."""
        assert self.max_local_batch is not None
        return self.max_local_batch

    @property
    def nominal_local_batch(self) -> float:
        """``b0 = B / R``."""
        return self.global_batch / self.dp

    def efficiency(self, t: int) -> float:
        """Relative per-GPU efficiency ``eta(t)`` (1 when not listed)."""
        return float(self.tp_efficiency.get(t, 1.0))

    def tp_factor(self, t: int) -> float:
        """Speed of degree ``t`` relative to ``T``: ``t eta(t) / (T eta(T))``."""
        return (t * self.efficiency(t)) / (self.tp * self.efficiency(self.tp))

    def largest_allowed(self, n: int) -> int | None:
        """Largest allowed degree that ``n`` GPUs can run, or ``None``."""
        fits = [t for t in self.allowed if t <= n]
        return fits[-1] if fits else None
