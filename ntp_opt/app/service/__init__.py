"""A small HTTP/JSON service for schedulers: ``ntp-opt serve``.

Endpoints take and return the JSON formats of :mod:`ntp_opt.model.files`
(``ntp-opt/instance@1``, ``ntp-opt/plan@1``); the OpenAPI description is at
``/openapi.json`` (browsable at ``/docs``). See ``docs/service.md``.

* ``GET /health`` -- liveness, version, planner names, limits.
* ``POST /solve`` -- instance + planner + time limit -> plan, status, bound, gap.
* ``POST /validate`` -- instance + plan -> feasible, violations.
* ``POST /evaluate`` -- instance + plan -> recomputed metrics and violations.
* ``POST /export/megatron-ntp`` -- instance + plan -> Megatron-LM NTP config and rank table.
* ``POST /replan`` -- instance + running plan + events -> new plan, GPUs moved, bound.

Memory and time are bounded (:class:`Limits`): the server process never parses
a request body. Every ``POST`` first takes one of ``max_requests`` request
slots and reserves room for its body in a byte budget -- before a byte of the
body is read; without room it gets 503 with ``Retry-After``. The body is read
with a size cap (413) and a deadline (408, connection closed), then handed to
a fresh worker process (forked from a ``forkserver`` that has the package
imported), at most ``max_concurrent`` at once. The worker parses, validates
and computes under an address-space limit (``RLIMIT_DATA``; a request that
needs more gets 413) and is killed at its deadline (the solve's time limit
plus a grace, or ``request_timeout``); SIGTERM kills every worker and the
server exits within seconds. The ``Host`` header must name an allowed host
(loopback names by default), against DNS rebinding. Bad input gets 400
(malformed JSON, a key given twice), 415 (a body not sent as
``Content-Type: application/json``) or 422 (schema, NaN/Infinity, topology or semantic
problems), each problem naming its field. FastAPI and uvicorn are optional
dependencies: ``pip install 'ntp-opt[serve]'``.

The package: :mod:`~ntp_opt.app.service.app` (routes, OpenAPI, :func:`serve`),
:mod:`~ntp_opt.app.service.limits` (what may be spent, the checks before a
body is read), :mod:`~ntp_opt.app.service.workers` (worker processes),
:mod:`~ntp_opt.app.service.handlers` (what a worker computes),
:mod:`~ntp_opt.app.service.bodies` (request and response models) and
:mod:`~ntp_opt.app.service.errors` (error bodies).
"""

from ntp_opt.app.service.app import (
    create_app,
    serve,
)
from ntp_opt.app.service.bodies import (
    ErrorResponse,
    EvaluateResponse,
    EventData,
    ExportRequest,
    ExportResponse,
    InstanceJSON,
    PlanJSON,
    Planner,
    PlanRequest,
    ReplanRequest,
    ReplanResponse,
    SolveRequest,
    SolveResponse,
    ValidateResponse,
    ViolationData,
)
from ntp_opt.app.service.errors import (
    MAX_MESSAGE,
)
from ntp_opt.app.service.handlers import (
    handle,
)
from ntp_opt.app.service.limits import (
    BYTES_PER_BODY_BYTE,
    DEFAULT_ALLOWED_HOSTS,
    DEFAULT_BODY_TIMEOUT,
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_CONCURRENT,
    DEFAULT_MAX_REQUESTS,
    DEFAULT_MAX_TIME_LIMIT,
    DEFAULT_MEMORY_BYTES,
    DEFAULT_REQUEST_TIMEOUT,
    DEFAULT_TIME_LIMIT,
    MAX_CONNECTIONS,
    SOLVE_GRACE_S,
    BodyLimit,
    Guard,
    Limits,
)

__all__ = [
    "BYTES_PER_BODY_BYTE",
    "DEFAULT_ALLOWED_HOSTS",
    "DEFAULT_BODY_TIMEOUT",
    "DEFAULT_MAX_BODY_BYTES",
    "DEFAULT_MAX_CONCURRENT",
    "DEFAULT_MAX_REQUESTS",
    "DEFAULT_MAX_TIME_LIMIT",
    "DEFAULT_MEMORY_BYTES",
    "DEFAULT_REQUEST_TIMEOUT",
    "DEFAULT_TIME_LIMIT",
    "MAX_CONNECTIONS",
    "MAX_MESSAGE",
    "SOLVE_GRACE_S",
    "BodyLimit",
    "ErrorResponse",
    "EvaluateResponse",
    "EventData",
    "ExportRequest",
    "ExportResponse",
    "Guard",
    "InstanceJSON",
    "Limits",
    "PlanJSON",
    "PlanRequest",
    "Planner",
    "ReplanRequest",
    "ReplanResponse",
    "SolveRequest",
    "SolveResponse",
    "ValidateResponse",
    "ViolationData",
    "create_app",
    "handle",
    "serve",
]
