"""The error bodies of the service: ``{"error": ..., "problems": [{"field", "message"}]}``."""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse

from ntp_opt.model.echo import echo


class Reject(Exception):
    """A request the service refuses, with its status and problems (``(field, message)``)."""

    def __init__(self, status: int, error: str, problems: list[tuple[str, str]] | None = None):
        super().__init__(error)
        self.status = status
        self.error = error
        self.problems = problems or []


#: Characters of an error message or field name in an error body (echoes are cut).
MAX_MESSAGE = 500


def error_body(error: str, problems: list[tuple[str, str]] | None = None) -> dict[str, Any]:
    """An error body; every text printable (a dashboard shows it) and cut at :data:`MAX_MESSAGE`."""
    return {
        "error": echo(error, MAX_MESSAGE),
        "problems": [
            {"field": echo(f, MAX_MESSAGE), "message": echo(m, MAX_MESSAGE)}
            for f, m in problems or []
        ],
    }


def error_response(
    status: int,
    error: str,
    problems: list[tuple[str, str]] | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    """An error response with status ``status`` and the body of :func:`error_body`."""
    return JSONResponse(status_code=status, content=error_body(error, problems), headers=headers)
