"""Prompt log-probabilities (vLLM's prompt_logprobs): how likely each prompt token was,
given the tokens before it.

The hidden state of prompt position p scores token p + 1. The engine names those rows of a
step's flat batch (PromptRows); the runner projects only them through the LM head, SLICE
rows at a time, so a long prompt never holds [prompt_len, vocab] logits at once, and keeps
per row the next token's log-probability, its rank and the top k. The scores go back to
the engine in the PromptRows it sent (`scores`), beside the step's sampled tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SLICE = 256  # rows projected through the LM head at once: [256, vocab] float32 is 50 MB at 49k


@dataclass
class PromptRows:
    rows: torch.Tensor  # [R] long: flat rows of the step whose hidden state scores the next prompt token
    targets: torch.Tensor  # [R] long: that next prompt token
    k: int  # top log-probabilities kept per row (the most any of the step's requests asks)
    scores: torch.Tensor | None = None  # set by the runner: [R, 2 + 2k] float64, see score()


@torch.inference_mode()
def score(compute_logits, hidden: torch.Tensor, rows: PromptRows, slice_rows: int = SLICE) -> torch.Tensor:
    """[R, 2 + 2k] float64 on hidden's device: the target's log-probability, its rank (1 = the
    likeliest; as vLLM, tokens at least as likely count), the top k values, then their ids
    (float64 holds token ids exactly; one tensor is one transfer)."""
    dev = hidden.device
    idx, targets = rows.rows.to(dev), rows.targets.to(dev)
    out = torch.empty(len(idx), 2 + 2 * rows.k, dtype=torch.float64, device=dev)
    for start in range(0, len(idx), slice_rows):
        part = slice(start, start + slice_rows)
        lp = compute_logits(hidden[idx[part]]).float().log_softmax(-1)
        chosen = lp.gather(1, targets[part, None])
        cols = [chosen, (lp >= chosen).sum(-1, keepdim=True)]
        if rows.k:
            top = lp.topk(rows.k, dim=-1)
            cols += [top.values, top.indices]
        out[part] = torch.cat([c.double() for c in cols], 1)
    return out
