"""Scoring prompts as evaluation harnesses do, and vLLM's token extras (docs/design.md):

  prompt_logprobs k            completions: per choice; chat: top level. [null, {"id":
                               {logprob, rank, decoded_token}}, ...]: the prompt's token
                               and the top k at each position after the first
  echo + logprobs k            completions: the prompt's tokens lead `logprobs` (tokens,
                               token_logprobs, top_logprobs, text_offset; null for the first)
  echo + max_tokens 0          completions: the prompt and its logprobs alone, nothing
                               generated (lm-evaluation-harness's loglikelihood request)
  truncate_prompt_tokens k     keep the last k prompt tokens (-1: max_model_len)
  return_token_ids             prompt_token_ids, and each choice's token_ids
  return_tokens_as_token_ids   "token_id:123" for every token string of `logprobs`

The engine scores a prompt when asked (SamplingParams.prompt_logprobs: the larger of the two
k's, each part shows its own). A streamed completion sends each choice's prompt part (the
echo, its logprobs, prompt_logprobs) in the choice's first chunk, once the request's first
output brought the scores; a streamed chat completion refuses prompt_logprobs (400).
"""

from __future__ import annotations


from shoal.runtime.entrypoints.errors import APIError, finite
from shoal.runtime.entrypoints.protocol import ChatCompletionRequest


class Extras:
    """One request's scoring and token fields: the checks, and what they add to a response."""

    def __init__(self, req, max_model_len: int):
        self.chat = isinstance(req, ChatCompletionRequest)
        echo = not self.chat and bool(req.echo)
        self.echo_only = echo and req.max_tokens == 0
        self.k_echo = req.logprobs if echo and req.logprobs is not None else None  # the echoed prompt's top k
        self.k_field = req.prompt_logprobs  # the prompt_logprobs field's top k
        ks = [k for k in (self.k_echo, self.k_field) if k is not None]
        self.k_engine = max(ks) if ks else None
        self.truncate = max_model_len if req.truncate_prompt_tokens == -1 else req.truncate_prompt_tokens
        self.return_token_ids = req.return_token_ids
        self.as_ids = req.return_tokens_as_token_ids
        self._check(req, max_model_len)

    def _check(self, req, max_model_len: int) -> None:
        if not self.chat and req.max_tokens == 0 and not req.echo:
            raise APIError(400, "max_tokens 0 needs echo: true (the prompt and its logprobs, nothing generated)", param="max_tokens")
        if req.stream and self.chat and self.k_field is not None:
            raise APIError(400, "prompt_logprobs is not supported on a streamed chat completion (ask without streaming)",
                           param="prompt_logprobs")
        t = req.truncate_prompt_tokens
        if t == 0:
            raise APIError(400, "truncate_prompt_tokens must be -1 (max_model_len) or at least 1", param="truncate_prompt_tokens")
        if t is not None and t > max_model_len:
            raise APIError(400, f"truncate_prompt_tokens {t} is larger than max_model_len {max_model_len}", param="truncate_prompt_tokens")

    @property
    def prompt_part_waits(self) -> bool:
        """Completions, streamed: whether a choice's first chunk (the echo) waits for the
        prompt's scores, which come with the request's first output."""
        return not self.chat and (self.k_engine is not None or self.echo_only)

    def check_logprobs_limit(self, limit: int) -> None:
        if self.k_field is not None and self.k_field > limit:
            raise APIError(400, f"at most {limit} logprobs per token (--max-logprobs), got {self.k_field}", param="prompt_logprobs")

    # -- the request ------------------------------------------------------------------------
    def max_tokens(self, asked):
        return 1 if self.echo_only else asked  # echo alone: one token is generated, then dropped

    def truncated(self, ids: list[int]) -> list[int]:
        return ids[-self.truncate :] if self.truncate is not None and len(ids) > self.truncate else ids

    # -- the response -----------------------------------------------------------------------
    def tok(self, state):
        """The token -> string function of `logprobs`."""
        return (lambda t: f"token_id:{t}") if self.as_ids else state.tok_str

    def prompt_logprobs(self, entries: list | None) -> list | None:
        """The prompt_logprobs field: the prompt's token and the top k_field at each position."""
        if self.k_field is None or entries is None:
            return None
        return [None if e is None else {str(t): {"logprob": finite(lp.logprob), "rank": lp.rank, "decoded_token": lp.decoded_token}
                                        for t, lp in _top(e, self.k_field).items()} for e in entries]

    def echo_logprobs(self, state, ids: list[int], entries: list | None) -> tuple[dict, int]:
        """Completions' logprobs of the echoed prompt, and the text offset after it."""
        tok = self.tok(state)
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        offset = 0
        for p, t in enumerate(ids):
            s = tok(t)
            e = entries[p] if entries is not None else None
            out["tokens"].append(s)
            out["token_logprobs"].append(None if e is None else finite(e[t].logprob))
            out["top_logprobs"].append(None if e is None else {tok(k): finite(lp.logprob) for k, lp in
                                                              sorted(_top(e, self.k_echo).items(), key=lambda kv: -kv[1].logprob)})
            out["text_offset"].append(offset)
            offset += len(s)
        return out, offset

    def choice(self, choice: dict, prompt_ids: list[int], token_ids: list[int], prompt_logprobs: list | None) -> None:
        """Completions: a choice's prompt_logprobs and token ids (vLLM's fields)."""
        if self.k_field is not None and not self.chat:
            choice["prompt_logprobs"] = self.prompt_logprobs(prompt_logprobs)
        if self.return_token_ids:
            if not self.chat:
                choice["prompt_token_ids"] = prompt_ids
            choice["token_ids"] = token_ids

    def body(self, body: dict, prompt_ids: list[int], prompt_logprobs: list | None) -> None:
        """Chat: the response's prompt_logprobs and prompt_token_ids (vLLM's fields)."""
        if self.chat and self.k_field is not None:
            body["prompt_logprobs"] = self.prompt_logprobs(prompt_logprobs)
        if self.chat and self.return_token_ids:
            body["prompt_token_ids"] = prompt_ids


def _top(entry: dict, k: int) -> dict:
    """The prompt's token (first in the entry) and the entries ranked in the top k."""
    first = next(iter(entry))
    return {t: lp for t, lp in entry.items() if t == first or (lp.rank is not None and lp.rank <= k)}
