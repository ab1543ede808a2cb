"""LoRA at tensor parallel 2: each rank keeps its shard of every adapter (A and B split like
the layers they modify), and a mixed batch gives transformers + PEFT's tokens row by row."""

from __future__ import annotations

from shoal import LLM, SamplingParams
from engine_helpers import lora_prompts, lora_references, make_lora_models

MAX_NEW = 8


def test_tp2_mixed_batch_matches_transformers_and_peft(tmp_path_factory, builtin_dir):
    base, adapters = make_lora_models(tmp_path_factory.mktemp("lora-tp"), builtin_dir, count=3)
    prompts = lora_prompts()
    references = lora_references(base, adapters, prompts, MAX_NEW)
    greedy = SamplingParams(max_tokens=MAX_NEW, min_tokens=MAX_NEW, temperature=0.0)
    rows = [(None, 0), ("a0", 1), ("a1", 2), ("a2", 0), ("a2", 1), ("a0", 2), (None, 1)]
    # two slots for three adapters: the slot writes reach both ranks between steps
    llm = LLM(str(base), tensor_parallel_size=2, enable_lora=True, max_loras=2, max_lora_rank=16, kv_cache_memory=2**23,
              lora_modules=[f"{name}={path}" for name, path in adapters.items()])
    try:
        outs = llm.generate([prompts[p] for _, p in rows], greedy, lora=[name for name, _ in rows])
        assert [o.outputs[0].token_ids for o in outs] == [references[name][p] for name, p in rows]
        assert llm.engine.lora.num_loads >= 3
    finally:
        llm.engine.shutdown()
