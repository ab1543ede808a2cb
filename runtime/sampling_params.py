"""SamplingParams: the sampling fields of docs/design.md, the same in the API and in HTTP bodies."""

from __future__ import annotations

from dataclasses import dataclass, field

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_N = 128
MAX_LOGPROBS = 20
MAX_STOP = 64
MAX_LOGIT_BIAS = 100.0  # OpenAI's range for logit_bias values
MAX_BAD_WORDS = 256


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


@dataclass
class StructuredOutputsParams:
    """What the output must match (vLLM's StructuredOutputsParams): exactly one of these.

    The server turns response_format, `structured_outputs`, the older `guided_*` fields and
    a forced tool call into one of these; the engine compiles it once per distinct value.
    """

    json: dict | str | None = None  # a JSON schema (a dict, or its JSON text)
    json_object: bool = False  # any JSON object (response_format json_object)
    regex: str | None = None
    choice: list[str] | None = None  # one of these strings, verbatim
    grammar: str | None = None  # an EBNF grammar (GBNF as xgrammar reads it)
    disable_any_whitespace: bool = False

    def __post_init__(self):
        given = [k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None] + (["json_object"] if self.json_object else [])
        if len(given) != 1:
            raise ValueError(f"structured outputs take exactly one of json, json_object, regex, choice, grammar; got {given or 'none'}")
        if self.choice is not None and (not self.choice or any(not isinstance(c, str) for c in self.choice)):
            raise ValueError("structured_outputs.choice must be a non-empty list of strings")


@dataclass
class SamplingParams:
    n: int = 1
    max_tokens: int | None = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top log-probabilities per token (the chosen one always included)
    # the same for every prompt token after the first (vLLM's prompt_logprobs; docs/engine.md)
    prompt_logprobs: int | None = None
    priority: int = 0
    skip_special_tokens: bool = True
    # what each RequestOutput holds (vLLM's RequestOutputKind): "cumulative" (everything so
    # far), "delta" (what this step added: the server), "final_only" (one output at the end)
    output_kind: str = "cumulative"
    include_stop_str_in_output: bool = False
    structured_outputs: StructuredOutputsParams | None = None
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit, in [-100, 100]
    allowed_token_ids: list[int] | None = None  # only these may be sampled
    bad_words: list[str] | None = None  # never produced (engine/bad_words.py)
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self.validate()

    def validate(self) -> None:
        def bad(msg):
            raise ValueError(msg)

        # Every value here may reach a tensor (torch.tensor(top_k), the seed):
        # each is an integer or a finite float in a bounded range, or it is refused.
        if not _is_int(self.n) or not 1 <= self.n <= MAX_N:
            bad(f"n must be an integer in [1, {MAX_N}], got {self.n!r}")
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or not 1 <= self.max_tokens <= INT64_MAX):
            bad(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not _is_int(self.min_tokens) or self.min_tokens < 0 or (self.max_tokens is not None and self.min_tokens > self.max_tokens):
            bad(f"min_tokens must be in [0, max_tokens], got {self.min_tokens!r}")
        for name, lo, hi in (("temperature", 0.0, 100.0), ("min_p", 0.0, 1.0), ("presence_penalty", -2.0, 2.0), ("frequency_penalty", -2.0, 2.0)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not lo <= v <= hi:  # NaN fails too
                bad(f"{name} must be in [{lo:g}, {hi:g}], got {v!r}")
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
            bad(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or not 0 <= self.top_k <= INT64_MAX:  # the sampler treats k >= vocab as off
            bad(f"top_k must be -1, 0 (off) or a positive integer, got {self.top_k!r}")
        if isinstance(self.repetition_penalty, bool) or not isinstance(self.repetition_penalty, (int, float)) or not 0.0 < self.repetition_penalty <= 10.0:
            bad(f"repetition_penalty must be in (0, 10], got {self.repetition_penalty!r}")
        if self.logprobs is not None and (not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            bad(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")
        if self.prompt_logprobs is not None and (not _is_int(self.prompt_logprobs) or not 0 <= self.prompt_logprobs <= MAX_LOGPROBS):
            bad(f"prompt_logprobs must be in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs!r}")
        if self.seed is not None and (not _is_int(self.seed) or not INT64_MIN <= self.seed <= INT64_MAX):
            bad(f"seed must be an integer in [{INT64_MIN}, {INT64_MAX}], got {self.seed!r}")
        if len(self.stop) > MAX_STOP or any(not isinstance(s, str) or not s for s in self.stop):
            bad(f"stop must be a non-empty string or a list of at most {MAX_STOP} non-empty strings")
        if any(not _is_int(t) or not 0 <= t <= 2**31 - 1 for t in self.stop_token_ids):
            bad("stop_token_ids must be token ids (integers >= 0)")
        if not _is_int(self.priority) or not INT64_MIN <= self.priority <= INT64_MAX:
            bad(f"priority must be a 64-bit integer, got {self.priority!r}")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict) or any(not _is_int(k) or k < 0 for k in self.logit_bias):
                bad("logit_bias must map token ids (integers >= 0) to biases")
            for v in self.logit_bias.values():
                if isinstance(v, bool) or not isinstance(v, (int, float)) or not -MAX_LOGIT_BIAS <= v <= MAX_LOGIT_BIAS:
                    bad(f"logit_bias values must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], got {v!r}")
        if self.allowed_token_ids is not None and (not isinstance(self.allowed_token_ids, list) or not self.allowed_token_ids
                                                   or any(not _is_int(t) or t < 0 for t in self.allowed_token_ids)):
            bad("allowed_token_ids must be a non-empty list of token ids (integers >= 0)")
        if self.bad_words is not None and (not isinstance(self.bad_words, list) or len(self.bad_words) > MAX_BAD_WORDS
                                           or any(not isinstance(w, str) or not w.strip() for w in self.bad_words)):
            bad(f"bad_words must be a list of at most {MAX_BAD_WORDS} non-blank strings")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            bad("structured_outputs must be a StructuredOutputsParams")
        if self.output_kind not in ("cumulative", "delta", "final_only"):
            bad(f"output_kind must be cumulative, delta or final_only, got {self.output_kind!r}")

    def check_vocab(self, vocab_size: int) -> None:
        """The token ids this asks for exist in a vocabulary of vocab_size (the logits' width)."""
        for name, ids in (("logit_bias", self.logit_bias or {}), ("allowed_token_ids", self.allowed_token_ids or []),
                          ("stop_token_ids", self.stop_token_ids)):
            outside = next((t for t in ids if t >= vocab_size), None)
            if outside is not None:
                raise ValueError(f"{name} holds token id {outside}, outside the vocabulary [0, {vocab_size})")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5
