"""The ASGI guard in front of the app: the X-Request-Id, the API key, the body size cap."""

from __future__ import annotations

import hmac
import uuid

from starlette.exceptions import HTTPException as StarletteHTTPException

from shoal.runtime.entrypoints.errors import error_response, log_refusal, request_id_of


class GuardMiddleware:
    """Bearer API key on /v1/* (constant-time compare) and the request-body size cap.

    Pure ASGI (no BaseHTTPMiddleware) so streaming responses and disconnects pass through
    untouched."""

    def __init__(self, app, api_key: str | None, max_body_bytes: int):
        self.app = app
        self.api_key = api_key.encode() if api_key else None
        self.max_body = max_body_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        headers = dict(scope.get("headers") or [])
        # X-Request-Id: the client's (printable ASCII, at most 128 characters) or a new one;
        # echoed on the response and written in the log line of every refusal.
        rid = headers.get(b"x-request-id", b"")
        rid = rid.decode("ascii") if 0 < len(rid) <= 128 and rid.isascii() and rid.decode("ascii").isprintable() else uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = rid
        rid_header = (b"x-request-id", rid.encode("ascii"))
        inner_send = send

        async def send(message):
            if message["type"] == "http.response.start":
                message = dict(message, headers=[*message.get("headers", []), rid_header])
            await inner_send(message)

        if self.api_key is not None and path.startswith("/v1"):
            auth = headers.get(b"authorization", b"")
            scheme, _, token = auth.partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.api_key):
                log_refusal(401, scope.get("method", ""), path, rid, "missing or invalid API key")
                resp = error_response(401, "Missing or invalid API key: send 'Authorization: Bearer <key>'.", "invalid_request_error", code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
                return await resp(scope, receive, send)
        if path.startswith("/v1") and not headers.get(b"content-type", b"").lower().startswith(b"application/json"):
            # Bodies are JSON whatever the client labels them (curl -d sends form-urlencoded).
            scope = dict(scope, headers=[(k, v) for k, v in scope["headers"] if k != b"content-type"] + [(b"content-type", b"application/json")])
        length = headers.get(b"content-length")
        if length is not None:
            try:
                too_big = int(length) > self.max_body
            except ValueError:
                return await error_response(400, "invalid Content-Length header")(scope, receive, send)
            if too_big:
                return await self._too_large(scope, receive, send)
        received = 0
        max_body = self.max_body

        async def limited_receive():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > max_body:
                    raise StarletteHTTPException(413, f"request body larger than {max_body} bytes")
            return message

        return await self.app(scope, limited_receive, send)

    async def _too_large(self, scope, receive, send):
        log_refusal(413, scope.get("method", ""), scope.get("path", ""), request_id_of(scope), f"body larger than {self.max_body} bytes")
        resp = error_response(413, f"request body larger than {self.max_body} bytes", "invalid_request_error", code="request_too_large", headers={"Connection": "close"})
        await resp(scope, receive, send)
