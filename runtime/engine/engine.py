"""LLMEngine: the step loop that schedules, executes and updates (vLLM V1's engine core).

With pipeline parallelism the engine keeps one batch per stage in flight: each step
collects the oldest batch's logits (if it has any in the pipe), samples them, and hands
out the next batch of the same scheduler lane (scheduler.py) before returning. A batch's
computed counts and prefix blocks are booked when it is handed out, which is safe
because every stage runs the batches in the order they were sent.

With async scheduling (one process, on by default on a GPU) the engine keeps one step in
flight the same way: it launches step N+1, then reads step N's tokens (_step_overlapped).

Not thread-safe: one thread calls every method (the async server runs it in its own).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from shoal.runtime.cache.kv_cache_manager import KVCacheManager
from shoal.runtime.config import EngineConfig
from shoal.runtime.cpu_memory import release_freed_heap
from shoal.runtime.engine import bad_words, detokenizer, request_checks
from shoal.runtime.engine.lora_manager import LoraError, LoraManager
from shoal.runtime.engine.prompt_scoring import PromptScoring, prompt_scoring
from shoal.runtime.engine.request import Request, RequestOutput, Sequence, Status
from shoal.runtime.engine.scheduler import ScheduledBatch, Scheduler
from shoal.runtime.executor.executor import make_executor
from shoal.runtime.engine.structured_output import StructuredOutputs, pack_ids
from shoal.runtime.engine.step_input import pad_rows, prepare, sampling_metadata
from shoal.runtime.layers.sampler import Finished, SampleResult
from shoal.runtime.models.families import spec_of
from shoal.runtime.models.kv_groups import kv_cache_groups
from shoal.runtime.models.loader import load_config, load_tokenizer, resolve_model
from shoal.runtime.sampling_params import SamplingParams

log = logging.getLogger(__name__)


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    prompt_tokens: int
    generation_tokens: int
    num_preemptions: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    lora: "LoraStats | None" = None  # with --enable-lora


@dataclass
class LoraStats:
    """vLLM's vllm:lora_requests_info labels, and the counters beside them."""

    running: list[str]  # adapters of running sequences
    waiting: list[str]  # adapters of waiting ones
    max_lora: int
    loads: int  # adapters written into a device slot
    slots: list[str]  # adapters in the device slots (a router's LoRA affinity)
    requests: dict[str, int]  # requests each adapter served


def eos_token_ids(model_dir, tokenizer) -> list[int]:
    """The generation config's EOS ids (what transformers' generate stops on), else the tokenizer's."""
    from transformers import GenerationConfig

    ids = []
    try:
        eos = GenerationConfig.from_pretrained(model_dir).eos_token_id
        ids = eos if isinstance(eos, list) else [eos] if eos is not None else []
    except OSError:
        pass
    if not ids and tokenizer.eos_token_id is not None:
        ids = [tokenizer.eos_token_id]
    return ids


@dataclass
class InFlight:
    targets: list[Sequence]  # who samples from the batch's logits rows, in order
    pending: object  # the executor's PendingStep: .result() waits for the sampled tokens
    scoring: PromptScoring | None = None  # its prompt rows (prompt_logprobs), scored beside
    # launched without its sampling, which reads the previous step's tokens on the host
    # (async scheduling: LLMEngine._sample_launched)
    sample_later: bool = False

    def rows(self) -> dict[Sequence, int]:
        """Each target's row in the batch's sampled tokens."""
        return {seq: i for i, seq in enumerate(self.targets)}


def batches_in_flight(config: EngineConfig, executor) -> int:
    """One batch per pipeline stage unless config.batches_in_flight says otherwise (1 = serial)."""
    if not executor.pipelined:
        return 1
    return config.batches_in_flight or config.pipeline_parallel_size


def async_scheduling(asked: bool | None, able: bool, pipelined: bool) -> bool:
    """Whether each step is scheduled before the previous one's tokens are read: as asked, by
    default where the device runs behind the host (a GPU, one process). On a CPU it gains
    nothing (the same cores run both halves), but it works the same."""
    if asked and not able:
        raise ValueError("async scheduling needs one process and one batch in flight "
                         "(not tensor or pipeline parallelism, nor --batches-in-flight > 1)")
    return able and (pipelined if asked is None else asked)


