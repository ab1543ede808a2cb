"""Sparse mixture-of-experts blocks (Mixtral, Qwen2-MoE, Qwen3-MoE, gpt-oss, DeepSeek-V2/V3) over ops.fused_moe.

A router (softmax over the experts, top-k, optionally renormalised; gpt-oss: a biased router,
top-k of the logits, softmax over those k; DeepSeek's grouped top-k: grouped_topk) picks each token's experts;
the experts run as one fused grouped GEMM per projection (kernels/: reference.fused_moe and
the Triton fused_moe), never a loop over experts. Tensor parallel: every rank holds each
expert's slice of the intermediate dimension (as MergedColumnLinear/RowLinear split a dense
MLP), the router is replicated, and the block ends in one all-reduce (the shared expert's
partial sum joins the experts' before it).

Checkpoint names, relative to the block (`block_sparse_moe.` in Mixtral, `mlp.` in Qwen):
  gate.weight                                   router [E, H]
  experts.N.{w1,w3,w2}.weight                   Mixtral: gate, up, down of expert N
  experts.N.{gate,up,down}_proj.weight          Qwen2/3-MoE (what save_pretrained writes)
  experts.gate_up_proj [E, 2I, H], experts.down_proj [E, H, I]   transformers' fused in-memory layout
  shared_expert.{gate,up,down}_proj.weight, shared_expert_gate.weight   Qwen2-MoE
  router.{weight,bias}                          gpt-oss's router [E, H], [E]
  experts.gate_up_proj [E, H, 2I], experts.gate_up_proj_bias [E, 2I]   gpt-oss: gate and up
      interleaved along 2I (gate at even columns), transposed to (in, out)
  experts.down_proj [E, I, H], experts.down_proj_bias [E, H]           gpt-oss
  experts.{gate_up,down}_proj_{blocks,scales}   gpt-oss's MXFP4 form of the two (dequantized at load)
  shared_experts.{gate,up,down}_proj.weight, gate.e_score_correction_bias   DeepSeek (no shared gate; V3's bias)
  experts.N.{gate,up,down}_proj.{weight_scale,input_scale}   FP8 experts (quantization/fp8.py's Fp8Experts)
  experts.N.{gate,up,down}_proj.{qweight,qzeros,scales,...}   int4 experts, the format's dense names (int4.py)

Quantized experts: the checkpoint's format gives the experts the LinearMethod a dense layer
would get (`method_for("....experts")`); FP8 W8A8 (and --quantization fp8) and the int4
formats (AWQ, GPTQ, compressed-tensors W4A16: quantization/int4.py's Int4Experts) are held,
any other quantized format is refused at load.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from shoal.runtime.distributed import SINGLE, ParallelState, shard_range, tp_all_reduce
from shoal.runtime.layers.linear import MergedColumnLinear, PlainLinear, RowLinear, kept

_GATE, _UP, _DOWN = 0, 1, 2
_EXPERT_LEAVES = {"w1": _GATE, "w3": _UP, "w2": _DOWN, "gate_proj": _GATE, "up_proj": _UP, "down_proj": _DOWN}


def _param(*shape) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


@dataclass
class GroupedRouting:
    """DeepSeek's router, as transformers computes it (in float32): scores over every expert
    (V2 softmax, V3 sigmoid), the experts split into n_group groups of which only the
    topk_group best are eligible (a group's score: V2 its best expert, V3 the sum of its best
    two after adding e_score_correction_bias), top-k among the eligible, the weights taken from
    the uncorrected scores, optionally renormalised, times routed_scaling_factor."""

    scoring: str = "softmax"  # "softmax" (V2) or "sigmoid" (V3)
    n_group: int = 1  # 1: plain top-k over every expert (V2's "greedy")
    topk_group: int = 1
    correction_bias: bool = False  # V3: e_score_correction_bias steers the choice, not the weights
    renormalize: bool = False
    scale: float = 1.0  # routed_scaling_factor


def grouped_topk(logits, top_k: int, routing: GroupedRouting, bias=None):
    """logits [T, E] float32 -> (weights [T, k] float32, ids [T, k])."""
    T, E = logits.shape
    scores = logits.sigmoid() if routing.scoring == "sigmoid" else logits.softmax(dim=-1)
    choice = scores + bias if bias is not None else scores
    if routing.n_group > 1:
        grouped = choice.view(T, routing.n_group, E // routing.n_group)
        group_scores = grouped.topk(2, dim=-1)[0].sum(-1) if routing.correction_bias else grouped.amax(-1)
        best = group_scores.topk(routing.topk_group, dim=-1, sorted=False)[1]
        eligible = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
        eligible = eligible[:, :, None].expand(-1, -1, E // routing.n_group).reshape(T, E)
        # V3 masks with -inf; V2 with 0 (its scores are positive, so the same experts win)
        choice = choice.masked_fill(~eligible, float("-inf") if routing.correction_bias else 0.0)
    ids = choice.topk(top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, ids)
    if routing.renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * routing.scale, ids


class FusedMoE(nn.Module):
    """Gated experts as two stacked weights: w13 [E_local, 2*I_local, H] (each expert's gate
    rows, then its up rows) and w2 [E_local, H, I_local]. Over tensor-parallel ranks each holds
    every expert's slice of I, or (expert_parallel) a run of whole experts, the pairs routed to
    the others' skipped. forward returns this rank's partial sum.

    gpt-oss (`oai`: its checkpoint layout, biases, the clamped SwiGLU with `swiglu` = (alpha,
    limit)): w13_bias [E_local, 2*I_local] as w13's rows, w2_bias [E_local, H] held by the rank
    that owns the expert's output (rank 0 when every rank holds a slice of each expert).

    `method`: the checkpoint's format for the experts (module docstring); FP8 keeps w13/w2 in
    float8 with w13_scale [E_local, 2*I_local] and w2_scale [E_local, H] (set in finish)."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int, state: ParallelState = SINGLE,
                 expert_parallel: bool = False, oai: bool = False, swiglu: tuple[float, float] = (1.702, 7.0),
                 method=None):
        super().__init__()
        self.num_experts, self.hidden, self.intermediate = num_experts, hidden, intermediate
        if expert_parallel:
            self.first_expert, last = shard_range(num_experts, state)
            self.start, self.local = 0, intermediate
        else:
            self.first_expert, last = 0, num_experts
            self.start, end = shard_range(intermediate, state)
            self.local = end - self.start
        self.w13 = _param(last - self.first_expert, 2 * self.local, hidden)
        self.w2 = _param(last - self.first_expert, hidden, self.local)
        self.oai, self.swiglu = oai, swiglu
        self.w13_bias = self.w2_bias = None
        self._mxfp4 = {}  # blocks or scales waiting for their other half
        if oai:
            self.w13_bias = _param(last - self.first_expert, 2 * self.local)
            self.w2_bias = _param(last - self.first_expert, hidden)
            self.w2_bias.data.zero_()
            self.owns_down_bias = expert_parallel or state.tp_rank == 0
        self.quant = None
        self.w13_scale = self.w2_scale = self.a13_scale = self.a2_scale = None
        self.num_local = last - self.first_expert
        if method is not None and not isinstance(method, PlainLinear):
            from shoal.runtime.layers.quantization.fp8 import Fp8Experts, Fp8Linear
            from shoal.runtime.layers.quantization.int4 import Int4Experts, Int4Linear

            if not isinstance(method, (Fp8Linear, Int4Linear)) or oai:
                raise ValueError(f"mixture-of-experts experts quantized as {type(method).__name__}"
                                 f"{' (gpt-oss)' if oai else ''} are not supported: only FP8 W8A8 and int4 experts are")
            self.quant = (Fp8Experts if isinstance(method, Fp8Linear) else Int4Experts)(method, self)

    def _load_oai(self, name: str, tensor: torch.Tensor) -> None:
        """gpt-oss's fused tensors (module docstring): gate/up de-interleaved into w13's halves."""
        s, n, I, H, E = self.start, self.local, self.intermediate, self.hidden, self.num_experts
        if name.endswith(("_blocks", "_scales")):
            base, kind = name.rsplit("_", 1)
            self._mxfp4[(base, kind)] = tensor
            other = self._mxfp4.get((base, "scales" if kind == "blocks" else "blocks"))
            if other is None:
                return
            blocks, scales = (tensor, other) if kind == "blocks" else (other, tensor)
            del self._mxfp4[(base, "blocks")], self._mxfp4[(base, "scales")]
            weight = dequantize_mxfp4(blocks, scales)  # [E, out, in]: the (out, in) orientation already
            name, tensor = base, weight.transpose(1, 2)  # as the unquantized checkpoint stores it
        want = {"gate_up_proj": (E, H, 2 * I), "gate_up_proj_bias": (E, 2 * I), "down_proj": (E, I, H),
                "down_proj_bias": (E, H)}
        if name not in want:
            raise ValueError(f"unexpected expert weight {name!r}")
        _check_shape(name, tensor, want[name])
        tensor = tensor[self.first_expert : self.first_expert + self.num_local]
        if name == "gate_up_proj":
            gate, up = tensor[..., 0::2].transpose(1, 2), tensor[..., 1::2].transpose(1, 2)  # [E, I, H] each
            self.w13.data[:, :n].copy_(gate[:, s : s + n])
            self.w13.data[:, n:].copy_(up[:, s : s + n])
        elif name == "gate_up_proj_bias":
            self.w13_bias.data[:, :n].copy_(tensor[:, 0::2][:, s : s + n])
            self.w13_bias.data[:, n:].copy_(tensor[:, 1::2][:, s : s + n])
        elif name == "down_proj":
            self.w2.data.copy_(tensor.transpose(1, 2)[:, :, s : s + n])
        elif self.owns_down_bias:
            self.w2_bias.data.copy_(tensor)

    def finish(self, dtype) -> None:
        """After the model's dtype cast (layers/linear.py's cast_and_finish): the fp8 scales, the
        int4 experts' repacking."""
        if self.quant is not None:
            self.quant.finish(self, dtype)

    def check_loaded(self) -> None:
        if self._mxfp4:
            raise ValueError(f"MXFP4 expert weights without their other half: {sorted(self._mxfp4)}")

    def load(self, name: str, tensor: torch.Tensor) -> None:
        """`name` relative to the experts: "N.w1.weight", "N.gate_proj.weight", "gate_up_proj", ..."""
        s, n, I = self.start, self.local, self.intermediate
        if self.oai:
            return self._load_oai(name, tensor)
        if name in ("gate_up_proj", "down_proj"):  # every expert at once
            if self.quant is not None and self.quant.serialized:
                raise ValueError(f"quantized experts stored fused ({name!r}) are not supported: one tensor per expert")
            want = (self.num_experts, 2 * I, self.hidden) if name == "gate_up_proj" else (self.num_experts, self.hidden, I)
            _check_shape(name, tensor, want)
            tensor = tensor[self.first_expert : self.first_expert + self.num_local]
            if name == "gate_up_proj":
                self.w13.data[:, :n].copy_(tensor[:, s : s + n])
                self.w13.data[:, n:].copy_(tensor[:, I + s : I + s + n])
            else:
                self.w2.data.copy_(tensor[:, :, s : s + n])
            return
        parts = name.split(".")
        if len(parts) != 3 or not parts[0].isdigit() or parts[1] not in _EXPERT_LEAVES:
            raise ValueError(f"unexpected expert weight {name!r}")
        e, which = int(parts[0]), _EXPERT_LEAVES[parts[1]]
        if e >= self.num_experts:
            raise ValueError(f"expert {e} in the checkpoint, but the config has {self.num_experts}")
        local = e - self.first_expert
        mine = 0 <= local < self.num_local
        if parts[2] != "weight":
            if self.quant is None:
                raise ValueError(f"unexpected expert weight {name!r}")
            return self.quant.load(self, e, local if mine else None, which, parts[2], tensor)
        if not mine:
            return  # another rank's expert
        e = local
        if which == _DOWN:
            _check_shape(name, tensor, (self.hidden, I))
            self.w2.data[e].copy_(tensor[:, s : s + n])
        else:
            _check_shape(name, tensor, (I, self.hidden))
            self.w13.data[e, which * n : (which + 1) * n].copy_(tensor[s : s + n])

    def forward(self, ops, x, topk_weights, topk_ids):
        if self.first_expert:  # ids of this rank's experts from 0; the others' fall outside and add nothing
            topk_ids = topk_ids - self.first_expert
        if self.oai:
            alpha, limit = self.swiglu
            return ops.fused_moe(x, self.w13, self.w2, topk_weights, topk_ids, self.w13_bias, self.w2_bias,
                                 activation="swiglu_oai", alpha=alpha, limit=limit)
        if hasattr(self.quant, "fused_moe_args"):  # int4 experts
            w13, w2, w13_int4, w2_int4 = self.quant.fused_moe_args(self)
            return ops.fused_moe(x, w13, w2, topk_weights, topk_ids, w13_int4=w13_int4, w2_int4=w2_int4)
        if self.w13_scale is not None:
            return ops.fused_moe(x, self.w13, self.w2, topk_weights, topk_ids, w13_scale=self.w13_scale,
                                 w2_scale=self.w2_scale, a13_scale=self.a13_scale, a2_scale=self.a2_scale)
        return ops.fused_moe(x, self.w13, self.w2, topk_weights, topk_ids)


