"""The engine's side of prompt logprobs (docs/engine.md): which rows of a step score which
prompt tokens, and the scores folded back into each request's `prompt_logprobs`.

A sequence scores its prompt chunk by chunk (chunked prefill), so each step names the
rows of the positions it computes; scores land by position, so a prompt computed again
after a preemption writes the same values again. Such a sequence reads nothing from the
prefix cache (Sequence.scores_prompt): skipped tokens would have no scores.
"""

from __future__ import annotations

import functools

import torch

from shoal.runtime.engine.request import Logprob
from shoal.runtime.engine.scheduler import ScheduledBatch
from shoal.runtime.executor.prompt_logprobs import PromptRows


@functools.lru_cache(maxsize=1 << 16)
def _text(tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id])


class PromptScoring:
    """One step's prompt rows, and whose positions they are."""

    def __init__(self, batch: ScheduledBatch):
        rows, targets, self.spans, k = [], [], [], 0
        end = 0
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            start, end = end, end + n
            if not seq.scores_prompt:
                continue
            first = seq.num_computed
            last = min(first + n, seq.num_prompt_tokens - 1)  # the last prompt position predicts the output
            if last <= first:
                continue
            rows.extend(range(start, start + last - first))
            targets.extend(seq.token_ids[first + 1 : last + 1])
            self.spans.append((seq, first, last - first))
            k = max(k, seq.params.prompt_logprobs)
        self.rows = PromptRows(torch.tensor(rows, dtype=torch.long), torch.tensor(targets, dtype=torch.long), k) if rows else None

    def collect(self, tokenizer) -> None:
        """Each scored position's {token: Logprob}: the prompt's token first, then the top k."""
        values = self.rows.scores.tolist()
        k_max = self.rows.k
        i = 0
        for seq, first, count in self.spans:
            k = seq.params.prompt_logprobs
            out = seq.request.prompt_logprobs
            for p in range(first + 1, first + count + 1):
                row = values[i]
                i += 1
                token = seq.token_ids[p]
                entry = {token: Logprob(row[0], int(row[1]), _text(tokenizer, token))}
                for rank, (value, tid) in enumerate(zip(row[2 : 2 + k], row[2 + k_max : 2 + k_max + k]), 1):
                    tid = int(tid)
                    if tid not in entry:
                        entry[tid] = Logprob(value, rank, _text(tokenizer, tid))
                out[p] = entry


def prompt_scoring(batch: ScheduledBatch) -> PromptScoring | None:
    """The step's prompt rows, or None when no sequence of it scores its prompt."""
    if not any(s.scores_prompt for s in batch.seqs):
        return None
    scoring = PromptScoring(batch)
    return scoring if scoring.rows is not None else None

