"""`shoal serve`: the engine behind FastAPI on uvicorn, with the HTTP contract of DESIGN.md.

    /v1/completions, /v1/chat/completions   OpenAI bodies; stream: true -> SSE ending in [DONE]
    /v1/models                              the served model
    /health                                 alive and the engine loop making progress (watchdog)
    /ready                                  loaded + KV cache + warm-up done, group joined, not draining
    /metrics                                Prometheus text (shoal_*)

Life of a server: uvicorn binds at once (so probes answer while the model loads), the engine
is built on its own thread (AsyncEngine), /ready turns 200 when it is loaded. On SIGTERM
/ready turns 503 at once, new requests get 503 + Retry-After, in-flight requests finish
(bounded by --drain-timeout, then aborted), and the process exits 0. A second signal exits
at once.

Errors always have OpenAI's shape {"error": {"message", "type", "param", "code"}}: 400 bad
input, 401 bad key, 404 unknown model or path, 413 body too large, 503 queue full / loading /
draining. Nothing a client sends should produce a 5xx.

Every value that reaches a tensor is validated and bounded here, at the edge (protocol.py);
prompts are rendered and tokenized on a thread pool (prompts.py), never on the event loop
or the engine's step, and one whose size alone proves it cannot fit is refused before.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import math
import os
import signal
import threading
import time
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from shoal.runtime.engine.async_engine import Accepted, AsyncEngine, EngineDead, EngineNotReady, Failed, NeverFits, Output, QueueFull, Rejected
from shoal.runtime.entrypoints.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    ErrorResponse,
    ModelList,
)
from shoal.runtime.entrypoints.prompts import PromptTokenizer, PromptTooLong, context_error
from shoal.runtime.metrics import ServerMetrics

logger = logging.getLogger("shoal.server")

RETRY_AFTER_S = 1
_DISCONNECTED = object()


# ------------------------------------------------------------------------------ errors
class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None, code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code, self.headers = status, message, type_, param, code, headers


def _dumps(obj: Any) -> str:
    s = json.dumps(obj, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate echoed from a request: escape it, never fail the response
        s = json.dumps(obj, ensure_ascii=True, separators=(",", ":"), allow_nan=False)
    return s


PROBE_PATHS = ("/health", "/ready", "/metrics")


def request_id_of(scope) -> str:
    return (scope.get("state") or {}).get("request_id", "-")


def log_refusal(status: int, method: str, path: str, request_id: str, message: str) -> None:
    """Each 4xx with its reason and request id (5xx are logged where they happen)."""
    if 400 <= status < 500:
        logger.info("%d %s %s request_id=%s: %s", status, method, path, request_id, message[:300].encode("utf-8", "backslashreplace").decode())


def error_body(message: str, type_: str, param: str | None = None, code: Any = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def error_response(status: int, message: str, type_: str = "invalid_request_error", param: str | None = None, code: Any = None, headers: dict | None = None) -> Response:
    return Response(_dumps(error_body(message, type_, param, code)), status_code=status, media_type="application/json", headers=headers)


def unavailable(message: str, code: str) -> APIError:
    return APIError(503, message, "service_unavailable", code=code, headers={"Retry-After": str(RETRY_AFTER_S)})


def _finite(x: float) -> float:
    # JSON has no -inf; OpenAI-style clients expect a number (vLLM uses the same floor).
    if x is None or math.isnan(x):
        return -9999.0
    return max(float(x), -9999.0)


# ------------------------------------------------------------------------------ ASGI middleware
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


# ------------------------------------------------------------------------------ server state
class ServerState:
    def __init__(self, config, *, api_key: str | None = None, max_waiting: int = 512, stall_timeout: float = 60.0, drain_timeout: float = 30.0, max_body_bytes: int = 8 * 2**20, engine_factory=None,
                 chat_template: str | None = None, max_logprobs: int = 20, log_stats_interval: float = 10.0):
        self.config = config
        self.chat_template = chat_template
        self.max_logprobs = max_logprobs
        self.log_stats_interval = log_stats_interval
        self.prompts: PromptTokenizer | None = None
        self.model_name = config.name
        self.api_key = api_key
        self.drain_timeout = drain_timeout
        self.max_body_bytes = max_body_bytes
        self.metrics = ServerMetrics(self.model_name)
        self.engine = AsyncEngine(config, max_waiting=max_waiting, stall_timeout=stall_timeout, metrics=self.metrics, engine_factory=engine_factory)
        self.created = int(time.time())
        self.draining = False
        # Hook for tensor/pipeline-parallel groups: the executor clears this until every rank
        # of the group has joined, and sets it again when they have. One process: joined.
        self.group_joined = threading.Event()
        self.group_joined.set()
        self.loop: asyncio.AbstractEventLoop | None = None
        self.uvicorn = None
        self.exit_code = 0
        self._tok_cache: dict[int, str] = {}
        # the gauge tells what /ready tells, read at each scrape (an engine that died turns it 0)
        self.metrics.ready.set_function(lambda: 1.0 if self.ready()[0] else 0.0)

    # -- readiness ----------------------------------------------------------------------
    def ready(self) -> tuple[bool, str]:
        if self.draining:
            return False, "draining"
        if self.engine.state in ("created", "loading"):
            return False, "loading the model"
        ok, why = self.engine.health()
        if not ok:
            return False, why
        if not self.engine.ready:
            return False, f"engine {self.engine.state}"
        group_ready = getattr(getattr(self.engine.engine, "executor", None), "group_ready", None)
        if not self.group_joined.is_set() or (callable(group_ready) and not group_ready()):
            return False, "waiting for the parallel group to join"
        return True, "ready"

    def check_accepting(self) -> None:
        if self.draining:
            self.metrics.rejected("draining")
            raise unavailable("the server is shutting down (draining); retry on another replica", "draining")
        try:
            self.engine.admit(0)
        except EngineNotReady as e:
            self.metrics.rejected("loading")
            raise unavailable(str(e), "model_loading") from None
        except EngineDead as e:
            self.metrics.rejected("engine_dead")
            raise unavailable(str(e), "engine_dead") from None

    def check_model(self, model: str | None) -> None:
        if model is not None and model not in (self.model_name, self.config.model):
            raise APIError(404, f"The model '{model}' does not exist; this server serves '{self.model_name}'.", "invalid_request_error", param="model", code="model_not_found")

    def on_loaded(self) -> None:
        e = self.engine
        if e.state == "failed":
            logger.error("startup failed: %s", e.error)
            self.exit_code = 1
            if self.uvicorn is not None:
                self.uvicorn.should_exit = True
            return
        for phase, seconds in e.load_times.items():
            self.metrics.startup_phase(phase, seconds)
            logger.info("startup phase %-9s %7.2f s", phase, seconds)
        self.prompts = PromptTokenizer(e.tokenizer, e.max_model_len, chat_template=self.chat_template)
        if self.chat_template:
            e.tokenizer.chat_template = self.chat_template
        logger.info("model %s ready: max_model_len %s", self.model_name, e.max_model_len)

    # -- tokens ---------------------------------------------------------------------------
    def tok_str(self, token_id: int) -> str:
        s = self._tok_cache.get(token_id)
        if s is None:
            try:
                s = self.engine.tokenizer.decode([token_id])
            except Exception:  # noqa: BLE001
                s = ""
            self._tok_cache[token_id] = s
        return s

    # -- the periodic stats line -----------------------------------------------------------
    async def log_stats_forever(self) -> None:
        """A line every log_stats_interval seconds, as vLLM prints: throughput since the last
        line, running and waiting requests, KV cache use, prefix cache hit rate. At INFO while
        there is (or just was) work, at DEBUG when idle."""
        last, last_t, was_active = None, time.monotonic(), False
        while True:
            await asyncio.sleep(self.log_stats_interval)
            st = self.engine.stats
            if st is None:
                continue
            now = time.monotonic()
            dt, last_t = max(now - last_t, 1e-9), now
            if last is None:
                last = type(st)(**{k: 0 for k in vars(st)}) if hasattr(st, "__dict__") else st
            prompt_tps = (st.prompt_tokens - last.prompt_tokens) / dt
            gen_tps = (st.generation_tokens - last.generation_tokens) / dt
            queries = st.prefix_cache_queries - last.prefix_cache_queries
            hits = st.prefix_cache_hits - last.prefix_cache_hits
            waiting = self.engine.num_waiting
            active = bool(prompt_tps or gen_tps or st.num_running or waiting)
            (logger.info if active or was_active else logger.debug)(
                "Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, Running: %d reqs, "
                "Waiting: %d reqs, KV cache usage: %.1f%%, Prefix cache hit rate: %.1f%%",
                prompt_tps, gen_tps, st.num_running, waiting, 100 * st.kv_cache_usage, 100 * hits / queries if queries else 0.0)
            last, was_active = st, active

    # -- draining -------------------------------------------------------------------------
    def start_drain(self) -> None:
        if getattr(self, "_drain_task", None) is not None:
            return
        self.draining = True
        self._drain_task = asyncio.ensure_future(self._drain())

    async def _drain(self) -> None:
        live = self.engine.num_live
        logger.info("draining: /ready is 503, refusing new requests; %d in flight, up to %.0f s", live, self.drain_timeout)
        deadline = time.monotonic() + self.drain_timeout
        while self.engine.num_live > 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.engine.num_live > 0:
            logger.warning("drain timeout: aborting %d request(s)", self.engine.num_live)
            self.engine.abort_all()
            end = time.monotonic() + 5.0
            while self.engine.num_live > 0 and time.monotonic() < end:
                await asyncio.sleep(0.05)
        logger.info("drained; shutting down")
        if self.uvicorn is not None:
            self.uvicorn.should_exit = True


# ------------------------------------------------------------------------------ request plumbing
class _Choice:
    __slots__ = ("text", "n_tokens", "token_ids", "logprobs", "finish_reason", "stop_reason", "started")

    def __init__(self):
        self.text: list[str] = []
        self.n_tokens = 0
        self.token_ids: list[int] = []
        self.logprobs: list[dict] = []
        self.finish_reason = None
        self.stop_reason = None
        self.started = False


class _Job:
    """One HTTP request: one or more engine requests (prompts), n choices each."""

    def __init__(self, state: ServerState, http_id: str, n: int):
        self.state = state
        self.http_id = http_id
        self.n = n
        self.queue: asyncio.Queue = asyncio.Queue()
        self.rids: list[str] = []
        self.unfinished: set[str] = set()
        self.prompt_tokens: dict[int, int] = {}
        self.choices: dict[int, _Choice] = {}

    def submit(self, prompts: list, params) -> None:
        arrival = time.time()
        for p, prompt in enumerate(prompts):
            rid = f"{self.http_id}-{p}"
            self.rids.append(rid)
            self.unfinished.add(rid)
            self.state.engine.submit(rid, prompt, params, self.queue, tag=p, arrival_time=arrival)

    def abort(self) -> None:
        for rid in self.unfinished:
            self.state.engine.abort(rid)
        self.unfinished.clear()

    def choice(self, tag: int, index: int) -> _Choice:
        key = tag * self.n + index
        c = self.choices.get(key)
        if c is None:
            c = self.choices[key] = _Choice()
        return c

    def apply(self, item) -> list[tuple[int, Any]]:
        """Fold one queue item in; returns [(choice_index, delta)] of what it added."""
        if isinstance(item, Accepted):
            return []
        if isinstance(item, Rejected):
            self.unfinished.discard(item.request_id)
            raise APIError(400, item.message, "invalid_request_error", param="prompt")
        if isinstance(item, Failed):
            self.unfinished.discard(item.request_id)
            if item.engine_alive:  # this request alone failed inside the engine: a bug, not the client's fault
                raise APIError(500, item.message, "server_error", code="request_failed")
            raise unavailable(item.message, "engine_failed")
        assert isinstance(item, Output)
        if item.num_prompt_tokens:
            self.prompt_tokens[item.tag] = item.num_prompt_tokens
        added = []
        for d in item.deltas:
            c = self.choice(item.tag, d.index)
            if c.finish_reason is not None:
                continue
            if d.text:
                c.text.append(d.text)
            if d.token_ids:
                c.n_tokens += len(d.token_ids)
                c.token_ids.extend(d.token_ids)
                if d.logprobs:
                    c.logprobs.extend(d.logprobs)
            if d.finish_reason is not None:
                c.finish_reason = d.finish_reason
                c.stop_reason = d.stop_reason
            added.append((item.tag * self.n + d.index, d))
        if item.finished:
            self.unfinished.discard(item.request_id)
        return added

    def usage(self) -> dict:
        prompt = sum(self.prompt_tokens.values())
        completion = sum(c.n_tokens for c in self.choices.values())
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


async def _watch_disconnect(request: Request, job: _Job) -> None:
    """Put a marker on the job's queue when the client goes away (non-streaming requests)."""
    try:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                job.queue.put_nowait(_DISCONNECTED)
                return
    except Exception:  # noqa: BLE001
        return


