"""SparseMoeBlock against transformers' own MoE blocks (Mixtral, Qwen2-MoE with its shared expert,
Qwen3-MoE) on the same random weights, float32: fused and per-expert checkpoint layouts, both kernel
backends' torch reference, and tensor parallel 2 over gloo."""

import os
import tempfile

import pytest
import torch
import torch.multiprocessing as mp

from shoal.kernels import get_ops
from shoal.runtime.distributed import ParallelState
from shoal.runtime.layers.moe import SparseMoeBlock

H = 32


def _config(model_type, norm_topk_prob=False):
    from transformers import AutoConfig

    common = dict(hidden_size=H, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, vocab_size=64)
    if model_type == "mixtral":
        return AutoConfig.for_model("mixtral", intermediate_size=24, num_local_experts=6, num_experts_per_tok=2, **common)
    extra = dict(shared_expert_intermediate_size=40) if model_type == "qwen2_moe" else {}
    return AutoConfig.for_model(model_type, moe_intermediate_size=16, num_experts=8, num_experts_per_tok=3,
                                norm_topk_prob=norm_topk_prob, **extra, **common)


def _hf_block(cfg):
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    cls = {"mixtral": MixtralSparseMoeBlock, "qwen2_moe": Qwen2MoeSparseMoeBlock, "qwen3_moe": Qwen3MoeSparseMoeBlock}
    block = cls[cfg.model_type](cfg).eval()
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.3)  # router logits spread enough that top-k differs token to token
    return block


def _per_expert(state_dict, model_type):
    """transformers' fused [E, 2I, H] / [E, H, I] tensors as the per-expert tensors checkpoints hold."""
    names = ("w1", "w3", "w2") if model_type == "mixtral" else ("gate_proj", "up_proj", "down_proj")
    out = {}
    for name, t in state_dict.items():
        if name == "experts.gate_up_proj":
            for e, (gate, up) in enumerate(zip(*t.chunk(2, dim=1))):
                out[f"experts.{e}.{names[0]}.weight"], out[f"experts.{e}.{names[1]}.weight"] = gate, up
        elif name == "experts.down_proj":
            for e, down in enumerate(t):
                out[f"experts.{e}.{names[2]}.weight"] = down
        else:
            out[name] = t
    return out


def _ours(cfg, weights, state=None, expert_parallel=False):
    block = SparseMoeBlock.from_config(cfg, state or ParallelState(), expert_parallel)
    for name, t in weights.items():
        block.load(name, t)
    return block


CASES = [("mixtral", False), ("qwen2_moe", False), ("qwen2_moe", True), ("qwen3_moe", True), ("qwen3_moe", False)]


@pytest.mark.parametrize("layout", ["per_expert", "fused"])
@pytest.mark.parametrize("model_type,norm", CASES, ids=[f"{m}-norm{int(n)}" for m, n in CASES])
def test_block_matches_transformers(model_type, norm, layout):
    torch.manual_seed(0)
    cfg = _config(model_type, norm)
    hf = _hf_block(cfg)
    sd = dict(hf.state_dict())
    ours = _ours(cfg, _per_expert(sd, model_type) if layout == "per_expert" else sd)
    x = torch.randn(3, 11, H)
    with torch.no_grad():
        want = hf(x).reshape(-1, H)
        got = ours(get_ops("torch", "cpu"), x.reshape(-1, H))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    _, ids = ours.route(x.reshape(-1, H))
    assert len(set(ids.flatten().tolist())) > cfg.num_experts_per_tok  # tokens really went to different experts


def test_bad_weights_are_refused():
    cfg = _config("qwen3_moe")
    block = SparseMoeBlock.from_config(cfg)
    with pytest.raises(ValueError, match="shape"):
        block.load("experts.0.gate_proj.weight", torch.zeros(16, H + 1))
    with pytest.raises(ValueError, match="expert 8"):
        block.load("experts.8.up_proj.weight", torch.zeros(16, H))
    with pytest.raises(ValueError, match="unexpected"):
        block.load("shared_expert_gate.weight", torch.zeros(1, H))  # Qwen3-MoE has no shared expert
    with pytest.raises(ValueError, match="silu"):
        SparseMoeBlock.from_config(_config("mixtral").__class__(**{**_config("mixtral").to_dict(), "hidden_act": "gelu"}))


@pytest.mark.parametrize("expert_parallel", [False, True], ids=["sliced", "expert_parallel"])
@pytest.mark.parametrize("layout", ["per_expert", "fused"])
def test_rank_shards_sum_to_the_whole(layout, expert_parallel):
    """The experts' partial sums of 4 ranks (before the block's all-reduce), each loading only its
    shard of the same checkpoint, add up to one rank's output."""
    torch.manual_seed(2)
    cfg = _config("qwen3_moe", True)
    hf = _hf_block(cfg)
    sd = dict(hf.state_dict())
    weights = _per_expert(sd, "qwen3_moe") if layout == "per_expert" else sd
    whole = _ours(cfg, weights)
    x = torch.randn(9, H)
    ops = get_ops("torch", "cpu")
    with torch.no_grad():
        want = whole.experts(ops, x, *whole.route(x))
        parts = [_ours(cfg, weights, ParallelState(tp_rank=r, tp_size=4), expert_parallel) for r in range(4)]
        got = sum(p.experts(ops, x, *p.route(x)) for p in parts)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------- tensor parallel 2 (gloo)


