"""JSON files for instances and plans (docs/model.md, spec section 7).

Both formats are pydantic models (:mod:`~ntp_opt.model.files.schema`); their
JSON Schemas are published in ``ntp_opt/schemas/`` (``ntp-opt schema
instance|plan`` prints them). Every file is read under the caps of
:mod:`~ntp_opt.model.files.caps` (:mod:`~ntp_opt.model.files.safe_json`);
loading validates everything and raises :class:`InputError` naming the file
and the field path; unknown fields are errors
(:mod:`~ntp_opt.model.files.loaders`). Files ending in ``.gz`` are
gzip-compressed. Saving writes to a temporary file and renames it, so an
interrupted save never leaves a truncated file behind
(:mod:`~ntp_opt.model.files.dump`).

The caps re-exported here are their values at import: to lower one, set it
on :mod:`ntp_opt.model.files.caps`.
"""

from ntp_opt.model.files.caps import (
    MAX_FILE_BYTES,
    MAX_NODES,
    MAX_STRING_BYTES,
    TOKENS_EXTRA,
    TOKENS_PER_NODE,
)
from ntp_opt.model.files.dump import dumps_indented, write_json
from ntp_opt.model.files.loaders import (
    check_cluster,
    check_format,
    instance_from_dict,
    instance_from_dict_reference,
    instance_to_dict,
    load_instance,
    load_plan,
    plan_from_dict,
    plan_to_dict,
    save_instance,
    save_plan,
)
from ntp_opt.model.files.safe_json import (
    DuplicateKeyError,
    InputError,
    parse_json,
    read_json,
    unique_object,
    validation_problems,
)
from ntp_opt.model.files.schema import (
    INSTANCE_FORMAT,
    PLAN_FORMAT,
    ClusterData,
    DomainNode,
    Finite,
    GpuNode,
    GraphAttrs,
    InstanceFile,
    Link,
    MetricsData,
    Node,
    NodeId,
    PlanFile,
    RackNode,
    ReplicaData,
    StageData,
    SwitchNode,
    TrayNode,
    json_schema,
)

__all__ = [
    "INSTANCE_FORMAT",
    "MAX_FILE_BYTES",
    "MAX_NODES",
    "MAX_STRING_BYTES",
    "PLAN_FORMAT",
    "TOKENS_EXTRA",
    "TOKENS_PER_NODE",
    "ClusterData",
    "DomainNode",
    "DuplicateKeyError",
    "Finite",
    "GpuNode",
    "GraphAttrs",
    "InputError",
    "InstanceFile",
    "Link",
    "MetricsData",
    "Node",
    "NodeId",
    "PlanFile",
    "RackNode",
    "ReplicaData",
    "StageData",
    "SwitchNode",
    "TrayNode",
    "check_cluster",
    "check_format",
    "dumps_indented",
    "instance_from_dict",
    "instance_from_dict_reference",
    "instance_to_dict",
    "json_schema",
    "load_instance",
    "load_plan",
    "parse_json",
    "plan_from_dict",
    "plan_to_dict",
    "read_json",
    "save_instance",
    "save_plan",
    "unique_object",
    "validation_problems",
    "write_json",
]
