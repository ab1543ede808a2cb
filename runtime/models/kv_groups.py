"""Which layers share a block table: the KV-cache groups (vLLM's hybrid KV-cache manager).

Layers that attend through the same sliding window need the same tokens' KV, so they can
share one block table per sequence; full-attention layers need every token's. Groups are
of equal size, so that one KV tensor per slot holds a page of one layer of every group: a
block id belongs to one group at a time and, in each tensor, holds that group's layer of
that slot. A block then costs `group size` layer-pages, not one page in every layer, and
a sliding group's blocks that fall out of its window go back to the pool for any group.

As vLLM: the group size is the smallest count of layers of one kind (window); each kind's
layers are cut into groups of that size in layer order (the last one may be short, its
missing slots unused). A model without windows is one group of all its layers, each layer
its own slot: the cache laid out exactly as before.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KVGroup:
    window: int  # 0: full attention; else the sliding window its layers attend through
    layers: tuple[int, ...]  # global layer indices, ascending


def kv_cache_groups(windows: list[int]) -> list[KVGroup]:
    """Full-attention groups first, then the sliding ones by window."""
    kinds: dict[int, list[int]] = {}
    for layer, window in enumerate(windows):
        kinds.setdefault(window, []).append(layer)
    size = min(len(layers) for layers in kinds.values())
    return [KVGroup(window, tuple(layers[i : i + size]))
            for window, layers in sorted(kinds.items()) for i in range(0, len(layers), size)]


def layer_places(windows: list[int]) -> list[tuple[int, int]]:
    """Per layer: (its group, its slot: its index within the group, i.e. which KV tensor)."""
    places = [(0, 0)] * len(windows)
    for g, group in enumerate(kv_cache_groups(windows)):
        for slot, layer in enumerate(group.layers):
            places[layer] = (g, slot)
    return places
