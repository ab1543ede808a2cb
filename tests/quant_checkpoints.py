"""Reference quantizers that write a tiny model's linear layers in published checkpoints'
exact layouts (tensor names, dtypes, shapes, packing, g_idx), written here from the formats'
own packing loops (AutoAWQ, AutoGPTQ, compressed-tensors) rather than Shoal's unpackers,
and return the dequantized float32 weights that transformers runs as the reference."""

from __future__ import annotations

import json
import re

import numpy as np
import torch

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
FP8 = torch.float8_e4m3fn


def _pack_nibbles(values: np.ndarray, axis: int, order=tuple(range(8))) -> torch.Tensor:
    """Eight 4-bit values along `axis` per int32: element i of each eight goes to bits 4i."""
    v = np.moveaxis(values.astype(np.uint32), axis, -1)
    v = v.reshape(*v.shape[:-1], -1, 8)
    packed = np.zeros(v.shape[:-1], dtype=np.uint32)
    for i in range(8):
        packed |= v[..., order[i]] << np.uint32(4 * i)
    return torch.from_numpy(np.moveaxis(packed, -1, axis).view(np.int32).copy())


def _int4_groups(w: torch.Tensor, group: int, symmetric: bool, g_idx: torch.Tensor):
    """w [out, in] -> q [out, in] ints, scale [groups, out], zero [groups, out], by input group g_idx."""
    out, k = w.shape
    groups = k // group
    scale, zero = torch.empty(groups, out), torch.empty(groups, out)
    q = torch.empty(out, k)
    for g in range(groups):
        cols = (g_idx == g).nonzero().flatten()
        part = w[:, cols]
        if symmetric:
            s = part.abs().amax(1).clamp_min(1e-8) / 7.5
            z = torch.full_like(s, 8.0)
        else:
            lo, hi = part.amin(1).clamp(max=0), part.amax(1).clamp(min=0)
            s = ((hi - lo) / 15).clamp_min(1e-8)
            z = torch.round(-lo / s).clamp(0, 15)
        s = s.half().float()  # as the checkpoints store them
        q[:, cols] = torch.clamp(torch.round(part / s[:, None]) + z[:, None], 0, 15)
        scale[g], zero[g] = s, z
    return q.to(torch.int64), scale, zero


def _dequant(q, scale, zero, g_idx):
    g = g_idx.long()
    return (q.float() - zero.t()[:, g]) * scale.t()[:, g]


def quantize_awq(name, w, group=128):
    g_idx = torch.arange(w.shape[1]) // group
    q, s, z = _int4_groups(w, group, False, g_idx)
    order = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ's gemm pack order_map
    tensors = {f"{name}.qweight": _pack_nibbles(q.t().numpy(), 1, order),  # [in, out / 8]
               f"{name}.qzeros": _pack_nibbles(z.to(torch.int64).numpy(), 1, order),  # [groups, out / 8]
               f"{name}.scales": s.half()}
    return tensors, _dequant(q, s, z, g_idx)


def quantize_gptq(name, w, group=128, perm=None):
    """Symmetric 4-bit; with `perm` (act-order), input k is quantized in the order perm gives
    and its group is its place in that order (g_idx), its rows stay where they were."""
    k = w.shape[1]
    if perm is None:
        g_idx = torch.arange(k) // group
    else:
        g_idx = torch.empty(k, dtype=torch.long)
        g_idx[perm] = torch.arange(k) // group
    q, s, z = _int4_groups(w, group, True, g_idx)
    tensors = {f"{name}.qweight": _pack_nibbles(q.t().numpy(), 0),  # [in / 8, out]
               f"{name}.qzeros": _pack_nibbles((z - 1).to(torch.int64).numpy(), 1),  # stored minus one
               f"{name}.scales": s.half(), f"{name}.g_idx": g_idx.to(torch.int32)}
    return tensors, _dequant(q, s, z, g_idx)


