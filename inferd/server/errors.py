"""OpenAI error bodies and the exception handlers that produce them: bad input is never a 500."""

from __future__ import annotations

import json
import logging
from http import HTTPStatus

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from inferd.engine.async_engine import EngineDeadError, EngineOverloadedError, RequestFailedError
from inferd.errors import InferdError
from inferd.server.protocol import ErrorInfo, ErrorResponse

logger = logging.getLogger(__name__)


class APIError(Exception):
    """An error with an HTTP status, raised by handlers."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.info = ErrorInfo(message=message, type=type, param=param, code=code)
        self.headers = headers


def model_not_found(name: str, served: str) -> APIError:
    return APIError(
        404, f"The model `{name}` does not exist; this server serves `{served}`", param="model", code="model_not_found"
    )


def to_api_error(exc: BaseException) -> APIError:
    """Map any exception to the error the client sees."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, EngineOverloadedError):
        return APIError(503, str(exc), "server_error", code="overloaded", headers={"Retry-After": str(exc.retry_after)})
    if isinstance(exc, InferdError):
        return APIError(400, str(exc), param=exc.param)
    if isinstance(exc, EngineDeadError | RequestFailedError):
        return APIError(500, str(exc), "server_error", code="engine_error")
    logger.error("unhandled error", exc_info=exc)
    return APIError(500, "internal server error; see the server log", "server_error")


def error_response(exc: BaseException) -> JSONResponse:
    err = to_api_error(exc)
    return JSONResponse(ErrorResponse(error=err.info).model_dump(), status_code=err.status, headers=err.headers)


def error_event(exc: BaseException) -> str:
    """An error after a stream has begun: one SSE event with the error body (as vLLM sends it)."""
    err = to_api_error(exc)
    return f"data: {json.dumps({'error': err.info.model_dump()})}\n\n"


def _validation_error(exc: RequestValidationError) -> APIError:
    errors = exc.errors()
    first = errors[0] if errors else {}
    loc = [str(x) for x in first.get("loc", ()) if x != "body"]
    if first.get("type") == "json_invalid":
        return APIError(400, f"the request body is not valid JSON: {first.get('ctx', {}).get('error', '')}".strip())
    param = ".".join(loc) or None
    details = "; ".join(f"{'.'.join(str(x) for x in e.get('loc', ()) if x != 'body')}: {e.get('msg')}" for e in errors)
    return APIError(400, f"invalid request: {details}", param=param)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def _on_validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(_validation_error(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _on_http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        phrase = HTTPStatus(exc.status_code).phrase if exc.status_code in HTTPStatus._value2member_map_ else ""
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return error_response(APIError(exc.status_code, str(exc.detail or phrase), kind))

    @app.exception_handler(APIError)
    async def _on_api(request: Request, exc: APIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(InferdError)
    async def _on_inferd(request: Request, exc: InferdError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(Exception)
    async def _on_any(request: Request, exc: Exception) -> JSONResponse:
        return error_response(exc)
