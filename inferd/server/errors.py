"""OpenAI error bodies and the exception handlers that produce them: bad input is never a 500.

Building an error body must never raise, whatever the client sent: every string that goes into one
is made valid UTF-8 (a lone surrogate becomes its escape) and input echoed back is cut short.
"""

from __future__ import annotations

import logging
from http import HTTPStatus

from fastapi import FastAPI, Request
from fastapi.exceptions import HTTPException, RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from inferd.errors import (
    DrainTimeoutError,
    EngineDeadError,
    EngineOverloadedError,
    InferdError,
    ModelNotFoundError,
    RequestFailedError,
    clean,
    error_body,
    error_type,
)
from inferd.errors import error_event as sse_error_event
from inferd.prompts import invalid_request

logger = logging.getLogger(__name__)

MAX_ECHO = 120  # characters of client input quoted back in an error message


class APIError(HTTPException):
    """An error with an HTTP status, raised by handlers. It is an HTTPException so that FastAPI passes it
    through unchanged when it is raised while the body is parsed."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(status, message, headers)
        self.status = status
        self.body = error_body(message, type, param, code)  # the same body as the gateway's (inferd.errors)


def echo(value: object) -> str:
    """Client input quoted in a message: valid UTF-8 and at most MAX_ECHO characters."""
    text = clean(value if isinstance(value, str) else repr(value))
    return text if len(text) <= MAX_ECHO else text[:MAX_ECHO] + f"... ({len(text)} characters)"


def model_not_found(name: str, served: str) -> APIError:
    return APIError(
        404,
        f"The model `{echo(name)}` does not exist; this server serves `{served}`",
        param="model",
        code="model_not_found",
    )


def to_api_error(exc: BaseException) -> APIError:
    """Map any exception to the error the client sees."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, EngineOverloadedError):
        return APIError(503, str(exc), "server_error", code="overloaded", headers={"Retry-After": str(exc.retry_after)})
    if isinstance(exc, ModelNotFoundError):
        return APIError(404, str(exc), param=exc.param, code="model_not_found")
    if isinstance(exc, InferdError):
        return APIError(400, str(exc), param=exc.param)
    if isinstance(exc, DrainTimeoutError):
        return APIError(503, str(exc), "server_error", code="drain_timeout", headers={"Retry-After": "1"})
    if isinstance(exc, EngineDeadError | RequestFailedError):
        return APIError(500, str(exc), "server_error", code="engine_error")
    logger.error("unhandled error", exc_info=exc)
    return APIError(500, "internal server error; see the server log", "server_error")


def error_response(exc: BaseException) -> JSONResponse:
    err = to_api_error(exc)
    return JSONResponse(err.body, status_code=err.status, headers=err.headers)


def error_event(exc: BaseException) -> str:
    """An error after a stream has begun: one SSE event with the error body (as vLLM sends it)."""
    err = to_api_error(exc)
    return sse_error_event(err.body)


def stream_error(exc: BaseException, request_id: str) -> str:
    """error_event for a stream that began; a stream cut by the drain deadline gets one log line."""
    if isinstance(exc, DrainTimeoutError):
        logger.warning("request %s was still streaming at the drain deadline: ended with an error event", request_id)
    return error_event(exc)


def _validation_error(exc: RequestValidationError) -> APIError:
    errors = exc.errors()
    first = errors[0] if errors else {}
    if first.get("type") == "json_invalid":
        return APIError(400, f"the request body is not valid JSON: {first.get('ctx', {}).get('error', '')}".strip())
    e = invalid_request(errors)
    return APIError(400, str(e), param=e.param)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def _on_validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(_validation_error(exc))

    @app.exception_handler(APIError)
    async def _on_api(request: Request, exc: APIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _on_http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        phrase = HTTPStatus(exc.status_code).phrase if exc.status_code in HTTPStatus._value2member_map_ else ""
        kind = error_type(exc.status_code)
        return error_response(APIError(exc.status_code, str(exc.detail or phrase), kind, headers=exc.headers))

    @app.exception_handler(InferdError)
    async def _on_inferd(request: Request, exc: InferdError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(Exception)
    async def _on_any(request: Request, exc: Exception) -> JSONResponse:
        return error_response(exc)