async def _collect(request: Request, job: _Job) -> None:
    watcher = asyncio.ensure_future(_watch_disconnect(request, job))
    try:
        while job.unfinished:
            item = await job.queue.get()
            if item is _DISCONNECTED:
                logger.info("client disconnected: aborting %s", job.http_id)
                job.abort()
                raise APIError(499, "client disconnected")
            job.apply(item)
    except BaseException:
        job.abort()
        raise
    finally:
        watcher.cancel()


def _completion_logprobs(state: ServerState, token_ids: list[int], lps: list[dict], offset: int) -> dict:
    tokens, token_lps, top, offsets = [], [], [], []
    for tid, d in zip(token_ids, lps):
        s = state.tok_str(tid)
        tokens.append(s)
        token_lps.append(_finite(d.get(tid, -9999.0)))
        top.append({state.tok_str(k): _finite(v) for k, v in sorted(d.items(), key=lambda kv: -kv[1])})
        offsets.append(offset)
        offset += len(s)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": top, "text_offset": offsets}


def _chat_logprobs(state: ServerState, token_ids: list[int], lps: list[dict], k: int) -> dict:
    content = []
    for tid, d in zip(token_ids, lps):
        s = state.tok_str(tid)
        top = sorted(d.items(), key=lambda kv: -kv[1])[:k]
        content.append({
            "token": s,
            "logprob": _finite(d.get(tid, -9999.0)),
            "bytes": list(s.encode("utf-8")),
            "top_logprobs": [{"token": state.tok_str(t), "logprob": _finite(v), "bytes": list(state.tok_str(t).encode("utf-8"))} for t, v in top],
        })
    return {"content": content}


