"""The router's HTTP side: the same endpoints as `shoal serve`, each request sent on to a backend.

    POST /v1/completions, /v1/chat/completions   picked by prefix and load (picker.py)
    GET /v1/models, POST /tokenize, ...          the least-loaded ready backend
    /health                                      the router's own process
    /ready                                       200 once started, even with no backend ready: requests
                                                 are then held (scale from zero), not refused
    /metrics                                     shoal_router_* (metrics.py)

A request's life: read the body (capped), hash its prompt (hashing.py), rank the ready
backends, send it to the first. A connection error or a 503 before the first byte moves it
to the next (the error of a backend that already sent bytes reaches the client, as it
would from a server). With no backend ready the request is held, at most --max-pending of
them, each at most --pending-timeout seconds, woken the moment a poller sees a backend
turn ready; past the bound, 503 + Retry-After. A client that leaves before the first byte
ends its request here: a held one leaves the pending count at once and is never sent, one
in flight has its connection to the group closed, so the group aborts it.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import logging
import time

import aiohttp
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from shoal.runtime.entrypoints.errors import RETRY_AFTER_S, dumps, error_response, install_handlers
from shoal.runtime.router import picker
from shoal.runtime.router.backends import Backend, Backends
from shoal.runtime.router.hashing import PromptHasher
from shoal.runtime.router.router_metrics import RouterMetrics

logger = logging.getLogger("shoal.router")

# never passed on, either way (RFC 9110 hop-by-hop, and what the transport sets itself)
HOP = {"host", "connection", "keep-alive", "proxy-connection", "transfer-encoding", "te", "trailer", "upgrade", "content-length"}
AFFINITY_SESSIONS = 65536  # session -> backend entries kept (least recently used dropped)


class Router:
    def __init__(self, backends: Backends, hasher: PromptHasher, *, prefix_weight: float = 1.0, load_weight: float = 1.0,
                 policy: str = "prefix", session_header: str | None = None, max_pending: int = 1024,
                 pending_timeout: float = 60.0, max_body_bytes: int = 8 * 2**20):
        if policy not in ("prefix", "round-robin"):
            raise ValueError(f"policy must be prefix or round-robin, not {policy!r}")
        self.backends, self.hasher = backends, hasher
        self.prefix_weight, self.load_weight, self.policy = prefix_weight, load_weight, policy
        self.session_header = session_header.lower() if session_header else None
        self.sessions: collections.OrderedDict[str, str] = collections.OrderedDict()
        self.max_pending, self.pending_timeout, self.max_body_bytes = max_pending, pending_timeout, max_body_bytes
        self.metrics = RouterMetrics()
        self.num_pending = 0
        self._rr = itertools.count()
        self.client: aiohttp.ClientSession | None = None
        backends.on_change = lambda b: self.metrics.backend_polled(b, picker.load(b.view()))
        backends.on_forget = self.metrics.forget
        hasher.on_skip = lambda why: self.metrics.unhashed.labels(why).inc()

    async def start(self) -> None:
        # aiohttp, not httpx, for the hop: its request path costs a fraction of httpx's, which
        # was most of the router's added latency (measured in docs/router.md).
        # No read timeout: a non-streamed completion sends nothing until it is done. Bytes pass
        # as they are (no decompression) and the client's headers go as the client sent them.
        self.client = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, limit_per_host=0, keepalive_timeout=60),
            timeout=aiohttp.ClientTimeout(total=None, connect=2.0, sock_read=None),
            auto_decompress=False, skip_auto_headers=("User-Agent", "Accept-Encoding", "Accept", "Content-Type"),
            cookie_jar=aiohttp.DummyCookieJar())
        await self.backends.start()

    async def stop(self) -> None:
        await self.backends.stop()
        if self.client is not None:
            await self.client.close()
        self.hasher.close()

    # -- the choice --------------------------------------------------------------------------
    def rank(self, hashes: list[int], session: str | None, refused: set[str], adapter: str | None = None) -> tuple[list[Backend], str]:
        ready = [b for b in self.backends.all if b.ready and b.name not in refused]
        if not ready:
            return [], "none"
        if self.policy == "round-robin":
            k = next(self._rr) % len(ready)
            return ready[k:] + ready[:k], "round_robin"
        ranked = picker.rank([b.view() for b in ready], hashes, self.prefix_weight, self.load_weight, adapter)
        for r in ranked:
            self.metrics.score.labels(r.view.name).set(r.score)
        order = [self.backends.by_url[r.view.name] for r in ranked]
        why = picker.reason(ranked)
        if session is not None and (home := self.sessions.get(session)) is not None:
            mine = [b for b in order if b.name == home]
            if mine:
                order = mine + [b for b in order if b.name != home]
                why = "affinity"
        return order, why

    def _remember(self, session: str | None, b: Backend) -> None:
        if session is None:
            return
        self.sessions[session] = b.name
        self.sessions.move_to_end(session)
        while len(self.sessions) > AFFINITY_SESSIONS:
            self.sessions.popitem(last=False)

    # -- one request -------------------------------------------------------------------------
    async def handle(self, request: Request) -> Response:
        t0 = time.perf_counter()
        body = await request.body()
        if len(body) > self.max_body_bytes:
            return error_response(413, f"request body larger than {self.max_body_bytes} bytes", code="request_too_large")
        path = request.url.path
        hashes: list[int] = []
        adapter = None  # the body's model: a LoRA adapter's name, if a backend holds one by that name
        if request.method == "POST" and path in ("/v1/completions", "/v1/chat/completions") and self.policy == "prefix":
            data = _json(body)
            hashes = await self.hasher.hashes(path, data, self.backends.block_size(), self.backends.max_model_len())
            adapter = data.get("model") if isinstance(data, dict) and isinstance(data.get("model"), str) else None
        session = request.headers.get(self.session_header) if self.session_header else None
        headers = [(k, v) for k, v in request.headers.items() if k.lower() not in HOP]
        rid = (request.scope.get("state") or {}).get("request_id")
        if rid and not any(k.lower() == "x-request-id" for k, _ in headers):
            headers.append(("x-request-id", rid))
        target = path + (f"?{request.url.query}" if request.url.query else "")
        return await self._unless_gone(request, self._send(request.method, target, headers, body, hashes, session, t0, adapter))

    async def _unless_gone(self, request: Request, sending) -> Response:
        """`sending` (held, then sent, up to the first byte), cancelled the moment the client
        disconnects: a held request then leaves the pending count and is never sent, one in
        flight has its connection to the group closed (the group aborts it)."""
        send = asyncio.ensure_future(sending)
        gone = asyncio.ensure_future(_disconnect(request.receive))
        try:
            await asyncio.wait((send, gone), return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not send.done():
                send.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await send
                self.metrics.abandoned.inc()
                logger.info("client gone before the first byte: request dropped")
        if send.cancelled():
            return Response(status_code=499)  # nobody is there to read it
        return send.result()

    async def _send(self, method, target, headers, body, hashes, session, t0: float, adapter: str | None = None) -> Response:
        deadline = time.monotonic() + self.pending_timeout
        refused: set[str] = set()  # backends that answered 503 to this request
        last_refusal: Response | None = None
        attempts, first = 0, True
        max_attempts = 2 * max(1, len(self.backends.by_url)) + 2
        while True:
            order, why = self.rank(hashes, session, refused, adapter)
            if not order:
                if last_refusal is not None and not any(b.ready and b.name not in refused for b in self.backends.all):
                    return last_refusal  # every ready backend is refusing: its 503 (and Retry-After)
                refusal = await self._hold(deadline)
                if refusal is not None:
                    return refusal
                continue
            b = order[0]
            if first:
                self.metrics.picks.labels(why).inc()
                self.metrics.overhead.observe(time.perf_counter() - t0)
                first = False
            else:
                self.metrics.retries.inc()
            attempts += 1
            outcome = await self._try(b, method, target, headers, body, hashes, adapter)
            if isinstance(outcome, Response) and outcome.status_code != 503:
                self._remember(session, b)
                return outcome
            if isinstance(outcome, Response):  # 503: loading, draining, queue full
                refused.add(b.name)
                last_refusal = outcome
            if attempts >= max_attempts:
                return last_refusal or _unavailable("no backend could take the request", "no_backend")

    async def _hold(self, deadline: float) -> Response | None:
        """Wait for a ready backend (None) or refuse with 503."""
        if self.num_pending >= self.max_pending:
            self.metrics.rejected.labels("pending_full").inc()
            return _unavailable(f"no backend is ready and {self.max_pending} requests already wait (--max-pending)", "pending_full")
        self.num_pending += 1
        self.metrics.pending.set(self.num_pending)
        try:
            ok = await self.backends.wait_ready(max(0.0, deadline - time.monotonic()))
        finally:
            self.num_pending -= 1
            self.metrics.pending.set(self.num_pending)
        if not ok:
            self.metrics.rejected.labels("no_backend").inc()
            return _unavailable(f"no backend became ready within {self.pending_timeout:g} s (--pending-timeout)", "no_backend")
        return None

    async def _try(self, b: Backend, method, target, headers, body, hashes, adapter: str | None = None):
        """A Response to pass on (503 included), or None when the backend failed before a byte."""
        b.in_flight += 1
        done = False
        resp = None
        try:
            resp = await self.client.request(method, b.url + target, headers=headers, data=body or None,
                                             allow_redirects=False, compress=None)
            if resp.status == 503:
                data = await resp.read()
                return Response(data, 503, headers=_pass_headers(resp.headers, b))
            chunks = resp.content.iter_any()
            try:
                head = await chunks.__anext__()  # the first byte decides: before it, another backend may try
            except StopAsyncIteration:
                head = b""
            if hashes and resp.status == 200:
                b.expect(hashes)
            if adapter is not None and resp.status == 200 and b.base_model is not None and adapter != b.base_model:
                b.adapters.add(adapter)  # it loads the adapter now: count it before the next poll does
            done = True
            return _Relay(b, resp, head, chunks, _pass_headers(resp.headers, b))
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError) as e:
            self.backends.mark_down(b, f"{type(e).__name__}: {e}" if resp is None
                                    else f"failed before the first byte: {type(e).__name__}")
            return None
        finally:
            if not done:
                b.in_flight -= 1
                if resp is not None:
                    resp.close()


class _Relay(StreamingResponse):
    """The backend's response, passed through as it comes; the backend's request slot and
    connection are given back once, however the relay ends (done, client gone, never sent)."""

    def __init__(self, b: Backend, resp: aiohttp.ClientResponse, head: bytes, chunks, headers: dict):
        self._backend, self._resp, self._released = b, resp, False
        super().__init__(self._body(head, chunks), resp.status, headers=headers)

    async def _body(self, head: bytes, chunks):
        try:
            if head:
                yield head
            async for chunk in chunks:
                yield chunk
        finally:
            await self._release()

    async def _release(self) -> None:
        if not self._released:
            self._released = True
            self._backend.in_flight -= 1
            self._resp.release()  # read to its end: the connection goes back to the pool

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._release()


def _pass_headers(h, b: Backend) -> dict:
    out = {k: v for k, v in h.items() if k.lower() not in HOP and k.lower() not in ("x-request-id", "date", "server")}
    out["x-shoal-backend"] = b.name  # which group answered (logs, tests)
    return out


async def _disconnect(receive) -> None:
    """Returns when the client disconnects (the body is already read: nothing else comes)."""
    try:
        while (await receive())["type"] != "http.disconnect":
            pass
    except Exception:  # noqa: BLE001 - a server that cannot tell: never taken for a disconnect
        await asyncio.Future()


def _unavailable(message: str, code: str) -> Response:
    return error_response(503, message, "service_unavailable", code=code, headers={"Retry-After": str(RETRY_AFTER_S)})


def _json(body: bytes):
    import json

    try:
        return json.loads(body)
    except (ValueError, RecursionError):  # not JSON, or nested past Python's stack: the server will say
        return None


def build_app(router: Router) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app):
        await router.start()
        yield
        await router.stop()

    app = FastAPI(title="Shoal router", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.router = router
    install_handlers(app)

    def json_response(obj, status: int = 200) -> Response:
        return Response(dumps(obj), status_code=status, media_type="application/json")

    @app.get("/health")
    async def health():
        return json_response({"status": "ok"})

    @app.get("/ready")
    async def ready():
        ready = [b.name for b in router.backends.ready()]
        return json_response({"status": "ready", "backends_ready": len(ready), "backends": len(router.backends.by_url),
                              "detail": "requests are held until a backend is ready" if not ready else "ready"})

    @app.get("/metrics")
    async def metrics():
        body, ctype = router.metrics.render()
        return Response(body, media_type=ctype)

    @app.get("/router/backends")
    async def backends():
        return json_response({"backends": [
            {"url": b.url, "ready": b.ready, "blocks": len(b.blocks), "running": b.running, "waiting": b.waiting,
             "in_flight": b.in_flight, "kv_cache_usage": b.kv_usage, "load": picker.load(b.view()), "error": b.last_error}
            for b in router.backends.all]})

    async def forward(request: Request):
        return await router.handle(request)

    for path, methods in (("/v1/completions", ["POST"]), ("/v1/chat/completions", ["POST"]), ("/v1/models", ["GET"]),
                          ("/v1/models/{model_id:path}", ["GET"]), ("/tokenize", ["POST"]), ("/detokenize", ["POST"]),
                          ("/tokenizer_info", ["GET"]), ("/version", ["GET"]), ("/load", ["GET"])):
        app.add_api_route(path, forward, methods=methods, include_in_schema=False)
    return app


FORWARDED = {("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("GET", "/v1/models"), ("POST", "/tokenize"),
             ("POST", "/detokenize"), ("GET", "/tokenizer_info"), ("GET", "/version"), ("GET", "/load")}


class HotPath:
    """ASGI: the forwarded requests go straight to Router.handle, every other request to the
    FastAPI app (whose same routes still answer 405 for a wrong method). FastAPI's routing,
    dependency solving and exception layers cost ~0.5 ms a request, a quarter of what the
    hop may add (docs/router.md); a forwarded request needs none of them."""

    def __init__(self, app: FastAPI, router: Router):
        self.app, self.router = app, router

    async def __call__(self, scope, receive, send):
        method, path = scope.get("method"), scope.get("path", "")
        if scope["type"] != "http" or not ((method, path) in FORWARDED or (method == "GET" and path.startswith("/v1/models/"))):
            return await self.app(scope, receive, send)
        try:
            response = await self.router.handle(Request(scope, receive))
        except StarletteHTTPException as e:  # the guard's body cap, met while reading
            response = error_response(e.status_code, str(e.detail), code="request_too_large" if e.status_code == 413 else None)
        except Exception:  # noqa: BLE001 - a bug of ours: a 500 in OpenAI's shape, the router goes on
            logger.exception("router: %s %s failed", method, path)
            response = error_response(500, "the router failed on this request", "internal_error")
        await response(scope, receive, send)
