"""The only code that touches the device: sends a step's inputs (one copy, staging.py),
runs the model over the paged KV cache, and samples the rows that sample on the device."""

from __future__ import annotations

import dataclasses
import logging
import math
from types import SimpleNamespace

import torch

from shoal.runtime import cpu_threads
from shoal.runtime.distributed import SINGLE, ParallelState
from shoal.runtime.cpu_memory import huge_page_zeros, keep_freed_heap_memory
from shoal.runtime.executor.base import Executor, StepInput
from shoal.runtime.executor.prompt_logprobs import score
from shoal.runtime.executor.staging import Staging
from shoal.runtime.layers.decode_workspace import DecodeRows, new_workspace
from shoal.runtime.layers.linear import cast_and_finish, pack_for_cpu, quantized
from shoal.runtime.layers.quantization import methods_for
from shoal.runtime.layers.sampler import Finished, SampleResult, SamplingMetadata, sample_on_device
from shoal.runtime.models.decoder import DecoderForCausalLM
from shoal.runtime.models.loader import iter_weights

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
DEFAULT_CPU_KV_BYTES = 2 * 2**30


def native_sampler():
    """The CPU's C sampler (temperature, top-p; layers/sampler.py), or None where the C library
    cannot be built (the torch sampler then)."""
    from shoal.runtime.models import cpu_llama

    if cpu_llama.cpu_supported() is not None:
        return None
    try:
        cpu_llama.load_library()
    except (RuntimeError, OSError) as e:
        log.info("C sampler not used: %s", e)
        return None
    return cpu_llama.sample_top_p


def gguf_blocks(config, model_dir) -> dict | None:
    """--quantization gguf: the quantized blocks of the GGUF file the model was converted from."""
    if config.quantization != "gguf":
        return None
    from shoal.runtime.models.gguf_convert import quantized_weights

    blocks = quantized_weights(model_dir)
    if blocks is None:
        raise ValueError("--quantization gguf needs a GGUF model (a .gguf file or builtin://NAME)")
    return blocks


