"""OpenAI request and response bodies (pydantic), plus the extra sampling fields of docs/design.md.

Requests are validated here, strictly (no "4" for 4, no true for 1, no NaN), with every
numeric range in the OpenAPI schema (Field ge/le) so clients and fuzzers see the edges;
`SamplingParams.validate` checks the same rules again for the Python API. Unknown fields
are ignored, as vLLM does, so clients that send newer OpenAI fields keep working, but a
field this server knows and does not implement (vLLM's guided_json, bad_words, ...)
is refused with a 400 that names it, never silently ignored. Responses are built as plain
dicts on the hot path (streaming chunks); the models below document them in the schema.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from shoal.runtime.entrypoints import structured_request
from shoal.runtime.entrypoints.errors import APIError
from shoal.runtime.entrypoints.prompts import check_template_kwargs
from shoal.runtime.sampling_params import INT64_MAX, INT64_MIN, MAX_LOGPROBS, MAX_N, MAX_STOP, SamplingParams, StructuredOutputsParams

TokenId = Annotated[int, Field(ge=0, le=2**31 - 1)]
Int64 = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)]
# n and the number of prompts in one body are bounded so no single body fans out
# into an unbounded number of engine requests (the waiting queue bounds the rest).
MAX_PROMPTS = 256
MAX_STOP_CHARS = 1024

# Fields of vLLM's or OpenAI's request bodies that this server does not implement, with the
# value that means "not used": a body that sets one to anything else gets a 400 naming it.
UNSUPPORTED_FIELDS: dict[str, Any] = {
    "guided_whitespace_pattern": None, "structural_tag": None,
    "use_beam_search": False, "length_penalty": 1.0, "logits_processors": None,
    "spaces_between_special_tokens": True, "prompt_embeds": None, "kv_transfer_params": None,
    "cache_salt": None, "vllm_xargs": None, "mm_processor_kwargs": None, "chat_template": None,
    "continue_final_message": False, "documents": None,
    "functions": None, "function_call": None, "audio": None, "modalities": None, "prediction": None,
    "reasoning_effort": None, "web_search_options": None, "echo": False,
}

_STRICT = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)


def check_text(value: str, what: str) -> str:
    """Refuse a string that is not valid Unicode (a lone UTF-16 surrogate from a JSON escape)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{what} is not valid Unicode: a lone surrogate (U+{ord(value[e.start]):04X}) at index {e.start}") from None
    return value


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


