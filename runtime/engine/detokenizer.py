"""Incremental detokenization that never emits half a multi-byte character.

Each step decodes a short window of recent tokens twice (before and after the new ones)
and emits the difference, holding it back while it ends in U+FFFD (an incomplete UTF-8
sequence that the next token will finish). Stop strings are matched here too.
"""

from __future__ import annotations

from shoal.runtime.engine.request import Sequence

# tokens of context before the first new one, so leading-space rules of the tokenizer apply
CONTEXT_TOKENS = 5


def start(seq: Sequence) -> None:
    seq.prefix_offset = max(seq.num_prompt_tokens - CONTEXT_TOKENS, 0)
    seq.read_offset = seq.num_prompt_tokens


def append_text(tokenizer, seq: Sequence) -> str:
    """Decode what the sequence's latest token added; returns the new text (maybe '')."""
    skip = seq.params.skip_special_tokens
    ids = seq.token_ids
    before = tokenizer.decode(ids[seq.prefix_offset : seq.read_offset], skip_special_tokens=skip)
    after = tokenizer.decode(ids[seq.prefix_offset :], skip_special_tokens=skip)
    if len(after) <= len(before) or after.endswith("\ufffd"):
        return ""
    delta = after[len(before) :]
    seq.prefix_offset, seq.read_offset = seq.read_offset, len(ids)
    seq.text += delta
    return delta


def find_stop(seq: Sequence, delta: str) -> str | None:
    """If a stop string now appears, cut the text before it (after it, with
    include_stop_str_in_output) and return the string."""
    for stop in seq.params.stop:
        # only the tail can hold a new match: the delta plus what a stop string spans
        start_at = max(0, len(seq.text) - len(delta) - len(stop) + 1)
        index = seq.text.find(stop, start_at)
        if index != -1:
            seq.text = seq.text[: index + (len(stop) if seq.params.include_stop_str_in_output else 0)]
            return stop
    return None
