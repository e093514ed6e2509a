"""OpenAI-style errors: ``APIError``, the one JSON error response every route (and the agent endpoint,
``areno.rl.agentic.endpoint``) answers with, and the exception handlers that give unknown routes, wrong methods, failed
validation and unexpected exceptions that same body."""

from __future__ import annotations

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException


class APIError(Exception):
    """An error answered as ``{"error": {"message", "type", "param", "code"}}`` with HTTP ``status``."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param=None, code=None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def error_response(exc: APIError, headers: dict | None = None) -> JSONResponse:
    """The JSON response of an ``APIError``."""
    return JSONResponse(exc.body(), status_code=exc.status, headers=headers)


async def api_error(request, exc: APIError) -> JSONResponse:
    return error_response(exc)


async def http_error(request, exc: StarletteHTTPException) -> JSONResponse:
    """Unknown routes and wrong methods, OpenAI-shaped."""
    where = f"{request.method} {request.url.path}"
    if exc.status_code == 404:
        message, code = f"Invalid URL ({where}): no such route", "not_found"
    elif exc.status_code == 405:
        allowed = (exc.headers or {}).get("Allow") or (exc.headers or {}).get("allow")
        message = f"Method not allowed ({where})" + (f"; this route allows {allowed}" if allowed else "")
        code = "method_not_allowed"
    else:
        message, code = str(exc.detail), None
    return error_response(APIError(exc.status_code, message, code=code), headers=exc.headers)


async def validation_error(request, exc: RequestValidationError) -> JSONResponse:
    err = (exc.errors() or [{}])[0]
    param = ".".join(str(p) for p in err.get("loc", ())) or None
    return error_response(APIError(400, f"{param}: {err.get('msg', 'invalid request')}", param=param))


async def unexpected_error(request, exc: Exception) -> JSONResponse:
    """Never a bare 500 page: still an OpenAI-shaped body."""
    return error_response(APIError(500, f"internal error: {exc}", type="server_error"))


def add_error_handlers(app) -> None:
    """Answer every error raised on ``app`` with the OpenAI error body."""
    app.add_exception_handler(APIError, api_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(Exception, unexpected_error)
