"""Which backend gets a request: pure functions of the backends' last polled state.

    score(b) = prefix_weight x matched(b) - load_weight x load(b)
    matched  = the fraction of the prompt's full blocks, from the first, that b holds
    load     = max(p / (p + 8), kv_usage),  p = waiting + running + in flight from this router

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


def rank(views: list[View], hashes: list[int], prefix_weight: float = 1.0, load_weight: float = 1.0) -> list[Ranked]:
    """Ready backends, best first (score, then less load, then name for a stable order)."""
    out = []
    for v in views:
        if not v.ready:
            continue
        m, ld = matched(v, hashes), load(v)
        out.append(Ranked(v, prefix_weight * m - load_weight * ld, m, ld))
    out.sort(key=lambda r: (-r.score, r.load, r.view.name))
    return out


def reason(ranked: list[Ranked]) -> str:
    """Why the first won: 'prefix' when it holds more of the prompt than another ready
    backend (the cache term set them apart), else 'load'."""
    if not ranked:
        return "none"
    best = ranked[0]
    return "prefix" if best.matched > 0 and any(r.matched < best.matched for r in ranked[1:]) else "load"