def quantize_w4a16(name, w, group=128, symmetric=True):
    """compressed-tensors packs signed values (and zero points) offset by 8: q - 8 + 8."""
    g_idx = torch.arange(w.shape[1]) // group
    q, s, z = _int4_groups(w, group, symmetric, g_idx)
    tensors = {f"{name}.weight_packed": _pack_nibbles(q.numpy(), 1),  # [out, in / 8], values offset by 8
               f"{name}.weight_scale": s.t().contiguous().half(),
               f"{name}.weight_shape": torch.tensor(list(w.shape), dtype=torch.int64)}
    if not symmetric:
        tensors[f"{name}.weight_zero_point"] = _pack_nibbles(z.t().to(torch.int64).numpy(), 0)  # [out / 8, groups]
    return tensors, _dequant(q, s, z, g_idx)


def quantize_fp8(name, w, per_channel=False, input_amax=None):
    amax = w.abs().amax(1, keepdim=True) if per_channel else w.abs().amax().reshape(1)
    scale = amax / 448.0
    q = (w / (scale if per_channel else scale[0])).to(FP8)
    tensors = {f"{name}.weight": q, f"{name}.weight_scale": scale.float()}
    if input_amax is not None:
        tensors[f"{name}.input_scale"] = torch.tensor([input_amax / 448.0])
    return tensors, q.float() * (scale if per_channel else scale[0])


def _input_amax(model, prompts) -> dict[str, float]:
    """Calibration: the largest input magnitude each linear layer sees over the prompts."""
    seen, hooks = {}, []
    for name, module in model.named_modules():
        if name.split(".")[-1] in LINEARS:
            def hook(mod, args, name=name):
                seen[name] = max(seen.get(name, 0.0), float(args[0].abs().amax()))
            hooks.append(module.register_forward_pre_hook(hook))
    with torch.inference_mode():
        for ids in prompts:
            model(torch.tensor([ids]))
    for h in hooks:
        h.remove()
    return seen


CT_FP8 = {"weights": {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False},
          "input_activations": {"num_bits": 8, "type": "float", "symmetric": True}}


def quantization_config(fmt: str, group: int = 128) -> dict | None:
    if fmt in ("ct-fp8-tensor-static", "ct-fp8-channel-dynamic", "ct-fp8-channel-static"):
        static = fmt.endswith("static")
        scheme = json.loads(json.dumps(CT_FP8))
        scheme["weights"]["strategy"] = "tensor" if "tensor" in fmt else "channel"
        scheme["input_activations"].update(strategy="tensor" if static else "token", dynamic=not static)
        return {"quant_method": "compressed-tensors", "format": "float-quantized",
                "config_groups": {"group_0": {"targets": ["Linear"], **scheme}}, "ignore": ["lm_head"]}
    if fmt == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, "version": "gemm"}
    if fmt in ("gptq", "gptq-act-order"):
        return {"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": fmt == "gptq-act-order",
                "sym": True, "checkpoint_format": "gptq"}
    if fmt in ("ct-w4a16", "ct-w4a16-asym"):
        return {"quant_method": "compressed-tensors", "format": "pack-quantized",
                "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None,
                                              "weights": {"num_bits": 4, "type": "int", "symmetric": fmt == "ct-w4a16",
                                                          "strategy": "group", "group_size": group}}},
                "ignore": ["lm_head"]}
    if fmt == "fp8-at-load":
        return None
    raise ValueError(fmt)


def _quantize_one(fmt: str, name: str, w: torch.Tensor, group: int, input_amax=None):
    """One projection's checkpoint tensors in `fmt` and its dequantized weight (the formats
    quantize_checkpoint writes without act-order)."""
    if fmt == "fp8-at-load":  # the checkpoint stays float; Shoal quantizes per channel at load
        scale = w.abs().amax(1, keepdim=True) / 448.0
        return {f"{name}.weight": w.clone()}, (w / scale).to(FP8).float() * scale
    if fmt.startswith("ct-fp8"):
        return quantize_fp8(name, w, per_channel="channel" in fmt, input_amax=input_amax)
    if fmt == "awq":
        return quantize_awq(name, w, group)
    if fmt == "gptq":
        return quantize_gptq(name, w, group)
    if fmt.startswith("ct-w4a16"):
        return quantize_w4a16(name, w, group, symmetric=fmt == "ct-w4a16")
    raise ValueError(fmt)


# ---------------------------------------------------------------- mixture-of-experts models