def _sse(obj: dict) -> str:
    return f"data: {_dumps(obj)}\n\n"


# ------------------------------------------------------------------------------ the app
def build_app(state: ServerState) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app):
        state.loop = asyncio.get_running_loop()
        state.engine.start(state.loop, on_loaded=state.on_loaded)
        stats_task = asyncio.ensure_future(state.log_stats_forever()) if state.log_stats_interval > 0 else None
        yield
        if stats_task is not None:
            stats_task.cancel()
        if state.prompts is not None:
            state.prompts.close()
        state.engine.stop()

    app = FastAPI(title="Shoal", version="0.1.0", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.shoal = state
    errors = {status: {"model": ErrorResponse} for status in (400, 401, 404, 413, 503)}

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
            loc = [str(x) for x in err.get("loc", ()) if x != "body"]
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

    # -- probes and metrics ---------------------------------------------------------
    @app.get("/health")
    async def health():
        ok, why = state.engine.health()
        return Response(_dumps({"status": "ok" if ok else "unhealthy", "detail": why}), status_code=200 if ok else 503, media_type="application/json")

    @app.get("/ready")
    async def ready():
        ok, why = state.ready()
        headers = None if ok else {"Retry-After": str(RETRY_AFTER_S)}
        return Response(_dumps({"status": "ready" if ok else "not ready", "detail": why}), status_code=200 if ok else 503, media_type="application/json", headers=headers)

    @app.get("/metrics")
    async def metrics():
        body, ctype = state.metrics.render()
        return Response(body, media_type=ctype)

    # -- models ---------------------------------------------------------------------
    def model_card() -> dict:
        return {"id": state.model_name, "object": "model", "created": state.created, "owned_by": "shoal", "root": state.config.model, "max_model_len": state.engine.max_model_len}

    @app.get("/v1/models", response_model=ModelList, responses=errors)
    async def list_models():
        return Response(_dumps({"object": "list", "data": [model_card()]}), media_type="application/json")

    @app.get("/v1/models/{model_id:path}", responses=errors)
    async def get_model(model_id: str):
        state.check_model(model_id)
        return Response(_dumps(model_card()), media_type="application/json")

    # -- completions ----------------------------------------------------------------
    def _prepare(req) -> None:
        state.check_accepting()
        state.check_model(req.model)
        unsupported = req.unsupported()
        if unsupported:
            raise APIError(400, unsupported[0], param=unsupported[1])
        if req.priority != 0 and state.config.scheduling_policy != "priority":
            raise APIError(400, "priority other than 0 needs --scheduling-policy priority (this server schedules fcfs)", param="priority")

    def _params(req, max_tokens, logprobs):
        if logprobs is not None and logprobs > state.max_logprobs:
            raise APIError(400, f"at most {state.max_logprobs} logprobs per token (--max-logprobs), got {logprobs}",
                           param="top_logprobs" if isinstance(req, ChatCompletionRequest) else "logprobs")
        try:
            return req.sampling_params(max_tokens, logprobs, state.engine.vocab_size)
        except (ValueError, TypeError) as e:
            raise APIError(400, str(e)) from None

    def _admit(count: int) -> None:
        state.check_accepting()  # again after an await: draining may have begun meanwhile
        try:
            state.engine.admit(count)
        except NeverFits as e:
            raise APIError(400, str(e), param="prompt") from None
        except QueueFull as e:
            state.metrics.rejected("queue_full")
            raise unavailable(str(e), "queue_full") from None
        except (EngineNotReady, EngineDead) as e:
            raise unavailable(str(e), "not_ready") from None

    async def _tokenize(fn, *args, param: str = "prompt") -> list[int]:
        """fn(*args) on the tokenizer pool: token ids, or a 400."""
        try:
            return await state.prompts.run(fn, *args)
        except PromptTooLong as e:
            raise APIError(400, str(e), param=param) from None
        except ValueError as e:
            raise APIError(400, str(e), param=param) from None
        except Exception as e:  # noqa: BLE001 - a template or tokenizer that rejects the input
            what = "apply the chat template" if param == "messages" else "tokenize the prompt"
            raise APIError(400, f"could not {what}: {type(e).__name__}: {e}", param=param) from None

    def _check_fits(ids: list[int], max_tokens: int | None, param: str = "prompt") -> None:
        limit = state.engine.max_model_len
        if not ids:
            raise APIError(400, "the conversation renders to an empty prompt" if param == "messages" else "prompt must not be empty", param=param)
        if len(ids) >= limit:
            raise APIError(400, context_error(len(ids), limit), param=param)
        if max_tokens is not None and len(ids) + max_tokens > limit:
            raise APIError(400, context_error(len(ids), limit, max_tokens), param="max_tokens")
        vocab = state.engine.vocab_size
        if vocab:
            bad = next((t for t in ids if t >= vocab), None)
            if bad is not None:
                raise APIError(400, f"prompt token id {bad} is outside the vocabulary [0, {vocab})", param=param)

    async def _await_accepted(job: _Job) -> list:
        """Wait until every engine request is accepted or one is rejected (-> 400).
        Returns items that arrived meanwhile (outputs of already-accepted requests)."""
        early = []
        accepted: set[str] = set()
        try:
            while len(accepted) < len(job.rids):
                item = await job.queue.get()
                if isinstance(item, (Rejected, Failed)):
                    job.apply(item)  # raises
                accepted.add(item.request_id)
                if isinstance(item, Output):
                    early.append(item)
        except BaseException:
            job.abort()
            raise
        return early

    @app.post("/v1/completions", response_model=CompletionResponse, responses=errors)
    async def completions(req: CompletionRequest, request: Request):
        _prepare(req)
        try:
            prompts = req.prompts()
        except ValueError as e:
            raise APIError(400, str(e), param="prompt") from None
        params = _params(req, req.max_tokens, req.logprobs)
        _admit(len(prompts))  # before tokenizing: a full queue costs no work
        ids = []
        for prompt in prompts:
            if isinstance(prompt, str):
                prompt = await _tokenize(state.prompts.text_ids, prompt)
            _check_fits(prompt, req.max_tokens)
            ids.append(prompt)
        _admit(len(prompts))  # and again with no await before submit: the bound holds
        job = _Job(state, f"cmpl-{uuid.uuid4().hex}", req.n)
        created = int(time.time())
        echo_text = {}
        if req.echo:
            for p, prompt in enumerate(prompts):
                echo_text[p] = prompt if isinstance(prompt, str) else state.engine.tokenizer.decode(prompt)
        job.submit(ids, params)
        if req.stream:
            early = await _await_accepted(job)
            return _stream_completions(req, job, created, echo_text, early)
        await _collect(request, job)
        choices = []
        for key in sorted(job.choices):
            c = job.choices[key]
            prefix = echo_text.get(key // req.n, "")
            lp = None
            if req.logprobs is not None:
                lp = _completion_logprobs(state, c.token_ids, c.logprobs, len(prefix))
            choices.append({"index": key, "text": prefix + "".join(c.text), "logprobs": lp, "finish_reason": c.finish_reason, "stop_reason": c.stop_reason})
        body = {"id": job.http_id, "object": "text_completion", "created": created, "model": state.model_name, "choices": choices, "usage": job.usage()}
        return Response(_dumps(body), media_type="application/json")

    def _stream_completions(req: CompletionRequest, job: _Job, created: int, echo_text: dict, early: list):
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        base = {"id": job.http_id, "object": "text_completion", "created": created, "model": state.model_name}
        offsets: dict[int, int] = {}

        def chunk(index: int, text: str, logprobs, finish_reason, stop_reason=None) -> str:
            obj = dict(base, choices=[{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason, "stop_reason": stop_reason}])
            if include_usage:
                obj["usage"] = None
            return _sse(obj)

        def render(added) -> list[str]:
            out = []
            for index, d in added:
                lp = None
                if req.logprobs is not None and d.token_ids:
                    off = offsets.get(index, 0)
                    lp = _completion_logprobs(state, d.token_ids, d.logprobs or [{}] * len(d.token_ids), off)
                    offsets[index] = off + sum(len(t) for t in lp["tokens"])
                if d.text or d.finish_reason is not None or lp is not None:
                    out.append(chunk(index, d.text, lp, d.finish_reason, d.stop_reason if d.finish_reason else None))
            return out

        first = []
        for p, text in echo_text.items():
            for i in range(req.n):
                offsets[p * req.n + i] = len(text)
                first.append(chunk(p * req.n + i, text, None, None))
        return _sse_response(_event_stream(job, early, render, base, include_usage, "".join(first)))

    # -- chat -----------------------------------------------------------------------
    async def _chat_prompt(req: ChatCompletionRequest, max_tokens: int | None) -> list[int]:
        messages = [{"role": m.role, "content": m.text(), **({"name": m.name} if m.name else {})} for m in req.messages]
        ids = await _tokenize(state.prompts.chat_ids, messages, req.add_generation_prompt, param="messages")
        _check_fits(ids, max_tokens, param="messages")
        return ids

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses=errors)
    async def chat_completions(req: ChatCompletionRequest, request: Request):
        _prepare(req)
        k = req.num_logprobs()
        params = _params(req, req.completion_tokens_limit(), k)
        _admit(1)
        ids = await _chat_prompt(req, req.completion_tokens_limit())
        _admit(1)
        job = _Job(state, f"chatcmpl-{uuid.uuid4().hex}", req.n)
        created = int(time.time())
        job.submit([ids], params)
        if req.stream:
            early = await _await_accepted(job)
            return _stream_chat(req, job, created, k, early)
        await _collect(request, job)
        choices = []
        for key in sorted(job.choices):
            c = job.choices[key]
            lp = _chat_logprobs(state, c.token_ids, c.logprobs, k) if k is not None else None
            choices.append({"index": key, "message": {"role": "assistant", "content": "".join(c.text)}, "logprobs": lp, "finish_reason": c.finish_reason, "stop_reason": c.stop_reason})
        body = {"id": job.http_id, "object": "chat.completion", "created": created, "model": state.model_name, "choices": choices, "usage": job.usage()}
        return Response(_dumps(body), media_type="application/json")

    def _stream_chat(req: ChatCompletionRequest, job: _Job, created: int, k: int | None, early: list):
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        base = {"id": job.http_id, "object": "chat.completion.chunk", "created": created, "model": state.model_name}

        def chunk(index: int, delta: dict, logprobs=None, finish_reason=None, stop_reason=None) -> str:
            obj = dict(base, choices=[{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason, "stop_reason": stop_reason}])
            if include_usage:
                obj["usage"] = None
            return _sse(obj)

        def render(added) -> list[str]:
            out = []
            for index, d in added:
                lp = None
                if k is not None and d.token_ids:
                    lp = _chat_logprobs(state, d.token_ids, d.logprobs or [{}] * len(d.token_ids), k)
                if d.text or d.finish_reason is not None or lp is not None:
                    delta = {"content": d.text} if (d.text or lp is not None) else {}
                    out.append(chunk(index, delta, lp, d.finish_reason, d.stop_reason if d.finish_reason else None))
            return out

        first = "".join(chunk(i, {"role": "assistant", "content": ""}) for i in range(req.n))
        return _sse_response(_event_stream(job, early, render, base, include_usage, first))

    async def _event_stream(job: "_Job", early: list, render, base: dict, include_usage: bool, first: str):
        """The SSE body both endpoints share: `first`, the rendered deltas, usage if asked,
        [DONE]; an error mid-stream becomes an error event; the request ends with the body."""
        try:
            if first:
                yield first
            async for parts in _stream_items(job, early):
                yield "".join(render(parts))
            if include_usage:
                yield _sse(dict(base, choices=[], usage=job.usage()))
            yield "data: [DONE]\n\n"
        except APIError as e:
            yield _sse(error_body(e.message, e.type, e.param, e.code))
            yield "data: [DONE]\n\n"
        finally:
            job.abort()

    async def _stream_items(job: _Job, early: list):
        """Yield lists of (choice index, delta), draining whatever is queued at each wake-up
        (a slow client gets several steps' tokens in one write)."""
        added = []
        for item in early:
            added.extend(job.apply(item))
        if added:
            yield added
        while job.unfinished:
            item = await job.queue.get()
            added = job.apply(item)
            while not job.queue.empty() and job.unfinished:
                added.extend(job.apply(job.queue.get_nowait()))
            if added:
                yield added

    return app


def _sse_response(gen) -> StreamingResponse:
    return StreamingResponse(gen, media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def build_asgi(state: ServerState, allowed_origins: list[str] | None = None):
    """The FastAPI app wrapped in the key/body guard (and CORS when origins are given): what uvicorn serves."""
    app = build_app(state)
    if allowed_origins:
        from starlette.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=allowed_origins, allow_methods=["*"], allow_headers=["*"])
    return app, GuardMiddleware(app, state.api_key, state.max_body_bytes)


LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class _ProbeFilter(logging.Filter):
    """Access-log lines of /health, /ready and /metrics are DEBUG: probes every few seconds
    would drown everything else at INFO."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if isinstance(args, tuple) and len(args) >= 3 and str(args[2]).split("?")[0] in PROBE_PATHS:
            record.levelno, record.levelname = logging.DEBUG, "DEBUG"
            return logging.getLogger("uvicorn.access").isEnabledFor(logging.DEBUG) and logging.getLogger().isEnabledFor(logging.DEBUG)
        return True


def configure_logging(level: str) -> None:
    """One line format for Shoal's and uvicorn's loggers (uvicorn's own config is not used)."""
    level = level.upper()
    logging.basicConfig(level=level, format=LOG_FORMAT)
    for name in ("shoal", "uvicorn", "uvicorn.error", "uvicorn.access"):
        lg = logging.getLogger(name)
        lg.setLevel(level)
        lg.handlers.clear()
        lg.propagate = True
    logging.getLogger("uvicorn.access").addFilter(_ProbeFilter())


# ------------------------------------------------------------------------------ process entry
def _make_uvicorn_server(config, state: ServerState):
    import uvicorn

    class ShoalServer(uvicorn.Server):
        """uvicorn, except that the first SIGTERM/SIGINT drains instead of stopping at once."""

        def handle_exit(self, sig, frame):
            if sig in (signal.SIGTERM, signal.SIGINT) and state.loop is not None:
                if not state.draining:
                    state.draining = True  # /ready is 503 from this instant
                    state.loop.call_soon_threadsafe(state.start_drain)
                    return
                # a second signal while draining: exit now, as documented (128 + signal, the shell's convention)
                logger.warning("second %s while draining: exiting now, %d request(s) cut off", signal.Signals(sig).name, state.engine.num_live)
                logging.shutdown()
                os._exit(128 + sig)
            super().handle_exit(sig, frame)

    return ShoalServer(config)


def serve(args) -> int:
    import uvicorn

    from shoal.runtime.config import EngineConfig

    configure_logging(getattr(args, "log_level", "info"))
    config = EngineConfig.from_args(args)
    from shoal.runtime.executor.launch import run_worker_pod_if_needed

    # a pod group's worker pod runs its ranks (and tiny probes) instead of the server
    if run_worker_pod_if_needed(config, host=args.host, port=args.port):
        return 0
    state = ServerState(
        config,
        api_key=args.api_key,
        max_waiting=args.max_waiting,
        stall_timeout=args.stall_timeout,
        drain_timeout=args.drain_timeout,
        max_body_bytes=args.max_body_bytes,
        chat_template=getattr(args, "chat_template_text", None),
        max_logprobs=getattr(args, "max_logprobs", 20),
        log_stats_interval=0.0 if getattr(args, "disable_log_stats", False) else getattr(args, "log_stats_interval", 10.0),
    )
    _, asgi = build_asgi(state, getattr(args, "allowed_origins", None))
    logger.info("serving %s as %r on http://%s:%d (API key %s)", config.model, state.model_name, args.host, args.port, "required" if state.api_key else "off")
    uv_config = uvicorn.Config(
        asgi,
        host=args.host,
        port=args.port,
        log_config=None,  # configure_logging: one format for all
        log_level=getattr(args, "log_level", "info"),
        access_log=os.environ.get("SHOAL_ACCESS_LOG", "1") != "0",
        root_path=getattr(args, "root_path", "") or "",
        lifespan="on",
        ws="none",
        timeout_graceful_shutdown=5,
        timeout_keep_alive=5,
        backlog=4096,
    )
    server = _make_uvicorn_server(uv_config, state)
    state.uvicorn = server
    server.run()
    if state.engine.state == "failed" and state.exit_code == 0:
        state.exit_code = 1
    return state.exit_code
