"""Turn a GGUF file (llama, mistral, qwen2, qwen3, qwen3moe, gemma3, phi3) into a Hugging Face model directory.

    convert_gguf("SmolLM2-135M-Instruct.Q4_1.gguf", "~/.cache/shoal/models/smollm2-135m-instruct")

The result is an ordinary HF directory -- ``config.json``, float32 ``model.safetensors`` (sharded
with an index past ``max_shard_bytes``), ``tokenizer.json`` + ``tokenizer_config.json`` (with the
chat template), ``generation_config.json`` -- that ``transformers`` and the engine both load.

Tensors are read and dequantized with the ``gguf`` package one at a time. llama.cpp's converter
permutes the rows of ``attn_q`` / ``attn_k`` of the ``llama`` architecture (it pairs rotary halves
as interleaved pairs); that permutation is undone here so HF's rotate-half RoPE sees its own layout.
The config is built from llama.cpp's own metadata keys (transformers' GGUF mapping drops some, such
as Qwen3's head_dim), and what each architecture's conversion changed -- names, Gemma's (1 + w)
norms, stacked experts -- is undone from the per-architecture tables below.

The conversion is atomic and safe to race: it writes into a temporary sibling directory, fsyncs,
then renames it into place, all under an ``fcntl`` lock on ``<out_dir>.lock``. An interrupted
conversion leaves no ``out_dir``; a second process asking for the same ``out_dir`` waits on the lock
and then finds the finished directory.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import re
import shutil
import uuid
from pathlib import Path
from typing import Any, Iterator

import numpy as np

logger = logging.getLogger(__name__)

# Bump when the output of the converter changes: cached directories of another version are redone.
CONVERTER_VERSION = 2  # 2: the manifest records the quantized tensors' table
MANIFEST = "shoal_conversion.json"
DEFAULT_MAX_SHARD_BYTES = 4 * 2**30

# GGUF architecture -> (HF model_type, HF architecture class, undo llama.cpp's Q/K permutation?).
# convert_hf_to_gguf.py permutes q/k rows only for the llama architecture (LlamaModel.permute).
_ARCHS: dict[str, tuple[str, str, bool]] = {
    "llama": ("llama", "LlamaForCausalLM", True),
    "mistral": ("mistral", "MistralForCausalLM", True),
    "qwen2": ("qwen2", "Qwen2ForCausalLM", False),
    "qwen3": ("qwen3", "Qwen3ForCausalLM", False),
    "qwen3moe": ("qwen3_moe", "Qwen3MoeForCausalLM", False),
    "gemma3": ("gemma3_text", "Gemma3ForCausalLM", False),
    "phi3": ("phi3", "Phi3ForCausalLM", False),
}

_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",  # the MoE router
}
# Where an architecture's block tensors mean something else (gguf-py's tensor_mapping.py).
_BLOCK_OVERRIDES: dict[str, dict[str, str]] = {
    # Gemma 3's four norms: ffn_norm is the one *before* the MLP; the post-norms have their own names.
    "gemma3": {"ffn_norm": "pre_feedforward_layernorm", "post_attention_norm": "post_attention_layernorm",
               "post_ffw_norm": "post_feedforward_layernorm"},
    # Phi-3's fused projections: qkv_proj -> attn_qkv, gate_up_proj -> ffn_up (gate rows first).
    "phi3": {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
}
# 3-D expert tensors [n_expert, rows, cols]: written back one HF tensor per expert, as
# save_pretrained writes them.
_EXPERT_TENSORS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
# llama.cpp stores Gemma 3's RMSNorm weights as (1 + w) (convert_hf_to_gguf Gemma3Model.norm_shift).
_NORM_SHIFT = {"gemma3": 1.0}
# Tensors llama.cpp derives for its own use; HF recomputes them from the config (Phi-3's LongRoPE
# factors are read into the config instead).
_SKIPPED_TENSORS = {"rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight"}
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")


# ----------------------------------------------------------------------------- public entry point


def convert_gguf(
    gguf_path: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    overwrite: bool = False,
    progress: bool = True,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> Path:
    """Convert ``gguf_path`` into the HF directory ``out_dir`` (once) and return ``out_dir``.

    If ``out_dir`` already holds a conversion of this same file by this converter version, it is
    returned as is. Concurrent callers serialize on a file lock; only one converts.
    """
    gguf_path = Path(gguf_path).expanduser().resolve()
    out_dir = Path(out_dir).expanduser().absolute()
    if not gguf_path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {gguf_path}")
    source = _source_identity(gguf_path)
    out_dir.parent.mkdir(parents=True, exist_ok=True)

    if not overwrite and _is_current(out_dir, source):  # fast path, no lock
        return out_dir
    with _file_lock(out_dir.parent / f"{out_dir.name}.lock"):
        if not overwrite and _is_current(out_dir, source):  # someone else finished while we waited
            return out_dir
        _remove_stale_temporaries(out_dir)
        tmp = out_dir.parent / f".{out_dir.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        try:
            _convert_into(gguf_path, tmp, source, progress=progress, max_shard_bytes=max_shard_bytes)
            _fsync_tree(tmp)
            _replace_dir(tmp, out_dir)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return out_dir


def is_converted(out_dir: str | os.PathLike, gguf_path: str | os.PathLike) -> bool:
    """Whether ``out_dir`` is a finished, current conversion of ``gguf_path``."""
    return _is_current(Path(out_dir), _source_identity(Path(gguf_path).resolve()))


# ----------------------------------------------------------------------------- the conversion


def _convert_into(gguf_path: Path, out: Path, source: dict, *, progress: bool, max_shard_bytes: int) -> None:
    import gguf
    import torch
    from safetensors.torch import save_file
    from tqdm.auto import tqdm

    reader = gguf.GGUFReader(str(gguf_path))
    meta = _Metadata(reader)
    arch = meta.get("general.architecture")
    if arch not in _ARCHS:
        raise ValueError(f"GGUF architecture {arch!r} is not supported; supported: {', '.join(sorted(_ARCHS))}")
    model_type, hf_arch, permute_qk = _ARCHS[arch]
    names = {t.name for t in reader.tensors}
    config = _build_config(meta, arch, model_type, hf_arch, tie=("output.weight" not in names))
    if arch in _ARCH_CONFIG:
        _ARCH_CONFIG[arch](meta, config, reader)
    n_head, n_kv = config["num_attention_heads"], config["num_key_value_heads"]

    # Plan the shards from the tensor sizes, so each tensor is written exactly once, in order.
    tensors = [t for t in reader.tensors if t.name not in _SKIPPED_TENSORS]
    for t in reader.tensors:
        if t.name in _SKIPPED_TENSORS:
            logger.warning("GGUF tensor %s is not carried over (HF derives it from config.json)", t.name)
    shards: list[list[Any]] = [[]]
    size = 0
    for t in tensors:
        nbytes = int(t.n_elements) * 4
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += nbytes

    weight_map: dict[str, str] = {}
    total = 0
    bar = tqdm(total=len(tensors), desc=f"Dequantizing {gguf_path.name}", unit="tensor", disable=not progress)
    try:
        for index, group in enumerate(shards):
            filename = (
                "model.safetensors"
                if len(shards) == 1
                else f"model-{index + 1:05d}-of-{len(shards):05d}.safetensors"
            )
            state: dict[str, torch.Tensor] = {}
            for t in group:
                array = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
                array = array.reshape(tuple(int(d) for d in reversed(t.shape.tolist())))
                if permute_qk and ".attn_q." in t.name:
                    array = _unpermute(array, n_head)
                elif permute_qk and ".attn_k." in t.name:
                    array = _unpermute(array, n_kv)
                if arch in _NORM_SHIFT and t.name.endswith("norm.weight"):
                    array = array - np.float32(_NORM_SHIFT[arch])
                for hf_name, part in _hf_tensors(t.name, array, arch):
                    if not part.flags.writeable or not part.flags.c_contiguous:  # memmapped F32 tensors
                        part = np.array(part, dtype=np.float32, order="C")
                    state[hf_name] = torch.from_numpy(part)
                    weight_map[hf_name] = filename
                    total += part.nbytes
                bar.update(1)
            save_file(state, str(out / filename), metadata={"format": "pt"})
            del state
    finally:
        bar.close()
    if len(shards) > 1:
        _write_json(out / "model.safetensors.index.json", {"metadata": {"total_size": total}, "weight_map": weight_map})

    _write_json(out / "config.json", config)
    generation = {"_from_model_config": True, "bos_token_id": config.get("bos_token_id"),
                  "eos_token_id": config.get("eos_token_id")}
    if config.get("pad_token_id") is not None:
        generation["pad_token_id"] = config["pad_token_id"]
    _write_json(out / "generation_config.json", {k: v for k, v in generation.items() if v is not None})
    _write_tokenizer(gguf_path, meta, out, config)
    _write_json(out / MANIFEST, {**source, "converter_version": CONVERTER_VERSION, "gguf_architecture": arch,
                                 "converter_pid": os.getpid(), "quantized_tensors": _quantized_table(reader, arch, n_head, n_kv)})


def gguf_source(model_dir: str | os.PathLike) -> Path | None:
    """The GGUF file a converted directory came from (its manifest), or None (not a conversion,
    or the file is gone or changed since)."""
    try:
        manifest = json.loads((Path(model_dir) / MANIFEST).read_text())
        path = Path(manifest["source"])
        return path if _is_current(Path(model_dir), _source_identity(path)) else None
    except (OSError, ValueError, KeyError, TypeError):
        return None


def quantized_weights(model_dir: str | os.PathLike) -> dict[str, tuple[int, np.ndarray]] | None:
    """{HF weight name: (ggml type number, uint8 rows [N, bytes a row])} of every quantized 2-D
    tensor of the GGUF file a converted directory came from, the blocks as the file stores them
    (memory-mapped, read-only), with the rows of attn_q / attn_k put back in HF's order as the
    conversion does for the float weights. None when the directory is no current conversion.

    Read through the tensor table the conversion recorded: parsing the file's metadata again
    (gguf's reader walks every tokenizer string) took 4 of a server's 13 s start-up on the
    built-in model."""
    source = gguf_source(model_dir)
    if source is None:
        return None
    table = json.loads((Path(model_dir) / MANIFEST).read_text())["quantized_tensors"]
    file = np.memmap(source, dtype=np.uint8, mode="r") if table else None
    out = {}
    for name, (qtype, offset, rows, row_bytes, heads) in table.items():
        blocks = file[offset : offset + rows * row_bytes].reshape(rows, row_bytes)
        out[name] = (qtype, _unpermute(blocks, heads) if heads else blocks)
    return out


def _quantized_table(reader, arch: str, n_head: int, n_kv: int) -> dict[str, list[int]]:
    """{HF name: [ggml type, byte offset in the file, rows, bytes a row, heads to un-permute (0: none)]}
    of every quantized 2-D tensor (where quantized_weights finds its rows, as numbers a manifest can hold)."""
    import gguf

    permute_qk = _ARCHS[arch][2]
    table = {}
    for t in reader.tensors:
        if t.tensor_type in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16,
                             gguf.GGMLQuantizationType.BF16) or t.data.ndim != 2 or t.name in _SKIPPED_TENSORS:
            continue
        heads = n_head if permute_qk and ".attn_q." in t.name else n_kv if permute_qk and ".attn_k." in t.name else 0
        rows, row_bytes = t.data.shape
        table[_hf_name(t.name, arch)] = [int(t.tensor_type), int(t.data_offset), int(rows), int(row_bytes), int(heads)]
    return table


def _hf_name(gguf_name: str, arch: str = "llama") -> str:
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    m = _BLOCK_RE.match(gguf_name)
    names = {**_BLOCK_TENSORS, **_BLOCK_OVERRIDES.get(arch, {})}
    if m and m.group(2) in names:
        return f"model.layers.{m.group(1)}.{names[m.group(2)]}.{m.group(3)}"
    raise ValueError(f"GGUF tensor {gguf_name!r} has no Hugging Face counterpart in a {arch!r} model")


def _hf_tensors(gguf_name: str, array: np.ndarray, arch: str) -> Iterator[tuple[str, np.ndarray]]:
    """The HF tensors one GGUF tensor holds: itself renamed, or one per expert of a 3-D expert tensor."""
    m = _BLOCK_RE.match(gguf_name)
    if m and m.group(2) in _EXPERT_TENSORS:
        for e in range(array.shape[0]):
            yield f"model.layers.{m.group(1)}.mlp.experts.{e}.{_EXPERT_TENSORS[m.group(2)]}.{m.group(3)}", array[e]
    else:
        yield _hf_name(gguf_name, arch), array


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama.cpp's ``permute``: (head, 2, half) row order back to HF's (head, half, 2)...

    llama.cpp writes ``w.reshape(n_head, 2, rows // n_head // 2, ...).swapaxes(1, 2)``; swapping the
    same two axes of the transposed view undoes it.
    """
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _build_config(meta: "_Metadata", arch: str, model_type: str, hf_arch: str, *, tie: bool) -> dict:
    a = arch
    hidden = meta.get(f"{a}.embedding_length")
    n_head = meta.get(f"{a}.attention.head_count")
    n_kv = meta.get(f"{a}.attention.head_count_kv", n_head)
    if isinstance(n_kv, list):  # per-layer counts; Llama-family models use one value
        n_kv = max(n_kv)
    vocab = meta.get(f"{a}.vocab_size") or len(meta.get("tokenizer.ggml.tokens", []))
    head_dim = meta.get(f"{a}.attention.key_length") or hidden // n_head
    cfg: dict[str, Any] = {
        "architectures": [hf_arch],
        "model_type": model_type,
        "hidden_size": hidden,
        "intermediate_size": meta.get(f"{a}.feed_forward_length"),
        "num_attention_heads": n_head,
        "num_key_value_heads": n_kv,
        "num_hidden_layers": meta.get(f"{a}.block_count"),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": _f32(meta.get(f"{a}.attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": _f32(meta.get(f"{a}.rope.freq_base", 10000.0)),
        "max_position_embeddings": meta.get(f"{a}.context_length", 2048),
        "vocab_size": vocab,
        "tie_word_embeddings": tie,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
        "initializer_range": 0.02,
        "use_cache": True,
        "torch_dtype": "float32",
    }
    if model_type == "llama":
        cfg.update(attention_bias=False, mlp_bias=False, pretraining_tp=1)
    rot = meta.get(f"{a}.rope.dimension_count")
    if rot is not None and rot != head_dim and arch != "phi3":  # Phi-3 reads it as partial_rotary_factor
        raise ValueError(f"partial rotary embeddings (rope.dimension_count={rot}, head_dim={head_dim}) are not supported")
    scaling = meta.get(f"{a}.rope.scaling.type")
    factor = meta.get(f"{a}.rope.scaling.factor")
    if scaling in ("linear", "yarn") and factor and factor != 1.0:
        rs = {"rope_type": scaling, "factor": _f32(factor)}
        orig = meta.get(f"{a}.rope.scaling.original_context_length")
        if orig:
            rs["original_max_position_embeddings"] = orig
        cfg["rope_scaling"] = rs
    elif scaling not in (None, "none", "linear", "yarn"):
        raise ValueError(f"GGUF rope scaling {scaling!r} is not supported")
    sw = meta.get(f"{a}.attention.sliding_window")
    if sw:
        cfg["sliding_window"] = sw
    return {k: v for k, v in cfg.items() if v is not None or k == "pad_token_id"}


# ----------------------------------------------------------------------------- what each architecture adds


def _qwen3moe_config(meta: _Metadata, cfg: dict, reader) -> None:
    a = "qwen3moe"
    sparse = {int(m.group(1)) for t in reader.tensors
              if (m := _BLOCK_RE.match(t.name)) and m.group(2) == "ffn_gate_exps"}
    moe_ff = meta.get(f"{a}.expert_feed_forward_length")
    cfg.update(
        num_experts=meta.get(f"{a}.expert_count"),
        num_experts_per_tok=meta.get(f"{a}.expert_used_count"),
        moe_intermediate_size=moe_ff,
        intermediate_size=cfg.get("intermediate_size") or moe_ff,
        norm_topk_prob=bool(meta.get(f"{a}.expert_weights_norm", True)),  # llama.cpp's qwen3moe renormalises the top-k
        decoder_sparse_step=1,
        mlp_only_layers=[i for i in range(cfg["num_hidden_layers"]) if i not in sparse],
    )


def _gemma3_config(meta: _Metadata, cfg: dict, reader) -> None:
    """Gemma 3's fixed choices, as llama.cpp's loader makes them (llama-model.cpp, LLM_ARCH_GEMMA3): with
    a sliding window every sixth layer is global; the local layers' RoPE base is 10000, unscaled; queries
    scale by 1/sqrt(hidden / heads) for the 62-layer 27B and by 1/sqrt(head_dim) otherwise."""
    a = "gemma3"
    n, window = cfg["num_hidden_layers"], meta.get(f"{a}.attention.sliding_window") or 0
    full = {"rope_type": "default", "rope_theta": cfg.pop("rope_theta")}
    full.update(cfg.pop("rope_scaling", {}))
    local = {"rope_type": "default", "rope_theta": _f32(meta.get(f"{a}.rope.freq_base_swa", 10000.0))}
    cfg.update(
        hidden_activation="gelu_pytorch_tanh",
        hidden_act="gelu_pytorch_tanh",
        query_pre_attn_scalar=cfg["hidden_size"] // cfg["num_attention_heads"] if n == 62 else cfg["head_dim"],
        sliding_window=window or None,
        layer_types=["sliding_attention" if window and (i + 1) % 6 else "full_attention" for i in range(n)],
        rope_parameters={"sliding_attention": local, "full_attention": full},
        final_logit_softcapping=meta.get(f"{a}.final_logit_softcapping"),
        attn_logit_softcapping=None,
    )


def _phi3_config(meta: _Metadata, cfg: dict, reader) -> None:
    """Phi-3 writes its partial rotary as rope.dimension_count and its LongRoPE factors as the
    rope_factors_long/short tensors (no rope.scaling.type)."""
    import gguf

    a = "phi3"
    cfg["partial_rotary_factor"] = (meta.get(f"{a}.rope.dimension_count") or cfg["head_dim"]) / cfg["head_dim"]
    original = meta.get(f"{a}.rope.scaling.original_context_length")
    if original:
        cfg["original_max_position_embeddings"] = original
    factors = {t.name.split(".")[0]: [_f32(x) for x in gguf.quants.dequantize(t.data, t.tensor_type).ravel()]
               for t in reader.tensors if t.name in ("rope_factors_long.weight", "rope_factors_short.weight")}
    if factors:
        cfg["rope_scaling"] = {"rope_type": "longrope", "long_factor": factors["rope_factors_long"],
                               "short_factor": factors["rope_factors_short"]}


# llama.cpp architecture -> what its config adds to the common fields _build_config reads
_ARCH_CONFIG = {"qwen3moe": _qwen3moe_config, "gemma3": _gemma3_config, "phi3": _phi3_config}


def _write_tokenizer(gguf_path: Path, meta: "_Metadata", out: Path, config: dict) -> None:
    """The tokenizer transformers builds from the GGUF metadata, saved as tokenizer.json."""
    from tokenizers import pre_tokenizers
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    if not getattr(tok, "is_fast", False):
        raise RuntimeError("expected a fast tokenizer from the GGUF metadata")
    if meta.get("tokenizer.ggml.model") == "gpt2" and meta.get("tokenizer.ggml.pre") == "smollm":
        # llama.cpp's `smollm` pre-tokenizer isolates every digit before the GPT-2 split, like the
        # original SmolLM tokenizer.json (Digits(individual_digits) + ByteLevel); transformers leaves
        # the plain ByteLevel split in place.
        tok.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True),
             pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)]
        )
    template = meta.get("tokenizer.chat_template")
    if template and not tok.chat_template:
        tok.chat_template = template
    tok.model_max_length = config["max_position_embeddings"]
    tok.save_pretrained(str(out))

    # Keep the template (and the BOS/EOS flags) in tokenizer_config.json too, where older readers look.
    path = out / "tokenizer_config.json"
    tc = json.loads(path.read_text())
    if template:
        tc["chat_template"] = template
    for key in ("add_bos_token", "add_eos_token"):
        value = meta.get(f"tokenizer.ggml.{key}")
        if value is not None:
            tc[key] = bool(value)
    for key in ("is_local", "local_files_only"):  # facts about this load, not about the tokenizer
        tc.pop(key, None)
    if tc.get("tokenizer_class") == "TokenizersBackend":
        tc["tokenizer_class"] = "PreTrainedTokenizerFast"  # the name transformers 4.x and 5.x both know
    _write_json(path, tc)


