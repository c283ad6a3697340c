"""OpenAI-shaped JSON errors for the HTTP API, and the handlers that make every failure one.

Every answer that is not a success has the body of the OpenAI API reference's error object::

    {"error": {"message": "...", "type": "invalid_request_error", "param": "temperature",
               "code": null}}

with the status the OpenAI API (and vLLM's OpenAI server) uses for the same mistake: 400 for a
malformed or out-of-range request (pydantic validation errors included, the field named in
``param``), 401 for a missing or wrong bearer token, 404 for an unknown model (``code``
``model_not_found``) or path (``unknown_url``), 405 for a wrong method, 413 for a body over the
limit, 429 (with ``Retry-After``) when the engine's waiting queue is full, 503 while the engine is
stopping. Anything unexpected is a 500 ``server_error`` whose body says only that: the traceback
goes to the server log, never to the client.

:func:`install_error_handlers` registers the handlers on a FastAPI app.
"""

from __future__ import annotations

import logging
from typing import Any

from olmoflow.errors import OlmoflowError

log = logging.getLogger("olmoflow.serve")

INVALID = "invalid_request_error"
REASONS = {400: "Bad Request", 401: "Unauthorized", 403: "Forbidden", 404: "Not Found",
           405: "Method Not Allowed", 413: "Payload Too Large", 415: "Unsupported Media Type",
           422: "Unprocessable Entity", 429: "Too Many Requests", 500: "Internal Server Error",
           503: "Service Unavailable"}


class APIError(OlmoflowError):
    """An error answered as OpenAI's error object.

    Args:
        message: one line for the client.
        status: the HTTP status (default 400).
        type: OpenAI's error ``type`` (default ``invalid_request_error``).
        param: the request field at fault (dotted path, e.g. ``messages.0.role``), or None.
        code: OpenAI's machine-readable ``code`` (``model_not_found``, ``invalid_api_key``,
            ``context_length_exceeded``, ...), or None.
        headers: extra response headers (``Retry-After``, ``WWW-Authenticate``, ``Allow``).
    """

    def __init__(self, message: str, status: int = 400, *, type: str = INVALID,
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.message, self.status, self.type = message, status, type
        self.param, self.code, self.headers = param, code, dict(headers or {})

    def body(self) -> dict[str, Any]:
        """The JSON body: ``{"error": {"message", "type", "param", "code"}}``."""
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str = INVALID, param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    """OpenAI's error object as a dict (also sent as an SSE event when a stream fails)."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def invalid(message: str, param: str | None = None, code: str | None = None) -> APIError:
    """A 400 ``invalid_request_error`` naming ``param``."""
    return APIError(message, 400, param=param, code=code)


def model_not_found(name: str, served: str) -> APIError:
    """404 for a ``model`` other than the one served (the OpenAI API's wording)."""
    return APIError(f"The model '{name}' does not exist; this server serves '{served}'", 404,
                    param="model", code="model_not_found")


def unauthorized(given: bool) -> APIError:
    """401 for a missing or wrong ``Authorization: Bearer`` token."""
    msg = ("Incorrect API key provided" if given else
           "You didn't provide an API key; send it as 'Authorization: Bearer KEY'")
    return APIError(msg, 401, code="invalid_api_key",
                    headers={"WWW-Authenticate": 'Bearer realm="olmoflow"'})


def too_large(limit: int) -> APIError:
    """413 for a body over ``limit`` bytes."""
    return APIError(f"The request body is larger than this server's limit of {limit} bytes "
                    "(--max-body-bytes)", 413, code="request_too_large")


def queue_full(waiting: int, retry_after: int = 1) -> APIError:
    """429 when the engine already has ``waiting`` requests queued; ``Retry-After`` seconds."""
    return APIError(f"The server is busy: {waiting} request(s) already waiting; retry in "
                    f"{retry_after} s", 429, type="rate_limit_error", code="rate_limit_exceeded",
                    headers={"Retry-After": str(retry_after)})


def unavailable(message: str = "The engine is stopping; retry on another server") -> APIError:
    """503 while the engine is shutting down (requests aborted by it)."""
    return APIError(message, 503, type="server_error", code="engine_unavailable",
                    headers={"Retry-After": "1"})


def server_error(detail: str | None = None) -> APIError:
    """500 with no traceback; ``detail`` is a one-line cause safe to show (or None)."""
    msg = "The server had an error while processing your request"
    return APIError(msg + (f": {detail}" if detail else ""), 500, type="server_error")


def install_error_handlers(app: Any, validation_error: Any) -> None:
    """Register handlers on a FastAPI ``app`` so that :class:`APIError`, Starlette's
    ``HTTPException`` (unknown path 404, wrong method 405, ...), FastAPI's request validation
    errors (turned into an :class:`APIError` by ``validation_error(errors)``, the protocol's
    wording) and any other exception all answer OpenAI's JSON error object."""
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse
    from starlette.exceptions import HTTPException

    def respond(e: APIError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    async def on_api(request, exc: APIError):  # noqa: ANN001 (Starlette handler signature)
        return respond(exc)

    async def on_http(request, exc: HTTPException):  # noqa: ANN001
        status = exc.status_code
        headers = dict(exc.headers or {})
        if status == 404:
            err = APIError(f"Unknown request URL: {request.method} {request.url.path}. Please "
                           "check the URL for typos (the API is under /v1)", 404,
                           code="unknown_url")
        elif status == 405:
            err = APIError(f"Method {request.method} is not allowed for "
                           f"{request.url.path}", 405, code="method_not_allowed")
        else:
            detail = exc.detail if isinstance(exc.detail, str) else REASONS.get(status, "error")
            err = APIError(detail, status, type=INVALID if status < 500 else "server_error")
        err.headers.update(headers)
        return respond(err)

    async def on_validation(request, exc: RequestValidationError):  # noqa: ANN001
        return respond(validation_error(exc.errors()))

    async def on_any(request, exc: Exception):  # noqa: ANN001
        log.error("unexpected error on %s %s", request.method, request.url.path, exc_info=exc)
        return respond(server_error())

    app.add_exception_handler(APIError, on_api)
    app.add_exception_handler(HTTPException, on_http)
    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(Exception, on_any)