# an expert projection as save_pretrained writes it (Mixtral: block_sparse_moe, w1/w3/w2)
EXPERT = re.compile(r"model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(w1|w3|w2|gate_proj|up_proj|down_proj)$")
_PROJ = {"w1": 0, "gate_proj": 0, "w3": 1, "up_proj": 1, "w2": 2, "down_proj": 2}


def _experts_modules(model) -> dict[int, torch.nn.Module]:
    """transformers' fused in-memory experts (gate_up_proj [E, 2I, H], down_proj [E, H, I]) by layer."""
    return {int(n.split(".")[2]): m for n, m in model.named_modules()
            if n.endswith(".experts") and hasattr(m, "gate_up_proj") and hasattr(m, "down_proj")}


def patch_experts(model, round_input) -> None:
    """Replace each experts module's forward with transformers' own loop (MixtralExperts /
    Qwen3MoeExperts.forward) with `round_input(x, layer, expert, gemm)` applied to each GEMM's
    input (gemm 0: gate/up, 1: down); round_input None restores the original."""
    for layer, experts in _experts_modules(model).items():
        if round_input is None:
            experts.__dict__.pop("forward", None)
            continue

        def forward(hidden_states, top_k_index, top_k_weights, experts=experts, layer=layer):
            out = torch.zeros_like(hidden_states)
            for e in range(experts.num_experts):
                tokens, pos = torch.where(top_k_index == e)
                if not len(tokens):
                    continue
                x = round_input(hidden_states[tokens], layer, e, 0)
                gate, up = torch.nn.functional.linear(x, experts.gate_up_proj[e]).chunk(2, dim=-1)
                h = round_input(experts.act_fn(gate) * up, layer, e, 1)
                y = torch.nn.functional.linear(h, experts.down_proj[e]) * top_k_weights[tokens, pos, None]
                out.index_add_(0, tokens, y.to(out.dtype))
            return out

        experts.forward = forward


def quantize_moe_checkpoint(model, path, fmt: str, prompts, group: int = 32):
    """quantize_checkpoint for a mixture-of-experts model saved by save_pretrained (one file, one
    tensor per expert and projection, as published checkpoints hold them): every expert
    projection and dense linear layer written in `fmt` (routers, embeddings and lm_head stay
    float), and the dequantized weights loaded into `model` in place."""
    from safetensors.torch import load_file, save_file

    amax, expert_amax = {}, {}
    if fmt.endswith("-static"):  # calibration over the prompts: dense layers and every expert's two inputs
        def record(x, layer, e, gemm):
            key = (layer, e, gemm)
            expert_amax[key] = max(expert_amax.get(key, 0.0), float(x.abs().amax()))
            return x

        patch_experts(model, record)
        amax = _input_amax(model, prompts)
        patch_experts(model, None)
    experts = _experts_modules(model)
    state = model.state_dict()
    out = {}
    for key, w in load_file(str(path / "model.safetensors")).items():
        name, kind = key.rsplit(".", 1)
        m = EXPERT.match(name)
        if kind != "weight" or not (m or name.split(".")[-1] in LINEARS):
            out[key] = w
            continue
        if m:
            layer, e, proj = int(m.group(1)), int(m.group(2)), _PROJ[m.group(3)]
            seen = expert_amax.get((layer, e, int(proj == 2)), 1.0) if expert_amax else None  # an unused expert: any scale
            tensors, deq = _quantize_one(fmt, name, w, group, seen)
            with torch.no_grad():
                target = experts[layer].down_proj[e] if proj == 2 else experts[layer].gate_up_proj[e].chunk(2)[proj]
                target.copy_(deq)
        else:
            tensors, deq = _quantize_one(fmt, name, w, group, amax.get(name))
            state[key].copy_(deq)
        out.update(tensors)
    save_file({k: v.contiguous() for k, v in out.items()}, str(path / "model.safetensors"))
    cfg = json.loads((path / "config.json").read_text())
    qc = quantization_config(fmt, group)
    if qc is not None:
        cfg["quantization_config"] = {**qc, "ignore": ["lm_head", "re:.*mlp.gate$", "re:.*block_sparse_moe.gate$"]}
        if qc["quant_method"] != "compressed-tensors":
            del cfg["quantization_config"]["ignore"]
    (path / "config.json").write_text(json.dumps(cfg))
    return path


