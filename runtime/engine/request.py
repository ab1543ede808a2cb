"""A request and its sequences (n > 1 gives n sequences), and what the engine returns."""

from __future__ import annotations

import enum
import functools
import itertools
import time
from dataclasses import dataclass, field

from shoal.runtime.sampling_params import SamplingParams

_seq_ids = itertools.count()


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None


@dataclass
class Logprob:
    """One token's log-probability at one prompt position (vLLM's Logprob)."""

    logprob: float
    rank: int | None = None  # 1: the likeliest token there
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, float]] | None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: str | int | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    # params.prompt_logprobs: None for the first token, then {token_id: Logprob} holding the
    # prompt's token and the top k (delta outputs: in the first output only)
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None


class Sequence:
    """One stream of tokens: the prompt, then what was sampled. `num_computed` catches up
    with len(token_ids) one step at a time (prefill, chunked or not, and decode alike)."""

    def __init__(self, request: "Request", index: int, token_ids: list[int]):
        self.seq_id = next(_seq_ids)
        self.request = request
        self.index = index
        self.token_ids = list(token_ids)
        self.num_prompt_tokens = request.num_prompt_tokens
        self.num_computed = 0
        # tokens sampled by a step still in flight, not yet in token_ids (async scheduling
        # schedules the next step before they are read back: docs/engine.md)
        self.num_pending = 0
        self.awaits_fork = False  # an n > 1 sibling made when the prompt completed, before its blocks
        self.block_table: list[int] = []  # its blocks (the first KV-cache group's, models/kv_groups.py)
        self.group_tables: list[list[int]] = []  # the other groups' blocks, where the model has several
        self.num_dropped: list[int] = []  # per group: leading blocks left the sliding window (now the null block)
        self.kv_row: int | None = None  # its row of the KV-cache manager's BlockTables, while it holds blocks
        self.block_hashes: list[int] = []
        self.num_registered = 0  # full blocks already offered to the prefix cache
        self.status = Status.WAITING
        self.order = None  # the scheduler's sort key (Scheduler.add)
        self.lane = 0  # which of the scheduler's lanes runs it (pipelining; see scheduler.py)
        self.cumulative_logprob = 0.0
        self.logprobs: list[dict[int, float]] | None = [] if request.params.logprobs is not None else None
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.num_sent_tokens = 0  # output tokens and text already handed out (delta outputs)
        self.num_sent_chars = 0
        # incremental detokenization state
        self.text = ""
        self.prefix_offset = self.read_offset = self.num_prompt_tokens
        self.decode_stream = None  # (tokenizers DecodeStream, its tokenizer), see detokenizer.py
        self.matcher = None  # its grammar's state (structured outputs), made when it first samples
        self.drop_last_text = False  # its last token (an EOS or stop token) adds no text
        self.lora_slot: int | None = None  # the device slot of its adapter, held while it runs

    @property
    def params(self) -> SamplingParams:
        return self.request.params

    @property
    def priority(self) -> int:
        return self.request.params.priority

    @property
    def arrival_time(self) -> float:
        return self.request.arrival_time

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    @property
    def scores_prompt(self) -> bool:
        """Whether its next prompt chunk must score the prompt's tokens (prompt_logprobs): the
        first sequence, until it samples; it reads nothing from the prefix cache meanwhile."""
        return self.index == 0 and self.request.prompt_logprobs is not None and self.num_output_tokens == 0

    def output(self, delta: bool = False) -> CompletionOutput | None:
        """Everything so far, or (delta) only what was added since the last delta: None if nothing was."""
        first_token, first_char = (self.num_sent_tokens, self.num_sent_chars) if delta else (0, 0)
        ids = self.token_ids[self.num_prompt_tokens + first_token :]
        if delta:
            if not ids and len(self.text) <= first_char and self.finish_reason is None:
                return None
            self.num_sent_tokens += len(ids)
            self.num_sent_chars = max(first_char, len(self.text))  # a stop string may have cut text already sent
        return CompletionOutput(
            index=self.index,
            text=self.text[first_char:],
            token_ids=ids,
            cumulative_logprob=self.cumulative_logprob if self.logprobs is not None else None,
            logprobs=self.logprobs[first_token:] if self.logprobs is not None else None,
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
        )


@dataclass
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float = field(default_factory=time.time)
    seqs: list[Sequence] = field(default_factory=list)
    grammar: object = None  # the compiled grammar of params.structured_outputs (structured_output.py)
    allowed_mask: object = None  # params.allowed_token_ids as a packed int32 bitmask row
    bad_words: list[list[int]] | None = None  # params.bad_words as token sequences
    max_len: int = 1 << 62  # its sequences end at this many tokens (max_tokens, the context): LLMEngine sets it
    lora: object = None  # its LoRA adapter (engine/lora_manager.py), None: the base model
    cache_salt: int | None = None  # the root of its prefix-cache hashes (an adapter's: KV never shared across them)

    def __post_init__(self):
        self.metrics = RequestMetrics(self.arrival_time)
        self.prompt_logprobs = None if self.params.prompt_logprobs is None else [None] * self.num_prompt_tokens
        self._prompt_logprobs_sent = False
        self.seqs.append(Sequence(self, 0, self.prompt_token_ids))

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @functools.cached_property
    def plain_sampling(self) -> bool:
        """Whether its rows sample from a temperature (and top-k/p, min-p) alone: no bans, masks,
        biases, penalties or logprobs. Asked each step for every row, so kept once asked; the
        engine sets the grammar, mask and bad words before it schedules the request."""
        p = self.params
        return (self.grammar is None and self.allowed_mask is None and not self.bad_words and not p.logit_bias
                and not (p.min_tokens and (p.stop_token_ids or not p.ignore_eos)) and p.logprobs is None
                and p.repetition_penalty == 1.0 and not p.presence_penalty and not p.frequency_penalty)

    @functools.cached_property
    def needs_history(self) -> bool:
        """Whether its sampling reads the tokens so far on the host (bad words, a grammar), so
        a step cannot sample before the previous one's tokens are back (async scheduling);
        penalties read them on the device, where the runner adds the token in flight."""
        return self.grammar is not None or bool(self.bad_words)

    @property
    def forked(self) -> bool:
        return len(self.seqs) == self.params.n

    @property
    def finished(self) -> bool:
        seqs = self.seqs
        if len(seqs) == 1:  # the common case, asked each step: no generator
            return self.params.n == 1 and seqs[0].status is Status.FINISHED
        return self.forked and all(s.finished for s in seqs)

    def output(self) -> RequestOutput | None:
        """This step's output in the params' output_kind; None when that kind has nothing to say."""
        kind = self.params.output_kind
        finished = self.finished
        if kind == "final_only" and not finished:
            return None
        delta = kind == "delta"
        outputs = [s.output(delta) for s in self.seqs]
        prompt_logprobs = None if self._prompt_logprobs_sent else self.prompt_logprobs
        if delta and not self._prompt_logprobs_sent:
            self._prompt_logprobs_sent = any(o is not None for o in outputs)
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=[o for o in outputs if o is not None],
            finished=finished,
            metrics=self.metrics,
            prompt_logprobs=prompt_logprobs,
        )
