"""Named benchmark workloads: lists of (prompt token ids, output length), reproducible by seed."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

NAMES = ("public", "sharegpt", "shared-prefix", "gpu", "multi-tenant")


@dataclass
class Item:
    prompt: list[int]
    output_len: int


def public() -> list[Item]:
    """PERFORMANCE.md's workload: 32 requests, prompts U[16, 512], outputs U[16, 256],
    ids U[1000, 40000), one PCG64(0) generator drawn in that order (8,879 / 4,295 tokens)."""
    return public_workload(32, 0)


def gpu(num_prompts: int | None = None) -> list[Item]:
    """PERFORMANCE.md's GPU workload, drawn like the public one: 256 requests, prompts
    U[32, 512], outputs U[32, 256], ids U[100, 40000), one PCG64(0) generator drawn in that
    order (72,245 prompt / 38,043 output tokens). `num_prompts` keeps the first N (a smoke run)."""
    rng = np.random.Generator(np.random.PCG64(0))
    prompt_lens = rng.integers(32, 512, 256, endpoint=True)
    output_lens = rng.integers(32, 256, 256, endpoint=True)
    items = [Item(rng.integers(100, 40000, n).tolist(), int(m)) for n, m in zip(prompt_lens, output_lens)]
    return items[:num_prompts] if num_prompts else items


def sharegpt_like(num: int, seed: int = 0, input_range=(16, 1024), output_range=(16, 512)) -> list[Item]:
    """Log-uniform prompt and output lengths (ShareGPT's shape: most short, a long tail)."""
    rng = np.random.Generator(np.random.PCG64(seed))

    def loguniform(lo, hi, size):
        return np.exp(rng.uniform(math.log(lo), math.log(hi + 1), size)).astype(int).clip(lo, hi)

    ins = loguniform(*input_range, num)
    outs = loguniform(*output_range, num)
    return [Item(rng.integers(1000, 40000, int(n)).tolist(), int(m)) for n, m in zip(ins, outs)]


def public_workload(num: int = 32, seed: int = 0) -> list[Item]:
    """PERFORMANCE.md's public workload: uniform lengths, PCG64(seed), lengths then ids."""
    rng = np.random.Generator(np.random.PCG64(seed))
    ins = rng.integers(16, 512, num, endpoint=True)
    outs = rng.integers(16, 256, num, endpoint=True)
    return [Item(rng.integers(1000, 40000, int(n)).tolist(), int(m)) for n, m in zip(ins, outs)]


def _log_uniform(rng, low: int, high: int, n: int) -> np.ndarray:
    return np.exp(rng.uniform(np.log(low), np.log(high), n)).astype(int)


def sharegpt(num_prompts: int = 64, seed: int = 0, tokenizer=None) -> list[Item]:
    """A ShareGPT-like chat mix: log-uniform prompt (4..1024) and output (4..512) lengths.
    With a tokenizer the prompts are real text (repeated English), else random ids."""
    rng = np.random.default_rng(seed)
    prompt_lens = _log_uniform(rng, 4, 1024, num_prompts)
    output_lens = _log_uniform(rng, 4, 512, num_prompts)
    if tokenizer is not None:
        corpus = tokenizer(_TEXT * 40).input_ids
        starts = rng.integers(0, len(corpus) - 1024, num_prompts)
        prompts = [corpus[s : s + n] for s, n in zip(starts, prompt_lens)]
    else:
        prompts = [rng.integers(1000, 40000, n).tolist() for n in prompt_lens]
    return [Item(p, int(m)) for p, m in zip(prompts, output_lens)]


def shared_prefix(num_prompts: int = 64, seed: int = 0, prefix_len: int = 512) -> list[Item]:
    """Many requests behind one long system prompt: where prefix caching shows its worth."""
    rng = np.random.default_rng(seed)
    system = rng.integers(1000, 40000, prefix_len).tolist()
    return [
        Item(system + rng.integers(1000, 40000, int(rng.integers(16, 64))).tolist(), int(rng.integers(16, 64)))
        for _ in range(num_prompts)
    ]


def multi_tenant(tenants: int = 8, conversations: int = 2, turns: int = 3, system_len: int = 256, turn_len=(32, 64),
                 answer_len: int = 16, seed: int = 0, salt: int = 0) -> list[Item]:
    """Many tenants, each with a long system prompt of its own shared by its conversations;
    each conversation's next turn repeats the previous turns (user text, then the answer,
    here `answer_len` stand-in tokens) and adds a user message. Items come in rounds (every
    conversation's turn 1, in a shuffled order, then every turn 2, ...), so a turn arrives
    after the one before it has usually finished. The shapes come from `seed`, the token ids
    from (seed, salt): two salts give the same lengths and prefixes that share nothing."""
    shape = np.random.default_rng(seed)
    ids = np.random.default_rng([seed, salt])

    def draw(n: int) -> list[int]:
        return ids.integers(1000, 40000, n).tolist()

    systems = [draw(system_len) for _ in range(tenants)]
    convs = []
    for t in range(tenants):
        for _ in range(conversations):
            convs.append((t, [(draw(int(shape.integers(turn_len[0], turn_len[1] + 1))), draw(answer_len)) for _ in range(turns)]))
    items = []
    for k in range(turns):
        for c in shape.permutation(len(convs)):
            t, chunks = convs[c]
            history = [tok for user, answer in chunks[:k] for tok in user + answer]
            items.append(Item(systems[t] + history + chunks[k][0], answer_len))
    return items


def load(name: str, num_prompts: int | None = None, seed: int = 0, tokenizer=None) -> list[Item]:
    if name == "public":
        return public()
    if name == "sharegpt":
        return sharegpt(num_prompts or 64, seed, tokenizer)
    if name == "shared-prefix":
        return shared_prefix(num_prompts or 64, seed)
    if name == "gpu":
        return gpu(num_prompts)
    if name == "multi-tenant":
        return multi_tenant(seed=seed)
    raise ValueError(f"unknown workload {name!r}; choose from {', '.join(NAMES)}")


_TEXT = (
    "The harbour was quiet in the early morning, and the fishing boats rocked gently against "
    "the pier while gulls circled overhead. Maria walked along the sea wall, counting the "
    "lanterns that still burned from the night before, and thought about the letter in her "
    "pocket. It had arrived three days earlier, written in her grandfather's careful hand, "
    "and it asked a question she had not yet found the courage to answer. "
)
