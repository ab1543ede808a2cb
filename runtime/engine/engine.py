"""LLMEngine: the step loop that schedules, executes and updates (vLLM V1's engine core).

With pipeline parallelism the engine keeps one batch per stage in flight: each step
collects the oldest batch's logits (if it has any in the pipe), samples them, and hands
out the next batch of the same scheduler lane (scheduler.py) before returning. A batch's
computed counts and prefix blocks are booked when it is handed out, which is safe
because every stage runs the batches in the order they were sent.

Not thread-safe: one thread calls every method (the async server runs it in its own).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from shoal.runtime.cache.block_pool import BlockPool
from shoal.runtime.config import EngineConfig
from shoal.runtime.engine import detokenizer
from shoal.runtime.engine.request import Request, RequestOutput, Sequence, Status
from shoal.runtime.engine.scheduler import ScheduledBatch, Scheduler
from shoal.runtime.executor.executor import make_executor
from shoal.runtime.executor.model_runner import pad_rows
from shoal.runtime.executor.model_runner import prepare
from shoal.runtime.layers.sampler import SampleResult, sample
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
    pending: object  # the executor's PendingStep: .result() waits for the logits


def batches_in_flight(config: EngineConfig, executor) -> int:
    """One batch per pipeline stage unless config.batches_in_flight says otherwise (1 = serial)."""
    if not hasattr(executor, "execute_async"):
        return 1
    return config.batches_in_flight or config.pipeline_parallel_size


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.load_times: dict[str, float] = {}
        t = time.perf_counter()
        self.model_dir = resolve_model(config.model)
        self.hf_config = load_config(self.model_dir)
        self.tokenizer = load_tokenizer(self.model_dir)
        self.eos_ids = eos_token_ids(self.model_dir, self.tokenizer)
        self.vocab_size = self.hf_config.vocab_size
        model_len = config.max_model_len or self.hf_config.max_position_embeddings
        self.executor = make_executor(config, self.hf_config, self.model_dir, model_len)
        self.load_times["load"] = time.perf_counter() - t

        t = time.perf_counter()
        num_blocks = self.executor.num_blocks_for(config.kv_cache_memory)
        self.executor.allocate_kv_cache(num_blocks)
        self.block_size = config.block_size
        self.pool = BlockPool(num_blocks, config.enable_prefix_caching)
        self.num_lanes = batches_in_flight(config, self.executor)
        self.scheduler = Scheduler(self.pool, self.block_size, config.max_num_seqs, config.max_num_batched_tokens,
                                   config.scheduling_policy, self.num_lanes)
        self._lane = 0
        self._in_flight: dict[int, InFlight] = {}  # lane -> its batch in the pipe
        capacity = num_blocks * self.block_size
        if model_len > capacity:
            log.warning("max_model_len %d exceeds the KV cache's %d tokens; capping it", model_len, capacity)
        self.max_model_len = min(model_len, capacity)
        planner = getattr(self.executor, "decode_planner", None)
        self.decode_rows = planner(num_blocks * self.executor.kv_bytes_per_block()) if planner else None
        self.load_times["kv_cache"] = time.perf_counter() - t
        log.info("KV cache: %d blocks of %d tokens (%.2f GiB)", num_blocks, self.block_size,
                 num_blocks * self.executor.kv_bytes_per_block() / 2**30)

        self.requests: dict[str, Request] = {}
        self.prompt_tokens = 0
        self.generation_tokens = 0
        t = time.perf_counter()
        self._warm_up()
        self.load_times["warmup"] = time.perf_counter() - t

    # -- requests -----------------------------------------------------------------------

    def tokenize(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty")
            return prompt, self.tokenizer(prompt).input_ids
        ids = list(prompt)
        if not ids:
            raise ValueError("prompt is empty")
        bad = [t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token id {bad[0]!r} is outside the vocabulary [0, {self.vocab_size})")
        return None, ids

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams, arrival_time: float | None = None) -> None:
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if not isinstance(params, SamplingParams):
            raise ValueError("params must be a SamplingParams")
        params.validate()
        text, ids = self.tokenize(prompt)
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"prompt has {len(ids)} tokens; the model's context is {self.max_model_len} (max_model_len), "
                "which leaves no room to generate"
            )
        bad_stop = [t for t in params.stop_token_ids if not 0 <= t < self.vocab_size]
        if bad_stop:
            raise ValueError(f"stop_token_ids holds {bad_stop[0]}, outside the vocabulary")
        request = Request(request_id, text, ids, params, arrival_time or time.time())
        detokenizer.start(request.seqs[0])
        self.requests[request_id] = request
        self.scheduler.add(request.seqs[0])

    def abort_request(self, request_id: str) -> None:
        request = self.requests.pop(request_id, None)
        if request is None:
            return
        for seq in request.seqs:
            if not seq.finished:
                seq.finish_reason = "abort"
                self.scheduler.remove(seq)  # its blocks may still be written by a batch in the pipe: harmless, in order
        if not self.requests:
            self._drain()

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def stats(self) -> EngineStats:
        s = self.scheduler
        return EngineStats(len(s.running), len(s.waiting), self.pool.usage(), self.prompt_tokens, self.generation_tokens,
                           s.num_preemptions, s.prefix_queries, s.prefix_hits)

    # -- the step -----------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        lane, self._lane = self._lane, (self._lane + 1) % self.num_lanes
        outputs = self._collect_in_flight(lane) if lane in self._in_flight else []
        batch = self.scheduler.schedule(lane)
        if batch:
            plan = self.decode_rows.plan(batch, pad_rows) if self.decode_rows else None  # may reorder decodes
            rows, targets = self._sample_targets(batch)
            step = prepare(batch, rows, self.block_size, plan)
            if self.num_lanes > 1:
                self._in_flight[lane] = InFlight(targets, self.executor.execute_async(step))
                self.scheduler.after_step(batch)
            else:
                logits = self.executor.execute(step)
                self.scheduler.after_step(batch)
                outputs = self._collect(targets, logits)
        if not self.requests:
            self._drain()
        return outputs

    def _drain(self) -> None:
        """Nothing left to serve: wait for what is still in the pipe (all of it finished or aborted)."""
        while self._in_flight:
            self._collect_in_flight(next(iter(self._in_flight)))

    def _collect_in_flight(self, lane: int) -> list[RequestOutput]:
        flight = self._in_flight.pop(lane)
        return self._collect(flight.targets, flight.pending.result())

    def _collect(self, targets: list[Sequence], logits) -> list[RequestOutput]:
        """Sample a batch's logits and append the tokens to its sequences."""
        try:
            result = sample(logits, targets, self.eos_ids)
        except Exception:  # noqa: BLE001 - one request's values broke the batch: find it, fail it alone
            result = self._sample_rows(logits, targets)
        failed: dict[str, str] = getattr(result, "failed", None) or {}
        now = time.time()
        touched: dict[str, Request] = {}
        for i, seq in enumerate(targets):
            if seq.request.request_id in failed:
                self._fail(seq, failed[seq.request.request_id])
                touched[seq.request.request_id] = seq.request
                continue
            if seq.finished:  # aborted while its batch was in the pipe
                continue
            if seq.status is Status.WAITING and seq.index > 0 and not seq.block_table:
                self._fork(seq)
            if seq.index == 0 and seq.num_output_tokens == 0:
                self.prompt_tokens += seq.num_prompt_tokens
            logprobs = result.logprobs[i] if result.logprobs is not None else None
            self._append(seq, result.token_ids[i], logprobs, result.chosen_logprobs[i] if logprobs is not None else 0.0)
            self.generation_tokens += 1
            touched[seq.request.request_id] = seq.request
        outputs = []
        for request in touched.values():
            m = request.metrics
            m.first_token_time = m.first_token_time or now
            m.last_token_time = now
            if request.finished:
                m.finished_time = now
                self.requests.pop(request.request_id, None)
            outputs.append(request.output())
        return outputs

    def _sample_rows(self, logits, targets: list[Sequence]) -> SampleResult:
        """Batched sampling raised: sample row by row; the requests whose rows raise go to
        .failed (request id -> message) and finish with finish_reason 'error'."""
        tokens, lps, chosen, failed = [], [], [], {}
        for i, seq in enumerate(targets):
            try:
                r = sample(logits[i : i + 1], [seq], self.eos_ids)
            except Exception as e:  # noqa: BLE001
                log.exception("sampling failed for request %s", seq.request.request_id)
                failed[seq.request.request_id] = f"sampling failed: {type(e).__name__}: {e}"
                r = SampleResult([0], None, None)
            tokens.append(r.token_ids[0])
            lps.append(r.logprobs[0] if r.logprobs is not None else {})
            chosen.append(r.chosen_logprobs[0] if r.chosen_logprobs is not None else 0.0)
        result = SampleResult(tokens, lps, chosen)
        result.failed = failed
        return result

    def _fail(self, seq: Sequence, message: str) -> None:
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
                    detokenizer.start(child)
                    request.seqs.append(child)
                    rows.append(end - 1)
                    targets.append(child)
        return rows, targets

    def _fork(self, child: Sequence) -> None:
        parent = child.request.seqs[0]
        full = parent.num_prompt_tokens // self.block_size
        partial = parent.num_prompt_tokens % self.block_size
        if parent.finished or (partial and self.pool.num_free == 0):
            self.scheduler.add(child)  # no blocks to share: recompute the prompt later
            return
        shared = parent.block_table[:full]
        self.pool.share(shared)
        child.block_table = shared + (self.pool.allocate(1) if partial else [])
        if partial:
            self.executor.copy_block(parent.block_table[full], child.block_table[-1])
        child.block_hashes = parent.block_hashes[:full]
        child.num_registered = min(parent.num_registered, full)
        child.num_computed = parent.num_prompt_tokens
        child.status = Status.RUNNING
        child.lane = parent.lane
        self.scheduler.running.append(child)

    def _append(self, seq: Sequence, token: int, logprobs: dict | None, logprob: float) -> None:
        seq.token_ids.append(token)
        if seq.logprobs is not None:
            seq.logprobs.append(logprobs)
            seq.cumulative_logprob += logprob
        params = seq.params
        delta = detokenizer.append_text(self.tokenizer, seq)
        may_stop = seq.num_output_tokens >= params.min_tokens
        if may_stop and not params.ignore_eos and token in self.eos_ids:
            self._finish(seq, "stop", None)
        elif may_stop and token in params.stop_token_ids:
            self._finish(seq, "stop", token)
        elif may_stop and params.stop and (stop := detokenizer.find_stop(seq, delta)) is not None:
            self._finish(seq, "stop", stop)
        elif (params.max_tokens is not None and seq.num_output_tokens >= params.max_tokens) or len(seq.token_ids) >= self.max_model_len:
            self._finish(seq, "length", None)

    def _finish(self, seq: Sequence, reason: str, stop_reason) -> None:
        seq.finish_reason, seq.stop_reason = reason, stop_reason
        self.scheduler.remove(seq)

    def _warm_up(self) -> None:
        """One short prefill and a decode, so the first real request pays no first-call costs."""
        params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
        n = min(16, self.max_model_len - 2)
        self.add_request("__warmup__", list(range(1, n + 1)), params)
        while self.has_unfinished_requests():
            self.step()
        self.pool.reset_prefix_cache()
        self.prompt_tokens = self.generation_tokens = 0
        self.scheduler.prefix_queries = self.scheduler.prefix_hits = 0

    def shutdown(self) -> None:
        close = getattr(self.executor, "shutdown", None)
        if close:
            close()