def fake_quant_experts(model, fmt: str, path) -> None:
    """W8A8's activations in the reference's experts: each GEMM's input rounded through float8
    per token, or (static) by the largest input_scale of that GEMM over the layer's experts."""
    from safetensors.torch import load_file

    static = {}
    if fmt.endswith("-static"):
        for key, v in load_file(str(path / "model.safetensors")).items():
            m = EXPERT.match(key.removesuffix(".input_scale")) if key.endswith(".input_scale") else None
            if m:
                k = (int(m.group(1)), int(_PROJ[m.group(3)] == 2))
                static[k] = max(static.get(k, 0.0), float(v))

    def round_input(x, layer, e, gemm):
        s = torch.tensor(static[(layer, gemm)]) if static else (x.abs().amax(-1, keepdim=True) / 448.0).clamp_min(1e-12)
        return ((x / s).clamp(-448, 448).to(FP8).float() * s).to(x.dtype)

    patch_experts(model, round_input)


def quantize_checkpoint(model, path, fmt: str, prompts, group: int = 128, seed: int = 0):
    """Write `model`'s checkpoint quantized as `fmt` into `path` (config.json with its
    quantization_config and model.safetensors), and load the dequantized weights into
    `model` in place (the reference transformers runs)."""
    from safetensors.torch import save_file

    amax = _input_amax(model, prompts) if fmt == "ct-fp8-tensor-static" else {}
    gen = torch.Generator().manual_seed(seed)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    out, perms = {}, {}
    for key, w in state.items():
        name, kind = key.rsplit(".", 1)
        leaf = name.split(".")[-1]
        if leaf not in LINEARS or kind != "weight":
            out[key] = w
            continue
        if fmt == "fp8-at-load":  # the checkpoint stays float; Shoal quantizes per channel at load
            out[key] = w.clone()
            scale = w.abs().amax(1, keepdim=True) / 448.0
            deq = (w / scale).to(FP8).float() * scale
        elif fmt.startswith("ct-fp8"):
            tensors, deq = quantize_fp8(name, w, per_channel=fmt == "ct-fp8-channel-dynamic", input_amax=amax.get(name))
            out.update(tensors)
        elif fmt == "awq":
            tensors, deq = quantize_awq(name, w, group)
            out.update(tensors)
        elif fmt.startswith("gptq"):
            perm = None
            if fmt == "gptq-act-order":  # one order per input: q/k/v share theirs, as gate/up do
                source = name.rsplit(".", 1)[0] + (".qkv" if leaf in ("q_proj", "k_proj", "v_proj") else
                                                   ".gu" if leaf in ("gate_proj", "up_proj") else leaf)
                perm = perms.setdefault(source, torch.randperm(w.shape[1], generator=gen))
            tensors, deq = quantize_gptq(name, w, group, perm)
            out.update(tensors)
        elif fmt.startswith("ct-w4a16"):
            tensors, deq = quantize_w4a16(name, w, group, symmetric=fmt == "ct-w4a16")
            out.update(tensors)
        else:
            raise ValueError(fmt)
        w.copy_(deq)
    model.load_state_dict(state)
    save_file({k: v.contiguous() for k, v in out.items()}, str(path / "model.safetensors"))
    cfg = json.loads((path / "config.json").read_text())
    qc = quantization_config(fmt, group)
    if qc is not None:
        cfg["quantization_config"] = qc
    (path / "config.json").write_text(json.dumps(cfg))
    return path


def fake_quant_activations(model, fmt: str, path) -> list:
    """W8A8's activations in the reference: each linear layer's input rounded through float8
    e4m3 (per token, or by the checkpoint's static input_scale) before transformers multiplies it."""
    from safetensors.torch import load_file

    static = fmt.endswith("-static")
    scales = {k[: -len(".input_scale")]: v for k, v in load_file(str(path / "model.safetensors")).items()
              if k.endswith(".input_scale")}
    hooks = []
    for name, module in model.named_modules():
        if name.split(".")[-1] in LINEARS:
            def hook(mod, args, name=name):
                x = args[0]
                s = scales[name].reshape(()) if static else (x.abs().amax(-1, keepdim=True) / 448.0).clamp_min(1e-12)
                return ((x / s).clamp(-448, 448).to(FP8).float() * s).to(x.dtype),
            hooks.append(module.register_forward_pre_hook(hook))
    return hooks