class _Metadata:
    """GGUF key/value metadata, decoded lazily (the token arrays are large)."""

    def __init__(self, reader):
        self._fields = reader.fields
        self._cache: dict[str, Any] = {}

    def get(self, key: str, default: Any = None) -> Any:
        if key not in self._fields:
            return default
        if key not in self._cache:
            value = self._fields[key].contents()
            if isinstance(value, (np.generic,)):
                value = value.item()
            self._cache[key] = value
        return self._cache[key]


def _f32(x: float) -> float:
    """A float32 GGUF value as the decimal it was written from (9.99999974e-06 -> 1e-05)."""
    return float(str(np.float32(x)))


# ----------------------------------------------------------------------------- atomicity helpers


def _source_identity(gguf_path: Path) -> dict:
    st = gguf_path.stat()
    return {"source": str(gguf_path), "source_size": st.st_size, "source_mtime_ns": st.st_mtime_ns}


def _is_current(out_dir: Path, source: dict) -> bool:
    try:
        manifest = json.loads((out_dir / MANIFEST).read_text())
    except (OSError, ValueError):
        return False
    return (
        manifest.get("converter_version") == CONVERTER_VERSION
        and manifest.get("source_size") == source["source_size"]
        and manifest.get("source_mtime_ns") == source["source_mtime_ns"]
    )


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    with open(path, "a+") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def _remove_stale_temporaries(out_dir: Path) -> None:
    """Leftovers of a killed conversion (we hold the lock, so nobody is writing them)."""
    for stale in out_dir.parent.glob(f".{out_dir.name}.tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)
    for stale in out_dir.parent.glob(f".{out_dir.name}.old-*"):
        shutil.rmtree(stale, ignore_errors=True)


def _replace_dir(tmp: Path, out_dir: Path) -> None:
    old = None
    if out_dir.exists() or out_dir.is_symlink():
        old = out_dir.parent / f".{out_dir.name}.old-{uuid.uuid4().hex[:8]}"
        os.rename(out_dir, old)
    os.rename(tmp, out_dir)
    _fsync_path(out_dir.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _fsync_tree(root: Path) -> None:
    for path in root.iterdir():
        if path.is_file():
            with open(path, "rb") as fh:
                os.fsync(fh.fileno())
    _fsync_path(root)


def _fsync_path(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=False, ensure_ascii=False) + "\n")
