"""LoRA adapters: the registry (name -> PEFT directory), the device slots, and the host copies.

An adapter is read from a PEFT directory (adapter_config.json + adapter_model.safetensors),
checked against the model (targets, shapes, rank) and kept on the host as, per layer and
fused module, each projection's (A, B) with the scaling folded into B. The device holds at
most `max_loras` adapters (slots); the scheduler acquires a slot when it admits a request
and releases it when the sequence leaves the running batch. A slot no running sequence uses
may be reloaded, least recently used first; a request whose adapter finds no free slot
waits. At most `max_cpu_loras` adapters keep their tensors on the host, least recently used
dropped first (read again from disk when next needed).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import torch

# a PEFT target -> (the decoder's fused module, which projection of it)
TARGETS = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2), "o_proj": ("o_proj", 0),
           "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1), "down_proj": ("down_proj", 0)}
NUM_PROJ = {"qkv_proj": 3, "o_proj": 1, "gate_up_proj": 2, "down_proj": 1}
_MODULE = re.compile(r"(\w+)\.(?:base_layer|lora_\w+)")  # the module a stored tensor belongs to
_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


class LoraError(ValueError):
    """A bad adapter or request for one; `status` is the HTTP status it deserves."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


@dataclass(eq=False)
class LoraAdapter:
    name: str
    path: str
    id: int
    rank: int
    base_model_name: str | None = None
    weights: dict | None = field(default=None, repr=False)  # {(layer, module): [(A, B) | None per projection]}
    num_requests: int = 0  # requests it served (a Prometheus counter)
    active: int = 0  # its requests in the engine now
    removed: bool = False

    @property
    def cache_salt(self) -> int:
        """The root of its sequences' prefix-cache hashes: two adapters never share KV."""
        digest = hashlib.sha256(f"lora:{self.id}:{self.name}".encode()).digest()
        return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def _shapes(cfg) -> dict[str, tuple[int, int]]:
    """(in, out) features of each PEFT target of the model."""
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    q, kv = cfg.num_attention_heads * head_dim, cfg.num_key_value_heads * head_dim
    h, i = cfg.hidden_size, cfg.intermediate_size
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}


def read_peft(path: str, cfg, max_rank: int) -> tuple[int, dict]:
    """(rank, weights) of the PEFT adapter at `path`, checked against the model; LoraError if unfit."""
    root = Path(path)
    config_file, tensors_file = root / "adapter_config.json", root / "adapter_model.safetensors"
    if not config_file.is_file() or not tensors_file.is_file():
        raise LoraError(f"no PEFT adapter at {path!r} (adapter_config.json and adapter_model.safetensors)", 404)
    try:
        conf = json.loads(config_file.read_text())
        from safetensors.torch import load_file

        tensors = load_file(str(tensors_file))
    except Exception as e:
        raise LoraError(f"cannot read the adapter at {path!r}: {e}") from e
    if conf.get("peft_type", "LORA") != "LORA":
        raise LoraError(f"adapter {path!r} is {conf.get('peft_type')}, not LoRA")
    for key, why in (("use_dora", "DoRA"), ("modules_to_save", "modules_to_save"), ("alpha_pattern", "alpha_pattern")):
        if conf.get(key):
            raise LoraError(f"adapter {path!r} uses {why}, which is not supported")
    if conf.get("bias", "none") != "none":
        raise LoraError(f"adapter {path!r} trains biases (bias={conf['bias']!r}), which is not supported")
    alpha, rslora = float(conf.get("lora_alpha", conf.get("r", 8))), bool(conf.get("use_rslora"))
    shapes, layers = _shapes(cfg), cfg.num_hidden_layers
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        m = _KEY.search(key)
        if m is None or m.group(2) not in TARGETS:
            named = _MODULE.search(key)
            module = m.group(2) if m else named.group(1) if named else key
            raise LoraError(f"adapter {path!r} targets {module!r}, which this model has no LoRA for "
                            f"(supported: {', '.join(TARGETS)})")
        layer, target = int(m.group(1)), m.group(2)
        if layer >= layers:
            raise LoraError(f"adapter {path!r} targets layer {layer}; the model has {layers}")
        pairs.setdefault((layer, target), {})[m.group(3)] = tensor.float()
    if not pairs:
        raise LoraError(f"adapter {path!r} holds no LoRA weights")
    weights: dict[tuple[int, str], list] = {}
    rank = 0
    for (layer, target), ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            raise LoraError(f"adapter {path!r}: layer {layer} {target} lacks lora_{'B' if 'A' in ab else 'A'}")
        A, B = ab["A"], ab["B"]
        r, (fan_in, fan_out) = A.shape[0], shapes[target]
        if A.shape != (r, fan_in) or B.shape != (fan_out, r):
            raise LoraError(f"adapter {path!r}: layer {layer} {target} has A {tuple(A.shape)} and B {tuple(B.shape)}; "
                            f"the model needs A [r, {fan_in}] and B [{fan_out}, r]")
        if r > max_rank:
            raise LoraError(f"adapter {path!r} has rank {r}, over --max-lora-rank {max_rank}")
        rank = max(rank, r)
        scale = alpha / math.sqrt(r) if rslora else alpha / r
        module, proj = TARGETS[target]
        weights.setdefault((layer, module), [None] * NUM_PROJ[module])[proj] = (A.contiguous(), (B * scale).contiguous())
    return rank, weights


