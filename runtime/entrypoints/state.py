"""What one server holds: the engine, its metrics, readiness, the tokenizer pool, draining."""

from __future__ import annotations

import asyncio
import gc
import logging
import threading
import time

from shoal.runtime.engine.async_engine import AsyncEngine, EngineDead, EngineNotReady
from shoal.runtime.entrypoints.errors import APIError, unavailable
from shoal.runtime.entrypoints.prompts import PromptTokenizer
from shoal.runtime.metrics import ServerMetrics

logger = logging.getLogger("shoal.server")


class ServerState:
    def __init__(self, config, *, api_key: str | None = None, max_waiting: int = 512, stall_timeout: float = 60.0, drain_timeout: float = 30.0, max_body_bytes: int = 8 * 2**20, engine_factory=None,
                 chat_template: str | None = None, max_logprobs: int = 20, log_stats_interval: float = 10.0,
                 tool_call_parser: str | None = None, enable_auto_tool_choice: bool = False, freeze_gc: bool = False,
                 reasoning_parser: str | None = None, stream_interval: int = 1, tokenizer_info: bool = True,
                 engine_core_process: bool = False):
        self.config = config
        self.stream_interval = stream_interval  # tokens per streamed event (--stream-interval, vLLM's)
        self.tokenizer_info = tokenizer_info  # GET /tokenizer_info served (--enable-tokenizer-info-endpoint)
        self.freeze_gc = freeze_gc  # `shoal serve`: the process serves this one engine for its life
        self.tool_call_parser, self.enable_auto_tool_choice = tool_call_parser, enable_auto_tool_choice  # docs/tools.md
        self.reasoning_parser = reasoning_parser  # docs/reasoning.md
        self.chat_template = chat_template
        self.max_logprobs = max_logprobs
        self.log_stats_interval = log_stats_interval
        self.prompts: PromptTokenizer | None = None
        self.model_name = config.name
        self.api_key = api_key
        self.drain_timeout = drain_timeout
        self.max_body_bytes = max_body_bytes
        self.metrics = ServerMetrics(self.model_name)
        if engine_core_process and engine_factory is None:  # the engine core in its own process (docs/engine.md)
            from shoal.runtime.engine.core_client import CoreClient

            engine_factory = CoreClient
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
        if self.engine.state in ("created", "loading") or (self.engine.state == "ready" and self.prompts is None):
            return False, "loading the model"
        ok, why = self.engine.health()
        if not ok:
            return False, why
        if not self.engine.ready:
            return False, f"engine {self.engine.state}"
        if not self.group_joined.is_set() or not self.engine.group_ready():
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
        if self.prompts is None:  # the engine is up, on_loaded has not run on the loop yet
            self.metrics.rejected("loading")
            raise unavailable("the model is still loading", "model_loading")

    def check_model(self, model: str | None) -> None:
        if model is not None and model not in (self.model_name, self.config.model) and model not in self.lora_adapters():
            raise APIError(404, f"The model '{model}' does not exist; this server serves '{self.model_name}'.", "invalid_request_error", param="model", code="model_not_found")

    def lora_adapters(self) -> dict[str, str]:
        """The LoRA adapters loaded now: name -> path."""
        return self.engine.lora_adapters()

    def lora_of(self, model: str | None) -> str | None:
        """The adapter a request's `model` names, None for the base model."""
        return model if model is not None and model not in (self.model_name, self.config.model) else None

    def model_card(self, model: str | None = None) -> dict:
        """The base model's card, or (vLLM's) an adapter's: its path as root, the base as parent."""
        path = self.lora_adapters().get(model) if model is not None else None
        if path is not None:
            return {"id": model, "object": "model", "created": self.created, "owned_by": "shoal", "root": path,
                    "parent": self.model_name, "max_model_len": self.engine.max_model_len}
        return {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "shoal", "root": self.config.model,
                "parent": None, "max_model_len": self.engine.max_model_len}

    def model_cards(self) -> list[dict]:
        return [self.model_card()] + [self.model_card(name) for name in self.lora_adapters()]

    def on_loaded(self) -> None:
        e = self.engine
        if e.state == "failed":
            logger.error("startup failed: %s", e.error)
            self.exit_code = 1
            if self.uvicorn is not None:
                self.uvicorn.should_exit = True
            return
        import torch

        self.metrics.cpu_threads.set(torch.get_num_threads())  # what cpu_threads.py chose at load
        for phase, seconds in e.load_times.items():
            self.metrics.startup_phase(phase, seconds)
            logger.info("startup phase %-9s %7.2f s", phase, seconds)
        self.prompts = PromptTokenizer(e.tokenizer, e.max_model_len, chat_template=self.chat_template)
        if self.chat_template:
            e.tokenizer.chat_template = self.chat_template
        logger.info("model %s ready: max_model_len %s", self.model_name, e.max_model_len)
        if self.freeze_gc:
            # Everything start-up made (torch, transformers, the tokenizer: ~300k objects) goes
            # to the permanent generation, which collections never walk: a full collection in
            # the steady state took 124 ms, a stall of every running stream, and 6 ms after
            # this (as vLLM does). Only cyclic garbage among these objects would leak.
            gc.collect()
            gc.freeze()

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
