"""Which backend gets a request: pure functions of the backends' last polled state.

    score(b) = prefix_weight x matched(b) - load_weight x load(b) + lora_weight x lora(b)
    matched  = the fraction of the prompt's full blocks, from the first, that b holds
    load     = max(p / (p + 8), kv_usage),  p = waiting + running + in flight from this router
    lora     = 1 when the request names a LoRA adapter b holds in a device slot, else 0

The best score goes first, ties to the less loaded; the ranking is also the retry order.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

LOAD_HALF = 8  # requests at which the queue term reaches 0.5


@dataclass
class View:
    """What the picker sees of one backend."""

    name: str
    ready: bool = True
    running: int = 0
    waiting: int = 0
    in_flight: int = 0
    kv_usage: float = 0.0
    has: Callable[[int], bool] = field(default=lambda h: False)  # does it hold this block hash?
    adapters: frozenset = frozenset()  # LoRA adapters in its device slots


def load(v: View) -> float:
    p = max(0, v.waiting) + max(0, v.running) + max(0, v.in_flight)
    return max(p / (p + LOAD_HALF), min(1.0, max(0.0, v.kv_usage)))


def matched(v: View, hashes: list[int]) -> float:
    """The fraction of the chain held, counting from the first block (a prefix, as the cache reuses)."""
    if not hashes:
        return 0.0
    n = 0
    for h in hashes:
        if not v.has(h):
            break
        n += 1
    return n / len(hashes)


@dataclass
class Ranked:
    view: View
    score: float
    matched: float
    load: float
    lora: bool = False  # it holds the request's adapter


def rank(views: list[View], hashes: list[int], prefix_weight: float = 1.0, load_weight: float = 1.0,
         adapter: str | None = None, lora_weight: float = 1.0) -> list[Ranked]:
    """Ready backends, best first (score, then less load, then name for a stable order).
    `adapter`: the request's model, a LoRA adapter's name or the base model's (held by none)."""
    out = []
    for v in views:
        if not v.ready:
            continue
        m, ld = matched(v, hashes), load(v)
        holds = adapter is not None and adapter in v.adapters
        out.append(Ranked(v, prefix_weight * m - load_weight * ld + lora_weight * holds, m, ld, holds))
    out.sort(key=lambda r: (-r.score, r.load, r.view.name))
    return out


def reason(ranked: list[Ranked]) -> str:
    """Why the first won: 'lora' when it holds the request's adapter and another ready backend
    does not; 'prefix' when it holds more of the prompt than another (the cache term set them
    apart); else 'load'."""
    if not ranked:
        return "none"
    best = ranked[0]
    if best.lora and any(not r.lora for r in ranked[1:]):
        return "lora"
    return "prefix" if best.matched > 0 and any(r.matched < best.matched for r in ranked[1:]) else "load"
