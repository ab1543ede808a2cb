"""bad_words (vLLM's): strings the output must not contain, as token sequences.

Each word is tokenized as it is and with a leading space (how it appears after another
word), without special tokens. A one-token sequence is banned at every step; a longer one
has its last token banned whenever the output so far ends with the rest of it.
"""

from __future__ import annotations


def token_sequences(tokenizer, words: list[str]) -> list[list[int]]:
    seqs: list[list[int]] = []
    for word in words:
        for text in {word, " " + word.lstrip()}:
            ids = tokenizer(text, add_special_tokens=False).input_ids
            if ids and ids not in seqs:
                seqs.append(ids)
    return seqs


def banned_now(sequences: list[list[int]], output_ids: list[int]) -> list[int]:
    """The token ids that would complete a bad word after this output."""
    banned = []
    for ids in sequences:
        prefix = ids[:-1]
        if not prefix or (len(output_ids) >= len(prefix) and output_ids[len(output_ids) - len(prefix):] == prefix):
            banned.append(ids[-1])
    return banned
