"""What /v1/completions and /v1/chat/completions do between the parsed body and the response.

    check accepting, model, unsupported fields, priority     -> 400 / 404 / 503
    chat: tools, tool_choice, tool turns (tool_parsers/)     -> 400; a forced choice sets structured outputs
    chat: --reasoning-parser (reasoning_parsers/)             the thinking apart from the content
    sampling params, built and validated once (protocol.py)   -> 400
    admit (queue bound, before any work)                      -> 503 / 400 never fits
    prompt -> token ids on the tokenizer pool                  -> 400 too long, bad template
    fits the context (prompt + max_tokens), ids in the vocab  -> 400
    admit again (no await from here to submit), submit
    stream: wait until accepted, then SSE (each choice's first chunk with its first token); else collect, then the body

and vLLM's /tokenize, /detokenize (on the same tokenizer pool) and /tokenizer_info.
"""

from __future__ import annotations

import math
import time
import uuid

from fastapi import Request
from fastapi.responses import Response

from shoal.runtime.engine.async_engine import EngineDead, EngineNotReady, NeverFits, QueueFull
from shoal.runtime.entrypoints import structured_request
from shoal.runtime.entrypoints.errors import APIError, dumps, unavailable
from shoal.runtime.entrypoints.job import Job, await_accepted, collect
from shoal.runtime.entrypoints.prompts import PromptTooLong, context_error
from shoal.runtime.entrypoints.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from shoal.runtime.entrypoints.reasoning_parsers.output import chat_output
from shoal.runtime.entrypoints.openai_render import Renderer
from shoal.runtime.entrypoints.scoring import Extras
from shoal.runtime.entrypoints.state import ServerState
from shoal.runtime.entrypoints.tool_parsers.chat_template import request_messages
from shoal.runtime.entrypoints.tool_parsers.choice import check_messages, check_tools, tool_choice_of
from shoal.runtime.entrypoints.tool_parsers.output import ToolOutput


