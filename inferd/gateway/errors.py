"""OpenAI error bodies for everything the gateway refuses: `{"error": {"message", "type", "param", "code"}}`.

The gateway cannot import `inferd.server` (it must run without the engine), so it has its own small
error type; the body itself is built by `inferd.errors.error_body`, as the server's is. Its handlers turn
every exception into one of these bodies; an unexpected exception is the only 500, and bad input never
reaches one.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from inferd import strict_json
from inferd.errors import InvalidRequestError, error_body, error_event, error_type

logger = logging.getLogger(__name__)


class GatewayError(Exception):
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
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)

    def sse_event(self) -> bytes:
        """The error as one SSE event, for a stream that already began (no retry is possible then)."""
        return error_event(self.body()).encode()


def bad_request(message: str, param: str | None = None, code: str | None = None) -> GatewayError:
    return GatewayError(400, message, param=param, code=code)


def model_not_found(name: object, known: list[str]) -> GatewayError:
    return GatewayError(
        404,
        f"The model `{name}` does not exist; this gateway serves {sorted(known)}",
        param="model",
        code="model_not_found",
    )


def no_replica(model: str, why: str) -> GatewayError:
    return GatewayError(
        503, f"no replica could serve `{model}`: {why}", "server_error", code="no_replica", headers={"Retry-After": "1"}
    )


def budget_store_unavailable(why: str) -> GatewayError:
    """The budget store (Redis) did not answer: no request is admitted without its budget check."""
    return GatewayError(
        503,
        f"the budget store is unreachable, so no budget can be checked: {why}",
        "server_error",
        code="budget_store_unavailable",
        headers={"Retry-After": "1"},
    )


def timed_out() -> GatewayError:
    """The request outlived `request_timeout_s` before its answer began."""
    return GatewayError(504, "the request timed out at the gateway", "server_error", code="timeout")


def parse_json_body(raw: bytes) -> dict:
    """The request body as a JSON object, read strictly (`inferd.strict_json`: UTF-8, finite numbers, no lone
    surrogates), as the server reads it."""
    try:
        body = strict_json.loads(raw)
    except InvalidRequestError as e:
        raise bad_request(str(e), param=e.param) from None
    except ValueError as e:  # json.JSONDecodeError
        raise bad_request(f"the request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    return body


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(GatewayError)
    async def _on_gateway(request: Request, exc: GatewayError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def _on_http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return GatewayError(exc.status_code, str(exc.detail), error_type(exc.status_code)).response()

    @app.exception_handler(Exception)
    async def _on_any(request: Request, exc: Exception) -> JSONResponse:
        logger.error("unhandled error", exc_info=exc)
        return GatewayError(500, "internal gateway error; see the gateway log", "server_error").response()