class StreamOptions(BaseModel):
    """include_usage: a last chunk with the usage; continuous_usage_stats (vLLM's, with
    include_usage): every chunk also carries its choice's usage so far."""

    model_config = _STRICT
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class JsonSchemaFormat(BaseModel):
    model_config = _STRICT
    name: str | None = None
    schema_: dict | bool | None = Field(None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(BaseModel):
    model_config = _STRICT
    type: str = Field(description="text, json_object or json_schema")
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsBody(BaseModel):
    """vLLM's `structured_outputs` body field: exactly one of json, regex, choice, grammar, json_object."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)
    json_: dict | bool | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False


class _SamplingRequest(BaseModel):
    """Fields common to both endpoints: OpenAI's, then the extras of docs/design.md."""

    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)

    model: str | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: float | None = Field(None, ge=0, le=100)
    top_p: float | None = Field(None, gt=0, le=1)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    seed: Int64 | None = None
    stop: str | list[str] | None = Field(None, description=f"at most {MAX_STOP} strings of at most {MAX_STOP_CHARS} characters")
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None
    # extras (vLLM's names)
    top_k: int | None = Field(None, ge=-1, description="-1 or 0: off; values at or above the vocabulary size are off too")
    min_p: float | None = Field(None, ge=0, le=1)
    min_tokens: int = Field(0, ge=0, le=INT64_MAX)
    repetition_penalty: float | None = Field(None, gt=0, le=10)
    stop_token_ids: list[TokenId] | None = Field(None, max_length=MAX_STOP)
    ignore_eos: bool = False
    priority: Int64 = Field(0, description="lower runs first; anything but 0 needs --scheduling-policy priority")
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # structured outputs and logit masks (docs/structured_outputs.md; structured_request.py reads them)
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsBody | None = None
    guided_json: dict | bool | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = Field(None, description="xgrammar or auto")
    allowed_token_ids: list[TokenId] | None = None
    bad_words: list[str] | None = None
    # scoring and token extras, vLLM's (entrypoints/scoring.py)
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, description="log-probabilities of the prompt's tokens, top k")
    truncate_prompt_tokens: int | None = Field(None, ge=-1, le=INT64_MAX, description="keep the last k prompt tokens (-1: max_model_len); at most max_model_len")
    return_token_ids: bool = False
    return_tokens_as_token_ids: bool = False

    @field_validator("stop")
    @classmethod
    def _stop(cls, v):
        items = [v] if isinstance(v, str) else (v or [])
        if len(items) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop strings")
        for x in items:
            check_text(x, "stop")
            if len(x) > MAX_STOP_CHARS:
                raise ValueError(f"a stop string may have at most {MAX_STOP_CHARS} characters")
        return v

    @field_validator("model", "user")
    @classmethod
    def _text(cls, v, info):
        return v if v is None else check_text(v, info.field_name)

    def unsupported(self) -> tuple[str, str] | None:
        """(message, field) for a field that is set but not supported, or None."""
        for name, value in (self.model_extra or {}).items():
            if name in UNSUPPORTED_FIELDS and value != UNSUPPORTED_FIELDS[name]:
                return f"{name} is not supported by this server", name
        return None

    def stream_usage(self) -> tuple[bool, bool]:
        """(a last chunk with the usage, a running usage on every chunk): vLLM reads
        continuous_usage_stats only with include_usage."""
        o = self.stream_options
        include = bool(o is not None and o.include_usage)
        return include, include and bool(o.continuous_usage_stats)

    def sampling_params(self, max_tokens: int | None, logprobs: int | None, vocab_size: int | None = None, *,
                        prompt_logprobs: int | None = None, forced: StructuredOutputsParams | None = None) -> SamplingParams:
        """The request's SamplingParams, built once and validated once: the sampling fields, the
        grammar and logit fields (structured_request.py), the prompt scores asked for
        (scoring.py) and a forced tool choice's grammar (tool_parsers/choice.py). Every error is
        a 400 (APIError) naming its field where it can."""
        kw: dict[str, Any] = dict(
            n=self.n,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            priority=self.priority,
            seed=self.seed,
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            prompt_logprobs=prompt_logprobs,
        )
        for name in ("temperature", "top_p", "presence_penalty", "frequency_penalty", "top_k", "min_p", "repetition_penalty"):
            value = getattr(self, name)
            if value is not None:
                kw[name] = value
        if vocab_size and kw.get("top_k", 0) >= vocab_size:
            kw["top_k"] = 0  # keeping the whole vocabulary is no top-k at all (and no huge tensor value)
        kw.update(structured_request.fields(self))
        if forced is not None:
            if kw["structured_outputs"] is not None:
                raise APIError(400, "tool_choice 'required' or a named function cannot be combined with other structured outputs", param="tool_choice")
            kw["structured_outputs"] = forced
        try:
            params = SamplingParams(**kw)
            if vocab_size:
                params.check_vocab(vocab_size)
        except (ValueError, TypeError) as e:
            raise APIError(400, str(e), param=structured_request.param_of(e)) from None
        return params