class Serving:
    def __init__(self, state: ServerState):
        self.state = state

    # -- the checks ---------------------------------------------------------------------
    def _prepare(self, req) -> Extras:
        state = self.state
        state.check_accepting()
        state.check_model(req.model)
        unsupported = req.unsupported()
        if unsupported:
            raise APIError(400, unsupported[0], param=unsupported[1])
        if req.priority != 0 and state.config.scheduling_policy != "priority":
            raise APIError(400, "priority other than 0 needs --scheduling-policy priority (this server schedules fcfs)", param="priority")
        extras = Extras(req, state.engine.max_model_len)
        extras.check_logprobs_limit(state.max_logprobs)
        return extras

    def _params(self, req, max_tokens, logprobs, extras: Extras, tools=None):
        state = self.state
        if logprobs is not None and logprobs > state.max_logprobs:
            raise APIError(400, f"at most {state.max_logprobs} logprobs per token (--max-logprobs), got {logprobs}",
                           param="top_logprobs" if isinstance(req, ChatCompletionRequest) else "logprobs")
        params = req.sampling_params(max_tokens, logprobs, state.engine.vocab_size, prompt_logprobs=extras.k_engine,
                                     forced=tools.forced() if tools is not None else None)
        if tools is not None and tools.keeps_special_tokens():
            params.skip_special_tokens = False
        return params

    async def _compile(self, req, params) -> None:
        """Compile the request's grammar on the tokenizer pool (the engine finds it cached): a
        schema, regex or grammar that cannot be compiled is a 400 naming its field."""
        spec = params.structured_outputs
        if spec is None:
            return
        field = structured_request.grammar_field(req)
        try:
            await self.state.prompts.run(self.state.engine.compile_grammar, spec)
        except NotImplementedError as e:
            raise APIError(400, str(e), param=field) from None
        except ValueError as e:
            raise APIError(400, str(e), param=field or "structured_outputs") from None

    def _admit(self, count: int) -> None:
        state = self.state
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

    async def _tokenize(self, fn, *args, param: str = "prompt") -> list[int]:
        """fn(*args) on the tokenizer pool: token ids, or a 400."""
        try:
            return await self.state.prompts.run(fn, *args)
        except PromptTooLong as e:
            raise APIError(400, str(e), param=param) from None
        except ValueError as e:
            raise APIError(400, str(e), param=param) from None
        except Exception as e:  # noqa: BLE001 - a template or tokenizer that rejects the input
            what = "apply the chat template" if param == "messages" else "tokenize the prompt"
            raise APIError(400, f"could not {what}: {type(e).__name__}: {e}", param=param) from None

    def _check_fits(self, ids: list[int], max_tokens: int | None, param: str = "prompt") -> None:
        engine = self.state.engine
        limit = engine.max_model_len
        if not ids:
            raise APIError(400, "the conversation renders to an empty prompt" if param == "messages" else "prompt must not be empty", param=param)
        if len(ids) >= limit:
            raise APIError(400, context_error(len(ids), limit), param=param)
        if max_tokens is not None and len(ids) + max_tokens > limit:
            raise APIError(400, context_error(len(ids), limit, max_tokens), param="max_tokens")
        vocab = engine.vocab_size
        if vocab:
            bad = next((t for t in ids if t >= vocab), None)
            if bad is not None:
                raise APIError(400, f"prompt token id {bad} is outside the vocabulary [0, {vocab})", param=param)

    async def _respond(self, request: Request, req, job: Job, renderer: Renderer):
        if req.stream:
            early = await await_accepted(job)
            return renderer.stream(early)
        await collect(request, job)
        return Response(dumps(renderer.body()), media_type="application/json")

    # -- the endpoints ------------------------------------------------------------------
    async def completions(self, req: CompletionRequest, request: Request):
        state = self.state
        extras = self._prepare(req)
        try:
            prompts = req.prompts()
        except ValueError as e:
            raise APIError(400, str(e), param="prompt") from None
        max_tokens = extras.max_tokens(req.max_tokens)
        params = self._params(req, max_tokens, req.logprobs, extras)
        self._admit(len(prompts))  # before tokenizing: a full queue costs no work
        await self._compile(req, params)
        ids = []
        for p, prompt in enumerate(prompts):
            if isinstance(prompt, str):
                prompt = await self._tokenize(state.prompts.text_ids, prompt)
            kept = extras.truncated(prompt)
            if len(kept) < len(prompt):
                prompts[p] = prompt = kept  # the echo shows what the model saw
            self._check_fits(prompt, max_tokens)
            ids.append(prompt)
        self._admit(len(prompts))  # and again with no await before submit: the bound holds
        job = Job(state, f"cmpl-{uuid.uuid4().hex}", req.n)
        created = int(time.time())
        echo_text = {}
        if req.echo:
            for p, prompt in enumerate(prompts):
                echo_text[p] = prompt if isinstance(prompt, str) else state.engine.tokenizer.decode(prompt)
        job.submit(ids, params, lora=state.lora_of(req.model))
        include_usage, continuous_usage = req.stream_usage()
        renderer = Renderer(state, job, created, chat=False, logprobs=req.logprobs, echo_text=echo_text, include_usage=include_usage,
                            continuous_usage=continuous_usage, extras=extras, stream_interval=state.stream_interval)
        return await self._respond(request, req, job, renderer)

    async def chat(self, req: ChatCompletionRequest, request: Request):
        state = self.state
        extras = self._prepare(req)
        tools = tool_choice_of(req, state.tool_call_parser, state.enable_auto_tool_choice)  # 400s; docs/tools.md
        k = req.num_logprobs()
        max_tokens = req.completion_tokens_limit()
        params = self._params(req, max_tokens, k, extras, tools)  # a forced tool choice: its grammar
        self._admit(1)
        await self._compile(req, params)
        ids = extras.truncated(await self._tokenize(state.prompts.chat_ids, request_messages(req.messages), req.add_generation_prompt,
                                                    False, tools.template_tools if tools else None, req.chat_template_kwargs, param="messages"))
        self._check_fits(ids, max_tokens, param="messages")
        tool_output = ToolOutput(tools, state.engine.tokenizer) if tools is not None and tools.mode != "none" else None
        output = await chat_output(state, req, ids, tool_output)  # --reasoning-parser: reasoning_parsers/output.py
        self._admit(1)
        job = Job(state, f"chatcmpl-{uuid.uuid4().hex}", req.n)
        created = int(time.time())
        job.submit([ids], params, lora=state.lora_of(req.model))
        include_usage, continuous_usage = req.stream_usage()
        renderer = Renderer(state, job, created, chat=True, logprobs=k, include_usage=include_usage, continuous_usage=continuous_usage,
                            extras=extras, tools=output, stream_interval=state.stream_interval)
        return await self._respond(request, req, job, renderer)

    # -- vLLM's utility endpoints -----------------------------------------------------------
    async def tokenize(self, req: TokenizeRequest) -> dict:
        state = self.state
        state.check_accepting()
        state.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "send exactly one of 'prompt' and 'messages'", param="prompt")
        prompts = state.prompts
        if req.prompt is not None:
            special = True if req.add_special_tokens is None else req.add_special_tokens
            ids = await self._tokenize(prompts.text_ids, req.prompt, special)
        else:
            check_messages(req.messages)
            if req.tools:
                check_tools(req.tools)
            ids = await self._tokenize(prompts.chat_ids, request_messages(req.messages), req.add_generation_prompt, bool(req.add_special_tokens), req.tools,
                                       req.chat_template_kwargs, param="messages")
        strs = await prompts.run(prompts.token_strs, ids) if req.return_token_strs else None
        return {"count": len(ids), "max_model_len": state.engine.max_model_len, "tokens": ids, "token_strs": strs}

    async def detokenize(self, req: DetokenizeRequest) -> dict:
        state = self.state
        state.check_accepting()
        state.check_model(req.model)
        vocab = state.engine.vocab_size
        bad = next((t for t in req.tokens if vocab and t >= vocab), None)
        if bad is not None:
            raise APIError(400, f"token id {bad} is outside the vocabulary [0, {vocab})", param="tokens")
        return {"prompt": await state.prompts.run(state.prompts.decode, req.tokens)}


    def tokenizer_info(self) -> dict:
        """vLLM's GET /tokenizer_info: the tokenizer's init kwargs (tokenizer_config.json) without
        file paths, special tokens as their text, its class, and the chat template this server
        renders with (what lm-evaluation-harness's remote tokenizer reads)."""
        state = self.state
        if not state.tokenizer_info:
            raise APIError(404, "/tokenizer_info is off (--no-enable-tokenizer-info-endpoint)", code="not_found")
        state.check_accepting()
        tok = state.engine.tokenizer
        config = {k: _plain(v) for k, v in (getattr(tok, "init_kwargs", None) or {}).items() if not k.endswith("_file")}
        config["tokenizer_class"] = type(tok).__name__
        template = state.prompts.chat_template if state.prompts is not None else None
        if template:
            config["chat_template"] = template
        return config


def _plain(value):
    """JSON's types: an AddedToken is its text (as vLLM writes it), anything else unknown its str()."""
    if hasattr(value, "content") and not isinstance(value, (str, dict)):
        return value.content
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return str(value)
