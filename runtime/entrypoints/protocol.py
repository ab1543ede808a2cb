"""OpenAI request and response bodies (pydantic), plus the extra sampling fields of docs/design.md.

Requests are validated here (types, ranges that are protocol rules); value checks that are
sampling rules live in `SamplingParams.validate`, so the API and HTTP say the same thing.
Unknown fields are ignored, as vLLM does, so clients that send newer OpenAI fields keep
working. Responses are built as plain dicts on the hot path (streaming chunks); the models
below document them in the OpenAPI schema.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from shoal.runtime.sampling_params import SamplingParams

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
TokenId = Annotated[int, Field(ge=0, le=2**31 - 1)]
Int64 = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)]
# n and the number of prompts in one body are bounded so no single body fans out
# into an unbounded number of engine requests (the waiting queue bounds the rest).
MAX_N = 128
MAX_PROMPTS = 256


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool | None = False


class _SamplingRequest(BaseModel):
    """Fields common to both endpoints: OpenAI's, then the extras of docs/design.md."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: Int64 | None = None
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None
    # extras (vLLM's names)
    top_k: int | None = None
    min_p: float | None = None
    min_tokens: int = Field(0, ge=0)
    repetition_penalty: float | None = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool = False
    priority: Int64 = 0
    skip_special_tokens: bool = True

    @field_validator("stop")
    @classmethod
    def _stop(cls, v):
        if isinstance(v, list) and len(v) > 64:
            raise ValueError("at most 64 stop strings")
        return v

    def unsupported(self) -> str | None:
        """A message naming a field that is set but not supported, or None."""
        if self.logit_bias:
            return "logit_bias is not supported"
        return None

    def sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        """Raises ValueError with SamplingParams' message on a bad value."""
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
        )
        for name in ("temperature", "top_p", "presence_penalty", "frequency_penalty", "top_k", "min_p", "repetition_penalty"):
            value = getattr(self, name)
            if value is not None:
                kw[name] = value
        if isinstance(kw["stop"], str):
            kw["stop"] = [kw["stop"]]
        return SamplingParams(**kw)


class CompletionRequest(_SamplingRequest):
    prompt: str | list[str] | list[TokenId] | list[list[TokenId]]
    max_tokens: int | None = 16
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool | None = False
    best_of: int | None = None
    suffix: str | None = None

    def unsupported(self) -> str | None:
        if self.suffix:
            return "suffix is not supported"
        if self.best_of is not None and self.best_of != self.n:
            return "best_of other than n is not supported"
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
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: str


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[dict] | None = None
    tool_choice: Any = None
    response_format: ResponseFormat | None = None
    add_generation_prompt: bool = True

    def unsupported(self) -> str | None:
        if self.tools and self.tool_choice != "none":
            return "tools are not supported by this server"
        if self.response_format is not None and self.response_format.type != "text":
            return f"response_format {self.response_format.type!r} is not supported"
        if self.top_logprobs and not self.logprobs:
            return "top_logprobs requires logprobs: true"
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


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None


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


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "shoal"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
