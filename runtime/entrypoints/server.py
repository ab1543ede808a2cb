"""`shoal serve`: the engine behind FastAPI on uvicorn, with the HTTP contract of docs/design.md.

    /v1/completions, /v1/chat/completions   OpenAI bodies; stream: true -> SSE ending in [DONE]
    /v1/models                              the served model and its LoRA adapters (parent: the model)
    /v1/load_lora_adapter, /unload_...      LoRA adapters at run time, vLLM's shapes (lora_routes.py)
    /health                                 alive and the engine loop making progress (watchdog)
    /ready                                  loaded + KV cache + warm-up done, group joined, not draining
    /metrics                                Prometheus text (shoal_*, and the same series as vllm:*)
    /tokenize, /detokenize, /version, /load vLLM's utility endpoints, in vLLM's shapes
    /tokenizer_info                         vLLM's: the tokenizer's config and chat template
    /kv/blocks?since=SEQ&epoch=E            prefix-cache block hashes stored/removed since SEQ (docs/router.md)

Life of a server: uvicorn binds at once (so probes answer while the model loads), the engine
is built on its own thread (AsyncEngine), /ready turns 200 when it is loaded. On SIGTERM
/ready turns 503 at once, new requests get 503 + Retry-After, in-flight requests finish
(bounded by --drain-timeout, then aborted), and the process exits 0. A second signal exits
at once.

Errors always have OpenAI's shape {"error": {"message", "type", "param", "code"}}: 400 bad
input, 401 bad key, 404 unknown model or path, 413 body too large, 503 queue full / loading /
draining, 500 a request that failed inside the engine (a bug; the engine goes on). Nothing a
client sends should produce a 5xx.

The pieces, each in its own module:
    errors.py      APIError, OpenAI's error shape, the JSON encoder, the exception handlers
    middleware.py  X-Request-Id, the API key, the body size cap (pure ASGI)
    state.py       ServerState: the engine, metrics, readiness, the tokenizer pool, draining
    prompts.py     prompts to token ids on a thread pool, with the size bound
    serving.py     what the two endpoints do between the body and the response
    job.py         one HTTP request's engine requests and the waits on them
    render.py      OpenAI's response shapes, one renderer for completions and chat
    logs.py        one log format, probes quiet
This file wires the routes and runs uvicorn.

Every value that reaches a tensor is validated and bounded here, at the edge (protocol.py);
prompts are rendered and tokenized on a thread pool (prompts.py), never on the event loop
or the engine's step, and one whose size alone proves it cannot fit is refused before.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal

from fastapi import FastAPI, Request
from fastapi.responses import Response

from shoal.runtime.entrypoints.errors import RETRY_AFTER_S, dumps, install_handlers, unavailable
from shoal.runtime.entrypoints.logs import configure_logging
from shoal.runtime.entrypoints.lora_routes import add_lora_routes
from shoal.runtime.entrypoints.middleware import GuardMiddleware
from shoal.runtime.entrypoints.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorResponse,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
)
from shoal.runtime.entrypoints.serving import Serving
from shoal.runtime.entrypoints.state import ServerState

__all__ = ["ServerState", "build_app", "build_asgi", "serve"]

logger = logging.getLogger("shoal.server")


def shoal_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("shoal")
    except PackageNotFoundError:  # run from a checkout without an install
        return "0.0.0+checkout"


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
    install_handlers(app)
    serving = Serving(state)
    errors = {status: {"model": ErrorResponse} for status in (400, 401, 404, 413, 503)}

    def json_response(obj, status: int = 200, headers: dict | None = None) -> Response:
        return Response(dumps(obj), status_code=status, media_type="application/json", headers=headers)

    # -- probes and metrics ---------------------------------------------------------
    @app.get("/health")
    async def health():
        ok, why = state.engine.health()
        return json_response({"status": "ok" if ok else "unhealthy", "detail": why}, 200 if ok else 503)

    @app.get("/ready")
    async def ready():
        ok, why = state.ready()
        headers = None if ok else {"Retry-After": str(RETRY_AFTER_S)}
        return json_response({"status": "ready" if ok else "not ready", "detail": why}, 200 if ok else 503, headers)

    @app.get("/metrics")
    async def metrics():
        body, ctype = state.metrics.render()
        return Response(body, media_type=ctype)

    # -- models ---------------------------------------------------------------------
    @app.get("/v1/models", response_model=ModelList, responses=errors)
    async def list_models():
        return json_response({"object": "list", "data": state.model_cards()})

    @app.get("/v1/models/{model_id:path}", responses=errors)
    async def get_model(model_id: str):
        state.check_model(model_id)
        return json_response(state.model_card(model_id))

    add_lora_routes(app, state)  # POST /v1/load_lora_adapter, /v1/unload_lora_adapter

    # -- generation -----------------------------------------------------------------
    @app.post("/v1/completions", response_model=CompletionResponse, responses=errors)
    async def completions(req: CompletionRequest, request: Request):
        return await serving.completions(req, request)

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses=errors)
    async def chat_completions(req: ChatCompletionRequest, request: Request):
        return await serving.chat(req, request)

    # -- vLLM's utility endpoints (same request and response shapes) -----------------
    @app.post("/tokenize", response_model=TokenizeResponse, responses=errors)
    async def tokenize(req: TokenizeRequest):
        return json_response(await serving.tokenize(req))

    @app.post("/detokenize", response_model=DetokenizeResponse, responses=errors)
    async def detokenize(req: DetokenizeRequest):
        return json_response(await serving.detokenize(req))

    @app.get("/tokenizer_info", responses=errors)
    async def tokenizer_info():
        return json_response(serving.tokenizer_info())

    @app.get("/version")
    async def version():
        return json_response({"version": shoal_version()})

    @app.get("/load")
    async def load():
        """Requests this server holds (vLLM's server_load): what a router balances on."""
        return json_response({"server_load": state.engine.num_live})

    # -- the prefix cache, for `shoal router` ------------------------------------------
    @app.get("/kv/blocks")
    async def kv_blocks(since: int = 0, epoch: str | None = None):
        """Block hashes that became findable / were evicted since event `since` of `epoch`
        (reset: true and the whole set when the log no longer reaches back, or the epoch differs),
        with /ready's answer and the load, so one poll tells a router all it weighs."""
        changes = state.engine.kv_block_changes(since, epoch)
        if changes is None:
            raise unavailable("the model is still loading", "model_loading")
        stats = state.engine.stats
        load = {"running": stats.num_running if stats else 0, "waiting": state.engine.num_waiting,
                "kv_cache_usage": stats.kv_cache_usage if stats else 0.0}
        lora = getattr(stats, "lora", None)  # the adapters in device slots: the router's LoRA affinity
        return json_response({"ready": state.ready()[0], "load": load, "block_size": state.config.block_size,
                              "max_model_len": state.engine.max_model_len, **changes,
                              **({"lora": {"slots": lora.slots, "max_lora": lora.max_lora, "base": state.model_name}} if lora else {})})

    return app


def build_asgi(state: ServerState, allowed_origins: list[str] | None = None):
    """The FastAPI app wrapped in the key/body guard (and CORS when origins are given): what uvicorn serves."""
    app = build_app(state)
    if allowed_origins:
        from starlette.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=allowed_origins, allow_methods=["*"], allow_headers=["*"])
    return app, GuardMiddleware(app, state.api_key, state.max_body_bytes)


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
    from shoal.runtime.executor.worker_pod import run_worker_pod_if_needed

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
        tool_call_parser=getattr(args, "tool_call_parser", None),
        enable_auto_tool_choice=getattr(args, "enable_auto_tool_choice", False),
        reasoning_parser=getattr(args, "reasoning_parser", None),
        freeze_gc=True,
        stream_interval=getattr(args, "stream_interval", 1),
        tokenizer_info=getattr(args, "enable_tokenizer_info_endpoint", True),
        engine_core_process=getattr(args, "engine_core_process", False),
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
