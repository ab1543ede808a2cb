"""Turn a step's logits into tokens, batched over every sequence that samples.

Penalties, min_tokens, temperature, top-k, top-p and min-p are each applied only when
some row asks for them, so an all-greedy batch costs one argmax. Sampling uses the
exponential-race trick (argmax of p / E, E ~ Exp(1)), drawing E from each seeded
sequence's own generator, so a seed gives the same text whatever else is in the batch.
E is drawn as -log(U): on CPU that is ~4x cheaper than `exponential_` over a 50k vocab.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shoal.runtime.engine.request import Sequence


@dataclass
class SampleResult:
    token_ids: list[int]
    logprobs: list[dict[int, float]] | None  # per row, when any row asked for them
    chosen_logprobs: list[float] | None


def _column(values, dtype=torch.float32):
    return torch.tensor(values, dtype=dtype)[:, None]


def _token_counts(rows: list[list[int]], vocab: int) -> torch.Tensor:
    counts = torch.zeros(len(rows), vocab)
    width = max(1, max(len(r) for r in rows))
    ids = torch.tensor([r + [0] * (width - len(r)) for r in rows])
    ones = torch.tensor([[1.0] * len(r) + [0.0] * (width - len(r)) for r in rows])
    return counts.scatter_add_(1, ids, ones)


def apply_penalties(logits: torch.Tensor, seqs: list[Sequence]) -> None:
    vocab = logits.shape[1]
    rep = [s.params.repetition_penalty for s in seqs]
    if any(r != 1.0 for r in rep):
        # as transformers and vLLM: every token seen (prompt and output) is penalized once
        seen = _token_counts([s.token_ids for s in seqs], vocab) > 0
        r = _column(rep).expand_as(logits)
        penalized = torch.where(logits > 0, logits / r, logits * r)
        logits.copy_(torch.where(seen, penalized, logits))
    pres = [s.params.presence_penalty for s in seqs]
    freq = [s.params.frequency_penalty for s in seqs]
    if any(pres) or any(freq):
        counts = _token_counts([s.output_ids for s in seqs], vocab)
        logits -= _column(freq) * counts + _column(pres) * (counts > 0)


def apply_min_tokens(logits: torch.Tensor, seqs: list[Sequence], eos_ids: list[int]) -> None:
    for row, s in enumerate(seqs):
        if s.num_output_tokens < s.params.min_tokens:
            banned = ([] if s.params.ignore_eos else eos_ids) + s.params.stop_token_ids
            logits[row, banned] = float("-inf")


def apply_top_k_top_p_min_p(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    top_k = [s.params.top_k or logits.shape[1] for s in seqs]
    top_p = [s.params.top_p for s in seqs]
    min_p = [s.params.min_p for s in seqs]
    if any(p > 0 for p in min_p):
        probs = logits.softmax(-1)
        threshold = probs.max(-1, keepdim=True).values * _column(min_p)
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    if any(k < logits.shape[1] for k in top_k) or any(p < 1.0 for p in top_p):
        sorted_logits, order = logits.sort(-1, descending=True)
        ranks = torch.arange(logits.shape[1])[None, :]
        drop = ranks >= _column(top_k, torch.long)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop |= (cum - sorted_logits.softmax(-1)) >= _column(top_p)  # keep the token that crosses p
        logits = logits.scatter(1, order, sorted_logits.masked_fill(drop, float("-inf")))
    return logits


@torch.inference_mode()
def sample(logits: torch.Tensor, seqs: list[Sequence], eos_ids: list[int]) -> SampleResult:
    """logits [S, V] float32, one row per sampling sequence."""
    logits = logits.float()
    want_logprobs = [s.params.logprobs for s in seqs]
    raw_logprobs = logits.log_softmax(-1) if any(k is not None for k in want_logprobs) else None

    if any(s.params.repetition_penalty != 1.0 or s.params.presence_penalty or s.params.frequency_penalty for s in seqs):
        apply_penalties(logits, seqs)
    if any(s.num_output_tokens < s.params.min_tokens for s in seqs):
        apply_min_tokens(logits, seqs, eos_ids)

    greedy = [s.params.greedy for s in seqs]
    if all(greedy):
        tokens = logits.argmax(-1)
    else:
        temps = _column([1.0 if g else s.params.temperature for g, s in zip(greedy, seqs)])
        scaled = apply_top_k_top_p_min_p(logits / temps, seqs)
        probs = scaled.softmax(-1)
        race = torch.rand_like(probs)
        for row, s in enumerate(seqs):
            if s.generator is not None:
                race[row] = torch.rand(probs.shape[1], generator=s.generator)
        race = race.log_().neg_()  # Exp(1); U = 0 gives +inf, which never wins the race
        tokens = (probs / race).argmax(-1)
        if any(greedy):
            tokens = torch.where(torch.tensor(greedy), logits.argmax(-1), tokens)

    token_list = tokens.tolist()
    if raw_logprobs is None:
        return SampleResult(token_list, None, None)
    chosen = raw_logprobs.gather(1, tokens[:, None])[:, 0].tolist()
    k_max = max(k or 0 for k in want_logprobs)
    top_vals, top_ids = raw_logprobs.topk(max(1, k_max), dim=-1)
    per_row = []
    for row, k in enumerate(want_logprobs):
        entry = {}
        if k is not None:
            entry = dict(zip(top_ids[row, :k].tolist(), top_vals[row, :k].tolist()))
            entry[token_list[row]] = chosen[row]
        per_row.append(entry)
    return SampleResult(token_list, per_row, chosen)