# MXFP4 (OCP microscaling): 4-bit e2m1 values two to a byte (low nibble first), one power-of-two
# scale (e8m0, bias 127) per 32 values along the input features
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """blocks [..., G, 16] uint8 and scales [..., G] uint8 -> float32 [..., G * 32]."""
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != 16:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} do not match scales {tuple(scales.shape)}")
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32)
    b = blocks.to(torch.uint8).long()
    values = torch.stack((lut[b & 0x0F], lut[b >> 4]), dim=-1).flatten(-2)  # [..., G, 32]
    values = torch.ldexp(values, (scales.to(torch.int32) - 127)[..., None])
    return values.flatten(-2)


def _check_shape(name, tensor, want) -> None:
    if tuple(tensor.shape) != tuple(want):
        raise ValueError(f"expert weight {name!r} has shape {tuple(tensor.shape)}, expected {tuple(want)}")


class SparseMoeBlock(nn.Module):
    """Router + experts (+ Qwen2-MoE's shared expert, gated by sigmoid(shared_expert_gate(x)))."""

    def __init__(self, num_experts: int, top_k: int, hidden: int, intermediate: int, state: ParallelState = SINGLE,
                 renormalize: bool = True, shared_intermediate: int = 0, expert_parallel: bool = False,
                 oai: bool = False, swiglu: tuple[float, float] = (1.702, 7.0), grouped: GroupedRouting | None = None,
                 method=None, shared_method_for=None, prefix: str = "mlp"):
        super().__init__()
        if not 0 < top_k <= num_experts:
            raise ValueError(f"cannot route each token to {top_k} of {num_experts} experts")
        self.state, self.top_k, self.renormalize = state, top_k, renormalize
        self.gate = _param(num_experts, hidden)  # replicated: every rank routes alike
        # gpt-oss (oai): a biased router whose top-k logits are softmaxed among themselves
        self.topk_softmax = oai
        self.gate_bias = _param(num_experts) if oai else None
        self.experts = FusedMoE(num_experts, hidden, intermediate, state, expert_parallel, oai=oai, swiglu=swiglu,
                                method=method)
        self.shared_expert = self.shared_expert_gate = None
        self.grouped, self.correction_bias = grouped, None
        if grouped is not None:  # DeepSeek routes in float32 (transformers keeps the gate so)
            if num_experts % grouped.n_group or grouped.topk_group > grouped.n_group:
                raise ValueError(f"cannot route {num_experts} experts in {grouped.n_group} groups, {grouped.topk_group} of them")
            self.gate = kept(self.gate)
            if grouped.correction_bias:
                self.correction_bias = kept(_param(num_experts))
                self.correction_bias.data.zero_()
        if shared_intermediate:
            name = "shared_expert" if grouped is None else "shared_experts"
            methods = [shared_method_for(f"{prefix}.{name}.{p}") if shared_method_for else None
                       for p in ("gate_up_proj", "down_proj")]
            self.shared_expert = SharedExpert(hidden, shared_intermediate, state, *methods)
            if grouped is None:  # Qwen2-MoE gates its shared expert; DeepSeek's shared experts just add
                self.shared_expert_gate = _param(1, hidden)

    @classmethod
    def from_config(cls, cfg, state: ParallelState = SINGLE, expert_parallel: bool = False,
                    method_for=None, prefix: str = "mlp") -> "SparseMoeBlock":
        """`method_for(name)`: the checkpoint format's LinearMethod of the experts (FusedMoE's
        `method`) and of a shared expert's projections; None: float."""
        method = method_for(f"{prefix}.experts") if method_for else None
        if getattr(cfg, "hidden_act", "silu") != "silu":
            raise ValueError(f"activation {cfg.hidden_act!r} is not supported (silu only)")
        if cfg.model_type == "mixtral":  # always renormalises its top-k
            return cls(cfg.num_local_experts, cfg.num_experts_per_tok, cfg.hidden_size, cfg.intermediate_size, state,
                       expert_parallel=expert_parallel, method=method)
        if cfg.model_type in ("qwen2_moe", "qwen3_moe"):
            shared = getattr(cfg, "shared_expert_intermediate_size", 0) if cfg.model_type == "qwen2_moe" else 0
            return cls(cfg.num_experts, cfg.num_experts_per_tok, cfg.hidden_size, cfg.moe_intermediate_size, state,
                       renormalize=bool(cfg.norm_topk_prob), shared_intermediate=shared,
                       expert_parallel=expert_parallel, method=method, shared_method_for=method_for, prefix=prefix)
        if cfg.model_type == "gpt_oss":
            return cls(cfg.num_local_experts, cfg.num_experts_per_tok, cfg.hidden_size, cfg.intermediate_size, state,
                       renormalize=False, expert_parallel=expert_parallel, oai=True,
                       swiglu=(float(cfg.swiglu_alpha), float(cfg.swiglu_limit)), method=method)
        if cfg.model_type in ("deepseek_v2", "deepseek_v3"):
            return cls(cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.hidden_size, cfg.moe_intermediate_size, state,
                       shared_intermediate=cfg.moe_intermediate_size * (cfg.n_shared_experts or 0),
                       expert_parallel=expert_parallel, grouped=deepseek_routing(cfg), method=method,
                       shared_method_for=method_for, prefix=prefix)
        raise ValueError(f"no mixture-of-experts block for model type {cfg.model_type!r}")

    def route(self, x):
        """(topk_weights [T, k] float32, topk_ids [T, k]): softmax over every expert, then top-k
        (gpt-oss: top-k of the biased logits, then softmax over those k; DeepSeek: grouped_topk)."""
        if self.topk_softmax:
            logits, ids = F.linear(x, self.gate, self.gate_bias).topk(self.top_k, dim=-1)
            return logits.float().softmax(dim=-1), ids
        if self.grouped is not None:
            return grouped_topk(F.linear(x.float(), self.gate.float()), self.top_k, self.grouped, self.correction_bias)
        probs = F.linear(x, self.gate).float().softmax(dim=-1)
        weights, ids = probs.topk(self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, ids

    def forward(self, ops, x):
        weights, ids = self.route(x)
        out = self.experts(ops, x, weights, ids)
        if self.shared_expert is not None:
            shared = self.shared_expert(ops, x)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(F.linear(x, self.shared_expert_gate)) * shared
            out = out + shared
        return tp_all_reduce(out, self.state)

    def load(self, name: str, tensor: torch.Tensor) -> None:
        """`name` relative to the block, e.g. "gate.weight", "experts.3.w1.weight" (module docstring)."""
        if name in ("gate.weight", "router.weight"):
            _check_shape(name, tensor, self.gate.shape)
            self.gate.data.copy_(tensor)
        elif self.gate_bias is not None and name == "router.bias":
            _check_shape(name, tensor, self.gate_bias.shape)
            self.gate_bias.data.copy_(tensor)
        elif name.startswith("experts."):
            self.experts.load(name[len("experts."):], tensor)
        elif self.correction_bias is not None and name == "gate.e_score_correction_bias":
            _check_shape(name, tensor, self.correction_bias.shape)
            self.correction_bias.data.copy_(tensor)
        elif self.shared_expert is not None and self.shared_expert_gate is None and name.startswith("shared_experts."):
            self.shared_expert.load(name[len("shared_experts."):], tensor)
        elif self.shared_expert_gate is not None and name == "shared_expert_gate.weight":
            _check_shape(name, tensor, self.shared_expert_gate.shape)
            self.shared_expert_gate.data.copy_(tensor)
        elif self.shared_expert is not None and name.startswith("shared_expert."):
            self.shared_expert.load(name[len("shared_expert."):], tensor)
        else:
            raise ValueError(f"unexpected mixture-of-experts weight {name!r}")


def deepseek_routing(cfg) -> GroupedRouting:
    """V2: softmax, "greedy" (top-k of all) or "group_limited_greedy", never renormalised;
    V3: sigmoid with the correction bias, always grouped, norm_topk_prob."""
    if cfg.model_type == "deepseek_v3":
        return GroupedRouting("sigmoid", cfg.n_group or 1, cfg.topk_group or 1, correction_bias=True,
                              renormalize=bool(cfg.norm_topk_prob), scale=cfg.routed_scaling_factor)
    method = cfg.topk_method
    if method not in ("greedy", "group_limited_greedy"):
        raise ValueError(f"DeepSeek-V2 topk_method {method!r} is not supported (greedy, group_limited_greedy)")
    grouped = method == "group_limited_greedy"
    return GroupedRouting("softmax", cfg.n_group if grouped else 1, cfg.topk_group if grouped else 1,
                          scale=cfg.routed_scaling_factor)


class SharedExpert(nn.Module):
    """A dense SwiGLU MLP whose down projection leaves its partial sum unreduced (the block reduces)."""

    def __init__(self, hidden: int, intermediate: int, state: ParallelState = SINGLE, gate_up_method=None,
                 down_method=None):
        super().__init__()
        self.gate_up_proj = MergedColumnLinear(hidden, [intermediate] * 2, state,
                                               **({"method": gate_up_method} if gate_up_method else {}))
        self.down_proj = RowLinear(intermediate, hidden, state, reduce=False,
                                   **({"method": down_method} if down_method else {}))

    def load(self, name: str, tensor: torch.Tensor) -> None:
        leaf, kind = name.split(".", 1) if "." in name else (name, "weight")  # kind: weight, weight_scale, qweight, ...
        if leaf in ("gate_proj", "up_proj"):
            self.gate_up_proj.load(tensor, _EXPERT_LEAVES[leaf], kind)
        elif leaf == "down_proj":
            self.down_proj.load(tensor, kind)
        else:
            raise ValueError(f"unexpected shared expert weight {name!r}")

    def forward(self, ops, x):
        return self.down_proj(ops.silu_and_mul(self.gate_up_proj(x)))
