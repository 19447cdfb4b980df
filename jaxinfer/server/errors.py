"""Error responses of the server in OpenAI's shape, as vLLM sends them.

Every error is ``{"error": {"message", "type", "param", "code"}}`` with the HTTP status as
``code`` and vLLM's type names: 400 ``BadRequestError`` (malformed body, invalid sampling value,
prompt too long; ``param`` names the field), 404 ``NotFoundError`` (unknown model name: vLLM's
"The model `x` does not exist."), 503 ``ServiceUnavailableError`` (queue full, shutting down),
500 ``InternalServerError`` (the engine failed this request).
"""

from __future__ import annotations

import logging
from http import HTTPStatus

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger("jaxinfer.server")

_TYPES = {
    400: "BadRequestError",
    404: "NotFoundError",
    405: "MethodNotAllowed",
    413: "RequestEntityTooLarge",
    499: "ClientDisconnected",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


class APIError(Exception):
    """An error answered with ``status`` and OpenAI's error body.

    Args:
        message: what is wrong, naming the field.
        param: the request field at fault (dotted path), or None.
        status: the HTTP status (400 by default).
    """

    def __init__(self, message: str, param: str | None = None, status: int = 400):
        super().__init__(message)
        self.message, self.param, self.status = message, param, status


def error_body(message: str, status: int, param: str | None = None) -> dict:
    """OpenAI's error object (vLLM's type names, ``code`` the HTTP status)."""
    kind = _TYPES.get(status) or HTTPStatus(status).phrase.replace(" ", "") + "Error"
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def error_response(e: APIError) -> JSONResponse:
    return JSONResponse(error_body(e.message, e.status, e.param), status_code=e.status)


def _loc_param(loc: tuple) -> str | None:
    """A pydantic error location as a dotted field path (without the leading "body")."""
    parts = [str(p) for p in loc if p != "body"]
    # Union members add their type name ("str", "list[int]", ...) to the path: drop them.
    parts = [
        p
        for p in parts
        if not any(c in p for c in "[]")
        and p not in ("str", "int", "float", "bool", "list", "dict", "function-after", "TextPart")
    ]
    return ".".join(parts) or None


async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    errs = exc.errors()
    first = errs[0] if errs else {"loc": (), "msg": "invalid request", "type": ""}
    param = _loc_param(tuple(first.get("loc", ())))
    if first.get("type") == "json_invalid":
        msg = f"the body is not valid JSON: {first.get('ctx', {}).get('error', first['msg'])}"
        param = None
    elif first.get("type") == "extra_forbidden":
        msg = f"unknown field {param!r}: it is not a parameter of this endpoint"
    else:
        msg = f"{param}: {first.get('msg')}" if param else str(first.get("msg"))
    if len(errs) > 1:
        msg += f" (and {len(errs) - 1} more error(s))"
    return JSONResponse(error_body(msg, 400, param), status_code=400)


async def _api_error(request: Request, exc: APIError) -> JSONResponse:
    return error_response(exc)


async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    return JSONResponse(
        error_body(str(exc.detail), exc.status_code),
        status_code=exc.status_code,
        headers=getattr(exc, "headers", None),
    )


async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
    log.exception("internal error on %s", request.url.path, exc_info=exc)
    return JSONResponse(
        error_body(f"internal error: {type(exc).__name__}: {exc}", 500), status_code=500
    )


def install_error_handlers(app) -> None:
    """Makes every error of ``app`` an OpenAI error body (validation errors become 400s)."""
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _internal_error)
