"""LoRA adapters served unmerged: each adapter's greedy tokens equal transformers + PEFT's, and
a batch mixing the base model and several adapters gives each row what it gets alone."""

from __future__ import annotations

import random

import pytest

from shoal import LLM, SamplingParams
from engine_helpers import ADAPTER_SHAPES, make_peft_adapter, make_tiny_model, peft_greedy

MAX_NEW = 10
GREEDY = SamplingParams(max_tokens=MAX_NEW, min_tokens=MAX_NEW, temperature=0.0)


@pytest.fixture(scope="module")
def lora_models(tmp_path_factory, builtin_dir):
    """A tiny random base model and three random adapters made with PEFT."""
    root = tmp_path_factory.mktemp("lora")
    base = make_tiny_model(root / "base", builtin_dir)
    adapters = {f"a{i}": make_peft_adapter(base, root / f"a{i}", seed=i, **shape) for i, shape in enumerate(ADAPTER_SHAPES)}
    return base, adapters


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(3)
    return [[rng.randrange(3, 49152) for _ in range(n)] for n in (5, 23, 40)]


@pytest.fixture(scope="module")
def references(lora_models, prompts):
    base, adapters = lora_models
    refs = {None: peft_greedy(base, None, prompts, MAX_NEW)}
    refs.update({name: peft_greedy(base, path, prompts, MAX_NEW) for name, path in adapters.items()})
    return refs


@pytest.fixture(scope="module")
def llm(lora_models):
    base, adapters = lora_models
    engine = LLM(str(base), enable_lora=True, max_loras=4, max_lora_rank=16, kv_cache_memory=2**24,
                 lora_modules=[f"{name}={path}" for name, path in adapters.items()])
    yield engine
    engine.engine.shutdown()


def tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


def test_each_adapter_matches_transformers_and_peft(llm, prompts, references):
    for name in (None, "a0", "a1", "a2"):
        assert tokens(llm.generate(prompts, GREEDY, lora=name)) == references[name], name
    # the adapters change the tokens: a test of them can fail
    assert all(references[name] != references[None] for name in ("a0", "a1", "a2"))


def test_mixed_batch_gives_each_row_what_it_gets_alone(llm, prompts, references):
    """Base rows, three adapters and two rows of one adapter in one batch (one step each)."""
    rows = [(None, 0), ("a0", 1), ("a1", 2), ("a2", 0), ("a2", 1), (None, 2), ("a1", 0)]
    outs = llm.generate([prompts[p] for _, p in rows], GREEDY, lora=[name for name, _ in rows])
    assert tokens(outs) == [references[name][p] for name, p in rows]


def test_adapters_never_share_prefix_cache_blocks(llm, references):
    """The same long prompt under the base model then an adapter: the adapter's request finds
    no cached block (its hashes start from its own root) and still gives its own tokens."""
    rng = random.Random(9)
    prompt = [rng.randrange(3, 49152) for _ in range(70)]
    engine = llm.engine
    base_tokens = tokens(llm.generate([prompt], GREEDY))
    hits = engine.kv.prefix_hits
    with_adapter = tokens(llm.generate([prompt], GREEDY, lora="a2"))
    assert engine.kv.prefix_hits == hits
    again = tokens(llm.generate([prompt], GREEDY, lora="a2"))
    assert engine.kv.prefix_hits > hits  # the adapter's own blocks are reused
    assert again == with_adapter != base_tokens


def test_unknown_adapter_is_refused(llm):
    from shoal.runtime.engine.lora_manager import LoraError

    with pytest.raises(LoraError, match="no adapter named 'nope'") as e:
        llm.generate([[5, 6, 7]], GREEDY, lora="nope")
    assert e.value.status == 404
