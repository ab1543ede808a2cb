"""SamplingParams: the sampling fields of docs/design.md, the same in the API and in HTTP bodies."""

from __future__ import annotations

from dataclasses import dataclass, field


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
    priority: int = 0
    skip_special_tokens: bool = True
    # what each RequestOutput holds (vLLM's RequestOutputKind): "cumulative" (everything so
    # far), "delta" (what this step added: the server), "final_only" (one output at the end)
    output_kind: str = "cumulative"
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

        if not isinstance(self.n, int) or self.n < 1:
            bad(f"n must be an integer >= 1, got {self.n!r}")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            bad(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if self.min_tokens < 0 or (self.max_tokens is not None and self.min_tokens > self.max_tokens):
            bad(f"min_tokens must be in [0, max_tokens], got {self.min_tokens}")
        if not 0.0 <= self.temperature <= 100.0:
            bad(f"temperature must be in [0, 100], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            bad(f"top_p must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            bad(f"top_k must be -1, 0 (off) or a positive integer, got {self.top_k!r}")
        if not 0.0 <= self.min_p <= 1.0:
            bad(f"min_p must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                bad(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not 0.0 < self.repetition_penalty <= 10.0:
            bad(f"repetition_penalty must be in (0, 10], got {self.repetition_penalty}")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            bad(f"logprobs must be in [0, 20], got {self.logprobs}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            bad("stop must be a non-empty string or a list of non-empty strings")
        if self.output_kind not in ("cumulative", "delta", "final_only"):
            bad(f"output_kind must be cumulative, delta or final_only, got {self.output_kind!r}")
        if not isinstance(self.priority, int):
            bad(f"priority must be an integer, got {self.priority!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5
