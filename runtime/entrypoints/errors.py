"""The server's errors in OpenAI's shape, and the JSON encoder every response goes through.

{"error": {"message", "type", "param", "code"}}: 400 bad input, 401 bad key, 404 unknown
model or path, 413 body too large, 500 a request that failed inside the engine (a bug),
503 + Retry-After queue full / loading / draining / engine dead.
"""

from __future__ import annotations

import json
import logging
import math
from typing import Any

from fastapi.responses import Response

logger = logging.getLogger("shoal.server")

RETRY_AFTER_S = 1


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None, code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code, self.headers = status, message, type_, param, code, headers


def dumps(obj: Any) -> str:
    s = json.dumps(obj, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate echoed from a request: escape it, never fail the response
        s = json.dumps(obj, ensure_ascii=True, separators=(",", ":"), allow_nan=False)
    return s


PROBE_PATHS = ("/health", "/ready", "/metrics", "/kv/blocks")  # polled: access lines at DEBUG


def request_id_of(scope) -> str:
    return (scope.get("state") or {}).get("request_id", "-")


def log_refusal(status: int, method: str, path: str, request_id: str, message: str) -> None:
    """Each 4xx with its reason and request id (5xx are logged where they happen)."""
    if 400 <= status < 500:
        logger.info("%d %s %s request_id=%s: %s", status, method, path, request_id, message[:300].encode("utf-8", "backslashreplace").decode())


def error_body(message: str, type_: str, param: str | None = None, code: Any = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def error_response(status: int, message: str, type_: str = "invalid_request_error", param: str | None = None, code: Any = None, headers: dict | None = None) -> Response:
    return Response(dumps(error_body(message, type_, param, code)), status_code=status, media_type="application/json", headers=headers)


def unavailable(message: str, code: str) -> APIError:
    return APIError(503, message, "service_unavailable", code=code, headers={"Retry-After": str(RETRY_AFTER_S)})


def finite(x: float) -> float:
    # JSON has no -inf; OpenAI-style clients expect a number (vLLM uses the same floor).
    if x is None or math.isnan(x):
        return -9999.0
    return max(float(x), -9999.0)


def install_handlers(app) -> None:
    """Every error leaves in OpenAI's shape: APIError, pydantic's validation errors (400,
    the first five, naming the field), Starlette's HTTP errors (404, 405, 413), and any
    other exception (500: a bug, never the client's fault). Each 4xx is logged."""
    from fastapi import Request
    from fastapi.exceptions import RequestValidationError
    from starlette.exceptions import HTTPException as StarletteHTTPException

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        log_refusal(exc.status, request.method, request.url.path, request_id_of(request.scope), exc.message)
        return error_response(exc.status, exc.message, exc.type, exc.param, exc.code, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        parts, param = [], None
        for err in exc.errors()[:5]:
            if err.get("type") == "json_invalid":
                return _refuse(request, f"the request body is not valid JSON ({err.get('ctx', {}).get('error', 'parse error')})")
            if err.get("loc") in (("body",), ["body"]) and err.get("type") in ("model_attributes_type", "dict_type", "missing"):
                return _refuse(request, "the request body must be a JSON object")
            loc = [str(x) for x in err.get("loc", ()) if x not in ("body", "query")]
            if param is None and loc:
                param = loc[0]
            where = ".".join(loc) or "body"
            parts.append(f"{where}: {err.get('msg', 'invalid')}")
        return _refuse(request, "; ".join(parts) or "invalid request body", param)

    def _refuse(request: Request, message: str, param: str | None = None) -> Response:
        log_refusal(400, request.method, request.url.path, request_id_of(request.scope), message)
        return error_response(400, message, "invalid_request_error", param=param)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        detail = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        if exc.status_code == 404:
            detail = f"no such endpoint: {request.method} {request.url.path}"
        type_ = "invalid_request_error" if exc.status_code < 500 else "server_error"
        log_refusal(exc.status_code, request.method, request.url.path, request_id_of(request.scope), detail)
        return error_response(exc.status_code, detail, type_, headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):  # a bug; never a client's fault
        logger.exception("unhandled error on %s", request.url.path)
        return error_response(500, f"internal error: {type(exc).__name__}", "server_error")
