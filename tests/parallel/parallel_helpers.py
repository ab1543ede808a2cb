"""Helpers for the tensor/pipeline-parallel tests: KV-cache sizing in blocks (the same
count on one rank and on every rank of a group, so the scheduler -- preemptions
included -- runs alike), mixed prompts, and single-rank references."""

from __future__ import annotations

import random

BLOCK = 16
NUM_BLOCKS = 20  # small enough that the mixed batch below preempts


def kv_memory(hf_config, tp: int, pp: int, blocks: int = NUM_BLOCKS, split=None) -> int:
    """kv_cache_memory (bytes per rank) that yields exactly `blocks` blocks on every rank."""
    from shoal.runtime.distributed import ParallelState
    from shoal.runtime.models.decoder import head_dim_of, stage_layers

    from shoal.runtime.models.families import spec_of
    from shoal.runtime.models.kv_groups import layer_places

    # a block holds one page per KV tensor: one per layer, fewer where sliding windows share (kv_groups.py)
    places = layer_places(spec_of(hf_config).windows)
    layers = max(len({places[i][1] for i in stage_layers(hf_config, ParallelState(pp_rank=p, pp_size=pp), split)})
                 for p in range(pp))
    if getattr(hf_config, "kv_lora_rank", None):  # DeepSeek's MLA: one latent plane, whole on every rank
        return blocks * layers * BLOCK * (hf_config.kv_lora_rank + hf_config.qk_rope_head_dim) * 4
    kv_heads = max(1, hf_config.num_key_value_heads // tp)
    return blocks * 2 * layers * BLOCK * kv_heads * head_dim_of(hf_config) * 4


def mixed_prompts(seed: int = 7, system_len: int = 40) -> list[list[int]]:
    """Prompts of very different lengths, some sharing a prefix (for the prefix cache)."""
    rng = random.Random(seed)
    system = [rng.randrange(1000, 40000) for _ in range(system_len)]
    shared = [system + [rng.randrange(1000, 40000) for _ in range(n)] for n in (3, 9, 20)]
    alone = [[rng.randrange(1000, 40000) for _ in range(n)] for n in (1, 17, 70, 120)]
    return shared + alone




MAX_NEW = 12


def greedy():
    from shoal import SamplingParams

    return SamplingParams(max_tokens=MAX_NEW, min_tokens=MAX_NEW, temperature=0.0)


def small_cache_llm(model_dir, tp: int, pp: int, batches_in_flight=None, **extra):
    """An LLM with NUM_BLOCKS KV blocks on every rank, prefix caching on, small steps."""
    from shoal import LLM
    from shoal.runtime.models.loader import load_config

    cfg = load_config(model_dir)
    return LLM(str(model_dir), tensor_parallel_size=tp, pipeline_parallel_size=pp, enable_prefix_caching=True,
               kv_cache_memory=kv_memory(cfg, tp, pp, split=extra.get("pipeline_layer_split")),
               max_num_batched_tokens=128, batches_in_flight=batches_in_flight, extra=dict(extra))


def generate(model_dir, tp: int, pp: int, prompts, batches_in_flight=None, params=None, outputs=None, **extra):
    """Greedy tokens (or `params`') and stats of one engine; checks the group shuts down cleanly.
    A list given as `outputs` receives the request outputs (logprobs and all)."""
    llm = small_cache_llm(model_dir, tp, pp, batches_in_flight, **extra)
    try:
        outs = llm.generate(prompts, params or greedy())
        tokens = [o.outputs[0].token_ids for o in outs]
        if outputs is not None:
            outputs.extend(outs)
        stats = llm.engine.stats()
        executor = llm.engine.executor
        children = list(getattr(executor, "children", []))
        if tp * pp > 1:
            assert executor.group_ready()
        held = llm.engine.kv.null_block is not None  # sliding windows' null block, held for the engine's life
        assert llm.engine.pool.num_free == llm.engine.pool.num_blocks - held
    finally:
        llm.engine.shutdown()
    for child in children:  # clean shutdown: every rank exited 0, none left behind
        assert child.poll() == 0, f"rank process {child.pid} exited {child.poll()}"
    if tp * pp > 1:
        assert not executor.group_ready()
    return tokens, stats


_references: dict = {}


def single_rank(model_dir) -> list:
    """The single-rank engine's tokens for mixed_prompts() (computed once per model)."""
    key = str(model_dir)
    if key not in _references:
        tokens, stats = generate(model_dir, 1, 1, mixed_prompts())
        assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0, stats
        _references[key] = tokens
    return _references[key]
