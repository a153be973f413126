"""JSON files for several workloads: ``ntp-opt/workloads@1`` and ``ntp-opt/multi-plan@1``.

A workloads file carries the fields of :class:`~ntp_opt.model.workloads.Workloads`
(unknown fields are errors)::

    {"format": "ntp-opt/workloads@1", "training_weight": 1.0,
     "serving": [{"name": "chat", "throughput": {"4": 3.5, "8": 6.5}, "demand": 300.0}]}

A multi-plan file holds the training plan in the ``ntp-opt/plan@1`` form and the
serving replicas::

    {"format": "ntp-opt/multi-plan@1", "instance": "...", "training": {plan@1},
     "serving": [{"workload", "tp", "domain", "gpus"}], "metrics": {...}}

The training part is written as the plan holds it: the command line first gives
it the validator's figures (:func:`ntp_opt.rules.multi.with_training_metrics`).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from ntp_opt.model.files import (
    InputError,
    check_format,
    plan_from_dict,
    plan_to_dict,
    read_json,
    validation_problems,
    write_json,
)
from ntp_opt.model.workloads import MultiPlan, ServingReplica, Workloads

WORKLOADS_FORMAT = "ntp-opt/workloads@1"
MULTI_PLAN_FORMAT = "ntp-opt/multi-plan@1"


class _ServingData(BaseModel):
    model_config = ConfigDict(extra="forbid")

    workload: str
    tp: int
    domain: str | int
    gpus: list[str | int]


class _MultiPlanFile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    format: Literal["ntp-opt/multi-plan@1"]
    instance: str
    training: dict[str, Any]
    serving: list[_ServingData]
    metrics: dict[str, Any] = {}


def workloads_from_dict(data: Any, source: str = "<workloads>") -> Workloads:
    """Build :class:`Workloads` from parsed JSON; errors name the field."""
    check_format(data, WORKLOADS_FORMAT, source)
    body = {k: v for k, v in data.items() if k != "format"}
    try:
        return Workloads.model_validate(body)
    except ValidationError as err:
        raise InputError(source, validation_problems(err)) from None


def workloads_to_dict(workloads: Workloads) -> dict[str, Any]:
    """The JSON form of ``workloads``."""
    body = workloads.model_dump(mode="json")
    return {"format": WORKLOADS_FORMAT, **body}


def load_workloads(path: str | os.PathLike[str]) -> Workloads:
    """Load a workloads file (``.json`` or ``.json.gz``)."""
    p = Path(path)
    return workloads_from_dict(read_json(p), str(p))


def save_workloads(
    workloads: Workloads,
    path: str | os.PathLike[str],
    inputs: Iterable[str | os.PathLike[str]] = (),
) -> None:
    """Write ``workloads`` to ``path`` atomically (never onto one of ``inputs``)."""
    write_json(workloads_to_dict(workloads), Path(path), inputs)


def multi_plan_to_dict(plan: MultiPlan) -> dict[str, Any]:
    """The JSON form of ``plan`` (the training part with its own metrics)."""
    metrics = {k: v for k, v in plan.metrics.items() if isinstance(v, int | float | str)}
    return {
        "format": MULTI_PLAN_FORMAT,
        "instance": plan.instance,
        "training": plan_to_dict(plan.training),
        "serving": [
            {"workload": r.workload, "tp": r.tp, "domain": r.domain, "gpus": list(r.gpus)}
            for r in plan.serving
        ],
        "metrics": metrics,
    }


def multi_plan_from_dict(data: Any, source: str = "<multi-plan>") -> MultiPlan:
    """Build a :class:`MultiPlan` from parsed JSON (schema checks only)."""
    check_format(data, MULTI_PLAN_FORMAT, source)
    try:
        model = _MultiPlanFile.model_validate(data)
    except ValidationError as err:
        raise InputError(source, validation_problems(err)) from None
    training = plan_from_dict(model.training, f"{source}: training")
    serving = tuple(
        ServingReplica(s.workload, s.tp, s.domain, tuple(s.gpus)) for s in model.serving
    )
    return MultiPlan(training, serving, model.metrics)


def save_multi_plan(
    plan: MultiPlan,
    path: str | os.PathLike[str],
    inputs: Iterable[str | os.PathLike[str]] = (),
) -> None:
    """Write ``plan`` to ``path`` atomically (never onto one of ``inputs``)."""
    write_json(multi_plan_to_dict(plan), Path(path), inputs)


def load_multi_plan(path: str | os.PathLike[str]) -> MultiPlan:
    """Load a multi-plan file."""
    p = Path(path)
    return multi_plan_from_dict(read_json(p), str(p))