class CompletionRequest(_SamplingRequest):
    prompt: str | list[str] | list[TokenId] | list[list[TokenId]]
    max_tokens: int | None = Field(16, ge=0, le=INT64_MAX, description="prompt tokens + max_tokens must fit in the model's context; 0 only with echo (score the prompt)")
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool | None = False
    best_of: int | None = Field(None, ge=1, le=MAX_N)
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v):
        if isinstance(v, str):
            return check_text(v, "prompt")
        if v and isinstance(v[0], str):
            for x in v:
                check_text(x, "prompt")
        return v

    def unsupported(self) -> tuple[str, str] | None:
        if self.suffix:
            return "suffix is not supported", "suffix"
        if self.best_of is not None and self.best_of != self.n:
            return "best_of other than n is not supported", "best_of"
        return super().unsupported()

    def prompts(self) -> list[str | list[int]]:
        """The prompt field as a list of prompts (text or token ids); raises ValueError."""
        p = self.prompt
        if isinstance(p, str):
            out: list = [p]
        elif not p:
            raise ValueError("prompt must not be empty")
        elif all(isinstance(x, int) for x in p):
            out = [list(p)]
        else:
            out = list(p)
        if len(out) > MAX_PROMPTS:
            raise ValueError(f"at most {MAX_PROMPTS} prompts per request, got {len(out)}")
        for x in out:
            if len(x) == 0:
                raise ValueError("prompt must not be empty")
        return out


class TextPart(BaseModel):
    model_config = _STRICT
    type: Literal["text"]
    text: str

    @field_validator("text")
    @classmethod
    def _text(cls, v):
        return check_text(v, "messages content")


class ChatMessage(BaseModel):
    model_config = _STRICT
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[dict] | None = None  # an assistant turn's calls; checked in tool_parsers/choice.py
    tool_call_id: str | None = None  # a tool turn: the call it answers

    @field_validator("content", "name")
    @classmethod
    def _text(cls, v, info):
        return check_text(v, f"messages {info.field_name}") if isinstance(v, str) else v

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1, le=INT64_MAX, description="deprecated by OpenAI: max_completion_tokens")
    max_completion_tokens: int | None = Field(None, ge=1, le=INT64_MAX, description="prompt tokens + this must fit in the model's context")
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[dict] | None = None  # tool calling: docs/tools.md, checked in tool_parsers/choice.py
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    add_generation_prompt: bool = True
    # reasoning (docs/reasoning.md): variables for the chat template (Qwen3's enable_thinking), vLLM's fields
    chat_template_kwargs: dict[str, Any] | None = None
    include_reasoning: bool = True

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_kwargs(cls, v):
        return check_template_kwargs(v)

    def unsupported(self) -> tuple[str, str] | None:
        if self.top_logprobs and not self.logprobs:
            return "top_logprobs requires logprobs: true", "top_logprobs"
        return super().unsupported()

    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def completion_tokens_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


# --- responses (documentation; the server builds the same shapes as dicts) ---------------


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]] | None
    text_offset: list[int]


class PromptLogprob(BaseModel):
    logprob: float
    rank: int | None
    decoded_token: str | None


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = Field(None, description="with prompt_logprobs")
    prompt_token_ids: list[int] | None = Field(None, description="with return_token_ids")
    token_ids: list[int] | None = Field(None, description="with return_token_ids")


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[dict] | None = None
    reasoning_content: str | None = Field(None, description="with --reasoning-parser: the thinking, apart from content")
    reasoning: str | None = Field(None, description="the same as reasoning_content (vLLM's newer name)")


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    token_ids: list[int] | None = Field(None, description="with return_token_ids")


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = Field(None, description="with prompt_logprobs")
    prompt_token_ids: list[int] | None = Field(None, description="with return_token_ids")


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "shoal"
    root: str | None = None
    parent: str | None = None  # a LoRA adapter's base model
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


# ------------------------------------------------------------------ vLLM's utility endpoints
class TokenizeRequest(BaseModel):
    """POST /tokenize, vLLM's shape: a prompt, or chat messages rendered with the template."""

    model_config = _STRICT
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[dict] | None = None  # rendered into the chat template, as /v1/chat/completions does (docs/tools.md)
    add_special_tokens: bool | None = None  # vLLM's defaults: True for a prompt, False for messages
    add_generation_prompt: bool = True
    return_token_strs: bool = False
    chat_template_kwargs: dict[str, Any] | None = None

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_kwargs(cls, v):
        return check_template_kwargs(v)

    @field_validator("prompt")
    @classmethod
    def _text(cls, v):
        return check_text(v, "prompt") if isinstance(v, str) else v


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(BaseModel):
    model_config = _STRICT
    model: str | None = None
    tokens: list[TokenId]


class DetokenizeResponse(BaseModel):
    prompt: str