class LoraManager:
    def __init__(self, hf_config, max_loras: int, max_rank: int, max_cpu_loras: int | None = None):
        if max_loras < 1 or max_rank < 1:
            raise ValueError("max_loras and max_lora_rank must be >= 1")
        self.cfg, self.max_rank = hf_config, max_rank
        self.max_cpu_loras = max(max_cpu_loras or max_loras, max_loras)
        self.adapters: dict[str, LoraAdapter] = {}
        self.slots: list[LoraAdapter | None] = [None] * max_loras
        self.refs = [0] * max_loras  # running sequences using each slot
        self.last_used = [0] * max_loras
        self.tick = 0
        self.host: OrderedDict[LoraAdapter, None] = OrderedDict()  # adapters with host tensors, LRU first
        self.loads: list[tuple[int, dict | None]] = []  # slot writes the device has yet to make
        self.num_loads = 0  # adapters written into a slot (swaps)
        self._ids = 0

    @property
    def max_loras(self) -> int:
        return len(self.slots)

    def add(self, name: str, path: str, base_model_name: str | None = None) -> LoraAdapter:
        if not name:
            raise LoraError("an adapter needs a name")
        if name in self.adapters:
            raise LoraError(f"an adapter named {name!r} is already loaded", 400)
        rank, weights = read_peft(path, self.cfg, self.max_rank)
        self._ids += 1
        adapter = LoraAdapter(name, str(path), self._ids, rank, base_model_name, weights)
        self.adapters[name] = adapter
        self._keep(adapter)
        return adapter

    def read(self, path: str) -> dict:
        """Read and check an adapter without registering it."""
        return read_peft(path, self.cfg, self.max_rank)[1]

    def remove(self, name: str) -> LoraAdapter:
        """Unregister it: new requests cannot name it; those in the engine finish with it."""
        adapter = self.adapters.pop(name, None)
        if adapter is None:
            raise LoraError(f"no adapter named {name!r} is loaded", 404)
        adapter.removed = True
        self.host.pop(adapter, None)  # kept off the LRU: its requests may still need it
        if not adapter.active:
            adapter.weights = None
        return adapter

    def get(self, name: str) -> LoraAdapter:
        adapter = self.adapters.get(name)
        if adapter is None:
            raise LoraError(f"no adapter named {name!r} is loaded", 404)
        return adapter

    def started(self, adapter: LoraAdapter) -> None:
        adapter.active += 1
        adapter.num_requests += 1

    def ended(self, adapter: LoraAdapter) -> None:
        adapter.active -= 1
        if adapter.removed and not adapter.active:
            adapter.weights = None

    def acquire(self, adapter: LoraAdapter) -> int | None:
        """Its slot, loading it into a free one if needed; None: every slot is in use."""
        self.tick += 1
        if adapter in self.slots:
            slot = self.slots.index(adapter)
        else:
            free = [s for s in range(self.max_loras) if self.refs[s] == 0]
            if not free:
                return None
            # an empty slot, else one whose adapter was removed, else the least recently used
            slot = min(free, key=lambda s: (self.slots[s] is not None, not (self.slots[s] and self.slots[s].removed),
                                            self.last_used[s]))
            self.slots[slot] = adapter
            self.loads.append((slot, self._weights(adapter)))
            self.num_loads += 1
        self.refs[slot] += 1
        self.last_used[slot] = self.tick
        return slot

    def release(self, slot: int) -> None:
        self.refs[slot] -= 1

    def take_loads(self) -> list[tuple[int, dict | None]]:
        loads, self.loads = self.loads, []
        return loads

    def _weights(self, adapter: LoraAdapter) -> dict:
        if adapter.weights is None:  # dropped from the host: read it again
            adapter.weights = read_peft(adapter.path, self.cfg, self.max_rank)[1]
        if not adapter.removed:
            self._keep(adapter)
        return adapter.weights

    def _keep(self, adapter: LoraAdapter) -> None:
        self.host[adapter] = None
        self.host.move_to_end(adapter)
        while len(self.host) > self.max_cpu_loras:
            old, _ = self.host.popitem(last=False)
            old.weights = None

    def running(self) -> list[str]:
        """Names of the adapters running sequences use now."""
        return [a.name for a, n in zip(self.slots, self.refs) if a is not None and n]
