"""Incremental detokenization that never emits half a multi-byte character.

With a fast (Rust) tokenizer each sequence keeps a `tokenizers` DecodeStream, primed with
the prompt's last few tokens so the tokenizer's leading-space rules apply; each new token
costs one step in Rust (it holds back bytes until they form a character). The window
decode it replaced (decode a short window twice, emit the difference) cost ~13 us a token
in Python, half of a 256-sequence GPU decode step's host time. Other tokenizers keep the
window decode, holding text back while it ends in U+FFFD. Stop strings are matched here too.
"""

from __future__ import annotations

try:
    from tokenizers.decoders import DecodeStream
except ImportError:  # tokenizers < 0.21
    DecodeStream = None

from shoal.runtime.engine.request import Sequence

# tokens of context before the first new one, so leading-space rules of the tokenizer apply
CONTEXT_TOKENS = 5


def start(seq: Sequence) -> None:
    seq.prefix_offset = max(seq.num_prompt_tokens - CONTEXT_TOKENS, 0)
    seq.read_offset = seq.num_prompt_tokens
    seq.decode_stream = None


def _stream(tokenizer, seq: Sequence):
    """The sequence's DecodeStream, primed with its context; None for a slow tokenizer."""
    if seq.decode_stream is None:
        rust = getattr(tokenizer, "_tokenizer", None)
        if DecodeStream is None or rust is None or not hasattr(rust, "decode"):
            return None
        stream = DecodeStream(skip_special_tokens=seq.params.skip_special_tokens)
        for token in seq.token_ids[seq.prefix_offset : seq.read_offset]:
            stream.step(rust, token)  # context only: its text is the prompt's
        seq.decode_stream = (stream, rust)
    return seq.decode_stream


def append_text(tokenizer, seq: Sequence, final: bool = False, end: int | None = None) -> str:
    """Decode what the sequence's tokens since the last call added (up to `end`); returns the new
    text (maybe ''). Held back while it ends in an incomplete character, unless `final`: then
    only that incomplete tail is dropped. Offline requests without stop strings call this
    once, at the end, for all of their tokens (the engine reads no text before that)."""
    ids = seq.token_ids if end is None else seq.token_ids[:end]
    if (streaming := _stream(tokenizer, seq)) is not None:
        stream, rust = streaming
        if len(ids) == seq.read_offset + 1:  # a decode step's one token
            delta = stream.step(rust, ids[-1]) or ""
        else:
            delta = "".join(c for c in (stream.step(rust, t) for t in ids[seq.read_offset :]) if c is not None)
        seq.read_offset = len(ids)
        seq.text += delta
        return delta
    skip = seq.params.skip_special_tokens
    before = tokenizer.decode(ids[seq.prefix_offset : seq.read_offset], skip_special_tokens=skip)
    after = tokenizer.decode(ids[seq.prefix_offset :], skip_special_tokens=skip)
    if final:
        after = after.rstrip("\ufffd")
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