def _tp_rank(rank, init_file, cfg, weights, x, expert_parallel, results):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        torch.set_num_threads(1)
        state = ParallelState(tp_rank=rank, tp_size=2, tp_group=dist.group.WORLD)
        block = _ours(cfg, weights, state, expert_parallel)
        e, i = block.experts.w13.shape[:2]
        n = block.experts.num_experts
        assert (e, i) == ((n // 2, 2 * block.experts.intermediate) if expert_parallel else (n, block.experts.intermediate))
        with torch.no_grad():
            # by value: a tensor would be sent as a handle to this process's memory, gone once it exits
            results.put((rank, block(get_ops("torch", "cpu"), x).numpy().copy()))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("model_type,expert_parallel", [("mixtral", False), ("qwen2_moe", False), ("qwen3_moe", True)])
def test_tensor_parallel_2_matches_transformers(model_type, expert_parallel):
    """Each rank holds half of every expert (or, expert parallel, half of the experts whole)."""
    torch.manual_seed(1)
    cfg = _config(model_type, True)
    hf = _hf_block(cfg)
    weights = _per_expert(dict(hf.state_dict()), model_type)
    x = torch.randn(1, 13, H)
    with torch.no_grad():
        want = hf(x).reshape(-1, H)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=_tp_rank, args=(r, os.path.join(tmp, "init"), cfg, weights, x.reshape(-1, H),
                                                     expert_parallel, results))
                 for r in range(2)]
        for p in procs:
            p.start()
        got = dict(results.get(timeout=300) for _ in procs)
        for p in procs:
            p.join(timeout=60)
    assert all(p.exitcode == 0 for p in procs)
    for rank in range(2):  # after the one all-reduce every rank holds the whole output
        torch.testing.assert_close(torch.from_numpy(got[rank]), want, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------- gpt-oss


def _gpt_oss():
    """transformers' GptOssMLP (biased router, top-k softmax, biased clamped-SwiGLU experts)
    with every weight and bias random and gate/up values past the clamp."""
    from transformers import AutoConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

    cfg = AutoConfig.for_model("gpt_oss", hidden_size=H, intermediate_size=16, num_local_experts=8, num_experts_per_tok=3,
                               num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                               vocab_size=64)
    block = GptOssMLP(cfg).eval()
    with torch.no_grad():
        for name, p in block.named_parameters():
            p.normal_(0, 2.0 if name == "experts.gate_up_proj" else 0.5)
    return cfg, block


def test_gpt_oss_block_matches_transformers():
    torch.manual_seed(3)
    cfg, hf = _gpt_oss()
    ours = _ours(cfg, dict(hf.state_dict()))
    x = torch.randn(2, 11, H)
    with torch.no_grad():
        want = hf(x)[0].reshape(-1, H)
        got = ours(get_ops("torch", "cpu"), x.reshape(-1, H))
        gate_up = x.reshape(-1, H) @ hf.experts.gate_up_proj[0]
    assert (gate_up.abs() > cfg.swiglu_limit).any()  # the clamp bites
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    _, ids = ours.route(x.reshape(-1, H))
    assert len(set(ids.flatten().tolist())) > cfg.num_experts_per_tok


@pytest.mark.parametrize("expert_parallel", [False, True], ids=["sliced", "expert_parallel"])
def test_gpt_oss_rank_shards_sum_to_the_whole(expert_parallel):
    """Biases across ranks: gate/up biases sliced with their rows, each down bias added once (rank
    0's when every rank holds a slice of each expert; the owner's when experts are whole)."""
    torch.manual_seed(4)
    cfg, hf = _gpt_oss()
    weights = dict(hf.state_dict())
    whole = _ours(cfg, weights)
    x = torch.randn(9, H)
    ops = get_ops("torch", "cpu")
    with torch.no_grad():
        want = whole.experts(ops, x, *whole.route(x))
        parts = [_ours(cfg, weights, ParallelState(tp_rank=r, tp_size=4), expert_parallel) for r in range(4)]
        got = sum(p.experts(ops, x, *p.route(x)) for p in parts)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_gpt_oss_bad_weights_are_refused():
    cfg, hf = _gpt_oss()
    block = SparseMoeBlock.from_config(cfg)
    E, I = cfg.num_local_experts, cfg.intermediate_size
    with pytest.raises(ValueError, match="shape"):
        block.load("experts.gate_up_proj", torch.zeros(E, H, 2 * I + 2))
    with pytest.raises(ValueError, match="unexpected"):
        block.load("experts.0.gate_proj.weight", torch.zeros(I, H))
    block.load("experts.down_proj_blocks", torch.zeros(E, H, I // 32, 16, dtype=torch.uint8))
    with pytest.raises(ValueError, match="other half"):
        block.experts.check_loaded()
    with pytest.raises(ValueError, match="do not match"):
        block.load("experts.down_proj_scales", torch.zeros(E, H, 2, dtype=torch.uint8))