class ModelRunner(Executor):
    scores_prompts = True
    overlaps_steps = True

    def __init__(self, config, hf_config, model_dir, max_model_len: int, state: ParallelState = SINGLE, layer_split=None):
        self.config, self.hf_config, self.state = config, hf_config, state
        self.max_model_len = max_model_len
        self.device = torch.device(config.device)
        self.dtype = DTYPES.get(config.dtype, torch.float32)
        if self.device.type == "cpu" and state.tp_size * state.pp_size == 1:  # a group's ranks set theirs in launch
            cpu_threads.set_threads(cpu_threads.num_threads(config.num_threads))
        # --kv-cache-dtype fp8: float8 e4m3 blocks, half a 16-bit cache's bytes (twice the blocks)
        self.kv_dtype = torch.float8_e4m3fn if config.kv_cache_dtype.startswith("fp8") else self.dtype
        from shoal.kernels import get_ops

        self.ops = get_ops(config.attention_backend, self.device)
        with torch.device(self.device):
            model = DecoderForCausalLM(hf_config, state, max_positions=max_model_len, layer_split=layer_split,
                                       method_for=methods_for(hf_config, None if config.quantization == "gguf" else config.quantization))
        model.load_weights(iter_weights(model_dir))
        self.model = cast_and_finish(model, self.dtype).eval()
        self.cpu_decoder = None  # the C decode step, for small decode-only batches
        if self.device.type == "cpu":
            keep_freed_heap_memory()
            if (config.cpu_decode_max_seqs and self.model.spec.c_step and not quantized(self.model)
                and self.kv_dtype == self.dtype):  # the C step: Llama's shape (or Qwen3's), a cache in the model's dtype
                from shoal.runtime.models.cpu_llama import CpuDecoder

                self.cpu_decoder = CpuDecoder.create(self.model, quantized=gguf_blocks(config, model_dir))  # before oneDNN packing drops the plain weights
        if self.cpu_decoder is not None:  # the same library runs the prefill's SwiGLU and attention
            c = self.cpu_decoder
            self.ops = SimpleNamespace(**vars(self.ops) | {"silu_and_mul": c.silu_and_mul,
                                                           "paged_attention_prefill": c.paged_attention_prefill})
        self.native_sampler = native_sampler() if self.device.type == "cpu" else None
        if pack_for_cpu(self.model):
            log.info("linear weights prepacked for oneDNN")
        self.lora_mapping, self.lora_layers = None, {}
        if config.enable_lora:
            self._install_lora(config.max_loras, config.max_lora_rank)
        self.kv_caches: list[torch.Tensor] = []  # per layer (layers of different KV-cache groups may share one)
        self.kv_tensors: list[torch.Tensor] = []  # each once
        self.workspaces: list | None = None  # the decode mirror (torch backend, CPU), per layer
        self.staging = Staging(self.device) if self.device.type != "cpu" else None
        self.graphs = None  # CUDA graphs of decode-only steps (cuda_graphs.py), captured with the KV cache
        self.last_tokens: torch.Tensor | None = None  # the last sampling step's tokens, where they were sampled

    def _install_lora(self, max_loras: int, max_rank: int) -> None:
        """A LoRA hook on every linear layer of this rank's decoder layers (layers/lora.py)."""
        from shoal.runtime.layers.lora import LoraLayer, LoraMapping

        if self.model.spec.mla:
            raise ValueError("LoRA adapters are not supported on DeepSeek's latent attention (MLA) models")
        self.lora_mapping = LoraMapping(max_loras)
        for index, layer in zip(self.model.layer_range, self.model.layers):
            attn, mlp = layer.self_attn, layer.mlp
            for name, module in (("qkv_proj", attn.qkv_proj), ("o_proj", attn.o_proj), ("gate_up_proj", mlp.gate_up_proj),
                                 ("down_proj", mlp.down_proj)):
                module.lora = self.lora_layers[index, name] = LoraLayer(module, self.lora_mapping, max_rank,
                                                                        self.ops.lora_delta, self.dtype, self.device)

    @torch.inference_mode()
    def set_lora(self, slot: int, weights: dict | None) -> None:
        """Write one adapter (lora_manager's weights: {(layer, module): per projection (A, B) or
        None}) into `slot` of every hook of this rank; layers it leaves out get zeros."""
        for (index, name), hook in self.lora_layers.items():
            module = self.model.layers[index - self.model.layer_range.start]
            module = module.self_attn if name in ("qkv_proj", "o_proj") else module.mlp
            hook.set_slot(getattr(module, name), slot, (weights or {}).get((index, name)))

    @property
    def pipelined(self) -> bool:
        """A GPU runs behind the host: with --batches-in-flight 2 the engine prepares one batch
        while the device runs the other (execute_async)."""
        return self.device.type == "cuda"

    def kv_bytes_per_block(self) -> int:
        m = self.model  # a block holds a page in each KV tensor: one per layer, fewer with sliding windows (kv_groups.py)
        return m.kv_planes * m.num_kv_tensors * self.config.block_size * m.num_kv_heads * m.head_dim * self.kv_dtype.itemsize

    def num_blocks_for(self, kv_cache_memory: float | None) -> int:
        if kv_cache_memory is None:
            if self.device.type == "cuda":
                kv_cache_memory = 0.9
            else:
                kv_cache_memory = DEFAULT_CPU_KV_BYTES
        if kv_cache_memory <= 1.0:
            if self.device.type != "cuda":
                raise ValueError("a fractional --kv-cache-memory needs a GPU; give bytes on CPU (e.g. 2GiB)")
            free, _ = torch.cuda.mem_get_info(self.device)
            kv_cache_memory = free * kv_cache_memory
        return int(kv_cache_memory // self.kv_bytes_per_block())

    def allocate_kv_cache(self, num_blocks: int) -> None:
        m = self.model
        # Stored [2, kvh, blocks, block_size, d], seen as [2, blocks, block_size, kvh, d]
        # (MLA: [1, 1, blocks, block_size, latent]: one plane, the latent serving as K and V)
        # (kernels/reference.py: a gather then yields each head's keys contiguous).
        # Zeroed, so that slots never written are never NaN (masked attention multiplies by 0).
        # On CPU one pool in huge pages: a decode step reads blocks scattered all over it.
        # One tensor per KV slot, each layer seeing its slot's (kv_groups.py; one per layer without windows).
        shape = (m.kv_planes, m.num_kv_heads, num_blocks, self.config.block_size, m.head_dim)
        n = m.num_kv_tensors
        if self.device.type == "cpu":
            pool = huge_page_zeros(n * math.prod(shape), self.kv_dtype).view(n, *shape)
            caches = list(pool.unbind(0))
        else:
            caches = [torch.zeros(shape, dtype=self.kv_dtype, device=self.device) for _ in range(n)]
        self.kv_tensors = [c.permute(0, 2, 3, 1, 4) for c in caches]
        self.kv_caches = [self.kv_tensors[slot] for slot in m.kv_slots]  # per layer
        if self.cpu_decoder is not None:
            self.cpu_decoder.attach(self.kv_caches)
        if (self.device.type == "cuda" and self.ops.backend == "triton" and not self.config.enforce_eager
                and self.state.tp_size * self.state.pp_size == 1):  # the torch reference reads lengths on the host
            self._capture_graphs(num_blocks)

    def _capture_graphs(self, num_blocks: int) -> None:
        from shoal.runtime.executor.cuda_graphs import DecodeGraphs

        max_blocks = min(-(-self.max_model_len // self.config.block_size), num_blocks)
        graphs = DecodeGraphs(self, self.config.max_num_seqs, max_blocks)
        try:
            graphs.capture()
        except Exception as e:  # a kernel that cannot be captured: run eagerly rather than not at all
            log.warning("CUDA graph capture failed, decode steps run eagerly: %s", e)
            return
        self.graphs = graphs
        log.info("captured CUDA graphs for decode batches of %s", graphs.sizes)

    @property
    def c_decode_max_seqs(self) -> int:
        """Decode-only steps of up to this many sequences run in C (0: none do)."""
        return self.config.cpu_decode_max_seqs if self.cpu_decoder is not None else 0

    def decode_planner(self, kv_cache_bytes: int) -> DecodeRows | None:
        """The workspace planner for the torch backend on CPU, at most twice the KV cache. None
        with the C decode step: it reads the paged cache in place, and the decodes of a mixed
        step would find every row it advanced stale (a reload costs what a gather does). None
        on a GPU, where the kernels read the paged cache in place."""
        if (self.ops.backend != "torch" or self.cpu_decoder is not None or self.device.type != "cpu" or self.model.windowed
                or self.kv_dtype != self.dtype  # the workspace mirrors a cache in the model's dtype
                or self.model.spec.mla):  # ... and of K and V planes
            return None
        m = self.model
        per_token = 2 * len(m.layers) * m.num_kv_heads * m.head_dim * self.kv_dtype.itemsize
        return DecodeRows(2 * kv_cache_bytes, per_token, m.num_kv_heads)

    def copy_block(self, src: int, dst: int) -> None:
        for cache in self.kv_tensors:
            cache[:, dst].copy_(cache[:, src])

    def _runs_in_c(self, step: StepInput, hidden) -> bool:
        """A decode-only step small enough for the C decoder."""
        nd = step.meta.num_decode_tokens
        return (hidden is None and nd == step.input_ids.shape[0] and 0 < nd <= self.c_decode_max_seqs
                and step.lora_slots is None)

    def to_device(self, step: StepInput) -> StepInput:
        """The step with every tensor on this runner's device: one copy on a GPU."""
        if self.staging is None:
            return step
        step, meta, sampling = self.staging.send_fields(step, step.meta, step.sampling)
        return dataclasses.replace(step, meta=meta, sampling=sampling)

    def sample(self, logits: torch.Tensor, sampling: SamplingMetadata) -> SampleResult:
        """Sample on the device; the tokens (and logprobs) come back in one transfer."""
        return self.sample_async(logits, sampling).result()

    def _sample(self, logits: torch.Tensor, sampling: SamplingMetadata):
        """The step's tokens, not yet read back; kept on the device for the next step's fill_rows
        (and for the histories that penalties read: history_fill)."""
        if sampling.history_fill is not None:
            rows, seen_cols, output_cols, prev = sampling.history_fill
            tokens = self.last_tokens[prev]
            if sampling.seen_ids is not None:
                sampling.seen_ids[rows, seen_cols] = tokens
            if sampling.output_ids is not None:
                sampling.output_ids[rows, output_cols] = tokens
            sampling.history_fill = None  # filled; per-row fallbacks (select) never see it
        sampled = sample_on_device(logits, sampling, self.native_sampler)
        self.last_tokens = sampled.tokens
        return sampled

    @torch.inference_mode()
    def sample_async(self, logits: torch.Tensor, sampling: SamplingMetadata):
        """Sample the logits of a step launched without its sampling metadata (execute_async
        returned them, still on the device): one copy in, the tokens not yet read back."""
        if self.staging is not None:
            (sampling,) = self.staging.send_fields(sampling)
        return self._sample(logits, sampling)

    def execute(self, step: StepInput, hidden=None, residual=None):
        """Run this rank's layers. Last stage: the sample rows' tokens (a SampleResult) when
        the step carries sampling metadata, else their logits [S, V] float32; other stages:
        (hidden, residual) for the next stage."""
        out = self._run(step, hidden, residual)
        return out.result() if step.sampling is not None and self.state.is_last_stage else out

    def execute_async(self, step: StepInput):
        """On a GPU: launch the step and return at once; .result() reads the sampled tokens back
        (waiting for the device), so the engine can prepare another batch meanwhile."""
        out = self._run(step)
        return out if step.sampling is not None else Finished(out)

    @torch.inference_mode()
    def _run(self, step: StepInput, hidden=None, residual=None):
        """Logits, (hidden, residual) on a middle stage, or the Sampled tokens when the step samples.
        A step that scores prompt rows runs eagerly in torch: the C decode step and the CUDA
        graphs give the sample rows' logits only, not every row's hidden state."""
        scoring = step.prompt_logprobs
        host_slots = step.lora_slots  # grouped by slot on the host (LoraMapping.set), before the copy
        step = self.to_device(step)
        if step.fill_rows is not None:  # async scheduling: the previous step's tokens, never read by the host
            step.input_ids[step.fill_rows[0]] = self.last_tokens[step.fill_rows[1]]
        if scoring is None and self._runs_in_c(step, hidden):
            m = step.meta
            logits = self.cpu_decoder.step(step.input_ids, step.positions, m.slot_mapping, m.decode_block_tables,
                                           m.decode_context_lens)[step.sample_rows]
            return logits if step.sampling is None else self._sample(logits, step.sampling)
        if scoring is None and self.graphs is not None and hidden is None and step.lora_slots is None and self.graphs.fits(step):
            logits = self.graphs.run(step)
            return logits if step.sampling is None else self._sample(logits, step.sampling)
        meta, dev = step.meta, self.device
        plan = meta.decode_plan
        if plan is not None and (plan.reset or self.workspaces is None):
            self.workspaces = None  # free the old mirror before allocating the new one
            m = self.model
            self.workspaces = [new_workspace(plan, m.num_kv_heads, m.head_dim, self.dtype, dev) for _ in m.layers]
        if self.lora_mapping is not None:
            self.lora_mapping.set(step.lora_slots, host_slots, grouped=self.ops.backend == "torch")
        layer_caches = list(zip(self.kv_caches, self.workspaces or [None] * len(self.kv_caches)))
        hidden, residual = self.model(self.ops, step.input_ids, step.positions, layer_caches, meta, hidden, residual)
        if not self.state.is_last_stage:
            return hidden, residual
        if scoring is not None:
            scoring.scores = score(self.model.compute_logits, hidden, scoring)
        logits = self.model.compute_logits(hidden[step.sample_rows]).float()
        return logits if step.sampling is None else self._sample(logits, step.sampling)