class LLMEngine:
    def __init__(self, config: EngineConfig, detokenize: bool = True):
        self.config = config
        # False: token ids only, no text and no stop strings, and step() returns the Requests it
        # advanced instead of building their outputs; the client detokenizes (core_process.py)
        self.detokenize = detokenize
        self.load_times: dict[str, float] = {}
        t = time.perf_counter()
        self.model_dir = resolve_model(config.model)
        self.hf_config = load_config(self.model_dir)
        self.tokenizer = load_tokenizer(self.model_dir)
        self.eos_ids = eos_token_ids(self.model_dir, self.tokenizer)
        self.vocab_size = self.hf_config.vocab_size
        model_len = config.max_model_len or self.hf_config.max_position_embeddings
        self.structured = StructuredOutputs(self.tokenizer, self.vocab_size, self.eos_ids)
        self.executor = make_executor(config, self.hf_config, self.model_dir, model_len)
        self.load_times["load"] = time.perf_counter() - t

        t = time.perf_counter()
        num_blocks = self.executor.num_blocks_for(config.kv_cache_memory)
        self.executor.allocate_kv_cache(num_blocks)
        self.block_size = config.block_size
        groups = kv_cache_groups(spec_of(self.hf_config).windows)  # full and sliding-window layers' block tables
        self.kv = KVCacheManager(num_blocks, self.block_size, config.enable_prefix_caching, [g.window for g in groups])
        self.num_lanes = batches_in_flight(config, self.executor)
        self.lora = None  # the LoRA adapters' registry and device slots (lora_manager.py)
        if config.enable_lora:
            self.lora = LoraManager(self.hf_config, config.max_loras, config.max_lora_rank, config.max_cpu_loras)
            for module in config.lora_modules:
                self.lora.add(module["name"], module["path"], module.get("base_model_name"))
        self.scheduler = Scheduler(self.kv, config.max_num_seqs, config.max_num_batched_tokens,
                                   config.scheduling_policy, self.num_lanes, self.lora)
        self._lane = 0
        self._in_flight: dict[int, InFlight] = {}  # lane -> its batch in the pipe
        # one process that fills inputs on its device, one batch in flight: async scheduling can run
        self.can_overlap = self.executor.overlaps_steps and self.num_lanes == 1
        self.overlap = async_scheduling(config.async_scheduling, self.can_overlap, self.executor.pipelined)
        capacity = self.kv.max_tokens()  # num_blocks * block_size but for sliding windows
        if capacity is not None and model_len > capacity:
            log.warning("max_model_len %d exceeds the KV cache's %d tokens; capping it", model_len, capacity)
        self.max_model_len = model_len if capacity is None else min(model_len, capacity)
        self.decode_rows = self.executor.decode_planner(num_blocks * self.executor.kv_bytes_per_block())
        self.load_times["kv_cache"] = time.perf_counter() - t
        log.info("KV cache: %d blocks of %d tokens (%.2f GiB)", num_blocks, self.block_size,
                 num_blocks * self.executor.kv_bytes_per_block() / 2**30)

        self.requests: dict[str, Request] = {}
        self.prompt_tokens = 0
        self.generation_tokens = 0
        t = time.perf_counter()
        self._warm_up()
        self.load_times["warmup"] = time.perf_counter() - t
        if torch.device(self.config.device).type == "cpu":
            release_freed_heap()  # the loader's temporaries

    # -- requests -----------------------------------------------------------------------

    def tokenize(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        return request_checks.tokenize(self.tokenizer, self.vocab_size, prompt)

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams, arrival_time: float | None = None,
                    lora: str | None = None) -> None:
        """`lora`: the name of a loaded LoRA adapter to run the request with (None: the base model)."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        adapter = None
        if lora is not None:
            if self.lora is None:
                raise LoraError("LoRA adapters are not enabled on this server (--enable-lora)")
            adapter = self.lora.get(lora)
        text, ids = request_checks.check_request(self.tokenizer, self.vocab_size, self.max_model_len, self.executor.scores_prompts,
                                                 prompt, params)
        request = Request(request_id, text, ids, params, arrival_time or time.time())
        if adapter is not None:
            request.lora, request.cache_salt = adapter, adapter.cache_salt
            self.lora.started(adapter)
        request.max_len = self.max_model_len if params.max_tokens is None else min(len(ids) + params.max_tokens, self.max_model_len)
        if params.structured_outputs is not None:
            request.grammar = self.structured.compile(params.structured_outputs)  # cached when the server compiled it
        if params.allowed_token_ids:
            request.allowed_mask = pack_ids(params.allowed_token_ids, self.vocab_size)
        if params.bad_words:
            request.bad_words = bad_words.token_sequences(self.tokenizer, params.bad_words)
        detokenizer.start(request.seqs[0])
        self.requests[request_id] = request
        self.scheduler.add(request.seqs[0])

    def abort_request(self, request_id: str) -> None:
        request = self.requests.pop(request_id, None)
        if request is None:
            return
        self._ended(request)
        for seq in request.seqs:
            if not seq.finished:
                seq.finish_reason = "abort"
                self.scheduler.remove(seq)  # its blocks may still be written by a batch in the pipe: harmless, in order
        if not self.requests:
            self._drain()

    def stop_sequence(self, request_id: str, index: int, stop_reason) -> None:
        """Finish one sequence of a request as its client found a stop string in its text (the
        client detokenizes); the request ends when its last sequence does."""
        request = self.requests.get(request_id)
        if request is None or index >= len(request.seqs) or request.seqs[index].finished:
            return
        self._finish(request.seqs[index], "stop", stop_reason)
        if request.finished:
            self.abort_request(request_id)  # nothing running is left: this only forgets it

    def _ended(self, request: Request) -> None:
        if request.lora is not None:
            self.lora.ended(request.lora)

    # -- LoRA adapters ------------------------------------------------------------------

    def add_lora(self, name: str, path: str, base_model_name: str | None = None) -> None:
        """Load a PEFT adapter under `name` (LoraError: why not); it reaches the device when a
        request first needs it."""
        if self.lora is None:
            raise LoraError("LoRA adapters are not enabled on this server (--enable-lora)")
        self.lora.add(name, path, base_model_name)

    def load_lora(self, name: str, path: str, replace: bool = False) -> None:
        """add_lora; with `replace`, an adapter already under `name` gives way, once the new one
        has been read (a bad new one leaves the old in place)."""
        if replace and self.lora is not None and name in self.lora.adapters:
            self.lora.read(path)
            self.remove_lora(name)
        self.add_lora(name, path)

    def lora_names(self) -> dict[str, str]:
        """The adapters loaded now: name -> path (the server reads it from its event loop: one copy)."""
        return {a.name: a.path for a in list(self.lora.adapters.values())} if self.lora is not None else {}

    def remove_lora(self, name: str) -> None:
        """Unload an adapter: new requests cannot name it; those already in finish with it."""
        if self.lora is None:
            raise LoraError("LoRA adapters are not enabled on this server (--enable-lora)")
        self.lora.remove(name)

    def set_async_scheduling(self, on: bool) -> list[RequestOutput]:
        """Turn async scheduling on or off between steps (a benchmark compares both in one
        run). Returns the outputs of the step still in flight, which it reads back first."""
        on = async_scheduling(on, self.can_overlap, self.executor.pipelined)
        outputs = self._collect_in_flight(0) if self.overlap and self._in_flight else []
        self.overlap = on
        return outputs

    def group_ready(self) -> bool:
        """Every rank of the model's group joined, loaded and alive."""
        return self.executor.group_ready()

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def stats(self) -> EngineStats:
        s = self.scheduler
        lora = None
        if self.lora is not None:
            waiting = sorted({seq.request.lora.name for seq in s.waiting if seq.request.lora is not None})
            lora = LoraStats(running=sorted(set(self.lora.running())), waiting=waiting, max_lora=self.lora.max_loras,
                             loads=self.lora.num_loads, slots=[a.name for a in self.lora.slots if a is not None and not a.removed],
                             requests={a.name: a.num_requests for a in self.lora.adapters.values()})
        return EngineStats(len(s.running), len(s.waiting), self.kv.usage(), self.prompt_tokens, self.generation_tokens,
                           s.num_preemptions, self.kv.prefix_queries, self.kv.prefix_hits, lora)

    @property
    def pool(self):
        """The block pool, for inspection (tests, benchmarks): only the KV-cache manager changes it."""
        return self.kv.pool

    # -- the step -----------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        if self.overlap:
            return self._step_overlapped()
        lane, self._lane = self._lane, (self._lane + 1) % self.num_lanes
        outputs = self._collect_in_flight(lane) if lane in self._in_flight else []
        batch = self.scheduler.schedule(lane)
        if batch:
            flight = self._launch(batch)
            if self.num_lanes > 1:
                self._in_flight[lane] = flight
            else:
                outputs = self._collect_flight(flight)
        if not self.requests:
            self._drain()
        return outputs

    def _step_overlapped(self) -> list[RequestOutput]:
        """Async scheduling (vLLM's): step N+1 is scheduled, prepared and launched before step
        N's tokens are read, so the host's work runs while the device computes. A sequence in
        step N decodes in N+1 the token N is still sampling (Sequence.num_pending), filled in
        on the device; one that N ends has its N+1 row wasted and dropped. A batch whose
        sampling reads N's tokens on the host (bad words, a grammar) runs its forward at once and
        its sampling once N is read: the device computes N+1 while the host collects N."""
        prev = self._in_flight.pop(0, None)
        outputs, flight = [], None
        batch = self.scheduler.schedule()
        if batch:
            flight = self._in_flight[0] = self._launch(batch, prev)
        if prev is not None:
            outputs = self._collect_flight(prev)  # waits for step N only; N+1 is queued behind it
        if flight is not None and flight.sample_later:
            self._sample_launched(flight)
        if not self.requests:
            self._drain()
        return outputs

    def _sample_launched(self, flight: InFlight) -> None:
        """Sample a step whose forward is running, now that the previous step's tokens are in
        its sequences (its tokens count as in flight from here)."""
        logits = flight.pending.result()  # on the device, not read back
        sampling = sampling_metadata(flight.targets, self.eos_ids, self.vocab_size, self.structured)
        flight.pending = self.executor.sample_async(logits, sampling)
        flight.sample_later = False
        for seq in flight.targets:
            seq.num_pending += 1

    def _launch(self, batch: ScheduledBatch, prev: InFlight | None = None) -> InFlight:
        """Prepare a scheduled batch and hand it to the executor; its computed counts are
        booked at once. `prev`: the step still in flight whose tokens this one reads."""
        plan = self.decode_rows.plan(batch, pad_rows) if self.decode_rows else None  # may reorder decodes
        rows, targets = self._sample_targets(batch)
        prev_rows = prev.rows() if prev is not None else None
        if self.lora is not None:  # adapters the scheduler just gave a slot reach the device first
            for slot, weights in self.lora.take_loads():
                self.executor.set_lora(slot, weights)
        step = prepare(batch, rows, self.block_size, self.kv.tables, plan, prev_rows)
        # a row that reads its tokens on the host (bad words, a grammar) with one still in flight
        sample_later = prev is not None and any(seq.num_pending and seq.request.needs_history for seq in targets)
        if targets and not sample_later:
            step.sampling = sampling_metadata(targets, self.eos_ids, self.vocab_size, self.structured, prev_rows)
        scoring = prompt_scoring(batch)
        step.prompt_logprobs = scoring.rows if scoring else None
        if self.num_lanes > 1 or self.overlap:
            pending = self.executor.execute_async(step)
        else:
            pending = Finished(self.executor.execute(step))
        self.scheduler.after_step(batch)
        if not sample_later:
            for seq in targets:
                seq.num_pending += 1
        return InFlight(targets, pending, scoring, sample_later)

    def _drain(self) -> None:
        """Nothing left to serve: wait for what is still in the pipe (all of it finished or aborted)."""
        while self._in_flight:
            self._collect_in_flight(next(iter(self._in_flight)))

    def _collect_in_flight(self, lane: int) -> list[RequestOutput]:
        return self._collect_flight(self._in_flight.pop(lane))

    def _collect_flight(self, flight: InFlight) -> list[RequestOutput]:
        return self._collect(flight.targets, flight.pending.result(), flight.scoring)

    def _collect(self, targets: list[Sequence], result: SampleResult | None, scoring: PromptScoring | None = None) -> list[RequestOutput]:
        """Append a batch's sampled tokens to its sequences (and its prompt scores to theirs)."""
        if scoring is not None:
            scoring.collect(self.tokenizer)
        if not targets:
            return []
        now = time.time()
        touched: dict[str, Request] = {}
        failed, token_ids, chosen = result.failed, result.token_ids, result.chosen_logprobs
        rows_logprobs = result.logprobs
        append, finished = self._append, Status.FINISHED
        appended = 0
        for i, seq in enumerate(targets):  # the hot loop of a step: plain attributes, no properties
            seq.num_pending -= 1
            request = seq.request
            if failed and i in failed:  # this request's values broke its sampling: it fails alone
                self._fail(seq, failed[i])
                touched[request.request_id] = request
                continue
            status = seq.status
            if status is finished:  # aborted while its batch was in the pipe
                continue
            if seq.awaits_fork:
                self._fork(seq)
            if seq.index == 0 and len(seq.token_ids) == seq.num_prompt_tokens:
                self.prompt_tokens += seq.num_prompt_tokens
            if rows_logprobs is None:
                append(seq, token_ids[i], None, 0.0)
            else:
                append(seq, token_ids[i], rows_logprobs[i], chosen[i])
            appended += 1
            touched[request.request_id] = request
        self.generation_tokens += appended
        outputs = []
        for request in touched.values():
            m = request.metrics
            if m.first_token_time is None:
                m.first_token_time = now
            m.last_token_time = now
            if request.finished:
                m.finished_time = now
                if self.requests.pop(request.request_id, None) is not None:
                    self._ended(request)
            if not self.detokenize:  # its client reads the sequences' new tokens (core_process.py)
                outputs.append(request)
            elif (out := request.output()) is not None:
                outputs.append(out)
        return outputs

    def _fail(self, seq: Sequence, message: str) -> None:
        """Finish every sequence of the request with finish_reason 'error'."""
        for s in seq.request.seqs:
            if not s.finished:
                self._finish(s, "error", message)

    def _sample_targets(self, batch: ScheduledBatch) -> tuple[list[int], list[Sequence]]:
        """Which flat rows sample, for which sequence. A request with n > 1 forks when its
        prompt is done: its siblings sample from the same row, then share its blocks."""
        rows, targets, end = [], [], 0
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            end += n
            if not batch.samples(seq, n):
                continue
            rows.append(end - 1)
            targets.append(seq)
            request = seq.request
            if not request.forked:
                for index in range(1, request.params.n):
                    child = Sequence(request, index, request.prompt_token_ids)
                    child.awaits_fork = True
                    detokenizer.start(child)
                    request.seqs.append(child)
                    rows.append(end - 1)
                    targets.append(child)
        return rows, targets

    def _fork(self, child: Sequence) -> None:
        child.awaits_fork = False
        parent = child.request.seqs[0]
        if parent.finished or not self.kv.can_fork(parent):
            self.scheduler.add(child)  # no blocks to share: recompute the prompt later
            return
        for src, dst in self.kv.fork(parent, child):  # the partial last block, in each KV-cache group
            self.executor.copy_block(src, dst)
        self.scheduler.add_running(child, parent.lane)

    def _append(self, seq: Sequence, token: int, logprobs: dict | None, logprob: float) -> None:
        seq.token_ids.append(token)
        if seq.logprobs is not None:
            seq.logprobs.append(logprobs)
            seq.cumulative_logprob += logprob
        params = seq.request.params
        num_output = len(seq.token_ids) - seq.num_prompt_tokens
        may_stop = num_output >= params.min_tokens
        eos = may_stop and not params.ignore_eos and token in self.eos_ids
        stop_token = may_stop and not eos and token in params.stop_token_ids
        # an EOS or stop token ends the text without its own (unless asked for), as vLLM's detokenizer
        seq.drop_last_text = (eos or stop_token) and not params.include_stop_str_in_output
        # text each step only when someone reads it: stop strings, or outputs before the end
        stop = params.stop
        delta = ""
        if self.detokenize and (stop or params.output_kind != "final_only") and not seq.drop_last_text:
            delta = detokenizer.append_text(self.tokenizer, seq)
        if seq.matcher is not None:  # the grammar decides when the text ends (min_tokens, ignore_eos too)
            if not seq.matcher.accept_token(token):
                self._finish(seq, "error", None)
                log.error("request %s: token %d does not follow its grammar", seq.request.request_id, token)
                return
            if seq.matcher.is_terminated():
                self._finish(seq, "stop", None)
                return
        if eos:
            return self._finish(seq, "stop", None)
        if stop_token:
            return self._finish(seq, "stop", token)
        if may_stop and stop and self.detokenize and (matched := detokenizer.find_stop(seq, delta)) is not None:
            return self._finish(seq, "stop", matched)
        if (params.max_tokens is not None and num_output >= params.max_tokens) or len(seq.token_ids) >= self.max_model_len:
            self._finish(seq, "length", None)

    def _finish(self, seq: Sequence, reason: str, stop_reason) -> None:
        seq.finish_reason, seq.stop_reason = reason, stop_reason
        self.scheduler.remove(seq)
        if self.detokenize and not seq.params.stop and seq.params.output_kind == "final_only":  # all of its text, once
            detokenizer.append_text(self.tokenizer, seq, final=True, end=len(seq.token_ids) - seq.drop_last_text)

    def warm_up_lengths(self, full: bool) -> list[int]:
        """Prompt lengths of the warm-up requests. A short one always; with `full` (on a GPU)
        a spread that makes Triton compile the kernels' variants before the first request
        does: it specializes integer arguments on == 1 and on divisibility by 16 (batch
        sizes, block-table strides), and the decode kernel on its number of splits, which
        grows with the context. Chunked prefill (a prompt over the token budget) adds
        prefills over a cached prefix, and the whole set runs as one mixed batch."""
        top = min(self.max_model_len - 3, 4096)  # a 128k context is not prefilled at start-up
        lengths = [16] if not full else [1, 7, 16, 33, 100, 300, 1000, self.config.max_num_batched_tokens + 37, top]
        return sorted({max(1, min(n, top)) for n in lengths})

    def _warm_up(self, full: bool | None = None) -> None:
        """Warm-up requests (warm_up_lengths), so the first real request pays no first-call costs."""
        if full is None:
            full = torch.device(self.config.device).type == "cuda"
        greedy = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
        sampled = SamplingParams(max_tokens=2, temperature=0.8, top_p=0.9, top_k=20, seed=0, logprobs=2, ignore_eos=True)
        for i, n in enumerate(self.warm_up_lengths(full)):
            self.add_request(f"__warmup_{i}__", [1 + t % (self.vocab_size - 1) for t in range(n)], sampled if i % 2 else greedy)
            if full and i == 0:  # a batch of one alone first (Triton specializes == 1)
                while self.has_unfinished_requests():
                    self.step()
        while self.has_unfinished_requests():
            self.step()
        self.kv.reset_prefix_cache()
        self.prompt_tokens = self.generation_tokens = self.scheduler.num_preemptions = 0

    def shutdown(self) -> None:
        self.executor.shutdown()
