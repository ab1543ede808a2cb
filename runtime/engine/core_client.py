"""CoreClient: the API process's side of the engine-core process (core_process.py).

It has the LLMEngine methods AsyncEngine calls (add_request, abort_request, step, stats,
has_unfinished_requests, load_lora/remove_lora, ...), so AsyncEngine runs it on its thread
in the engine's place and nothing above changes. step() receives the core's next message
(by then the core is running the step after it: the overlap), appends the new tokens to a
mirror of each request (request.py's Request and Sequence), detokenizes them and checks
stop strings here, then builds the RequestOutputs the engine would have.

A stop string found here ends the sequence at once (finish_reason "stop", stop_reason the
string) and tells the core to stop it; tokens the core made meanwhile are dropped (vLLM
V1's behaviour). Stats, the prefix cache's block events and the LoRA adapters' names are
read from the core's messages. If the core dies, step() raises and AsyncEngine fails.
"""

from __future__ import annotations

import atexit
import dataclasses
import itertools
import logging
import multiprocessing
import time
import weakref

from shoal.runtime.cache.block_mirror import BlockMirror
from shoal.runtime.engine import core_process, detokenizer, request_checks
from shoal.runtime.engine.lora_manager import LoraError
from shoal.runtime.engine.request import CompletionOutput, Request, RequestOutput, Sequence, Status

log = logging.getLogger("shoal.core_client")


class CoreDied(RuntimeError):
    pass


def _end_at_exit(ref) -> None:
    """A client its owner never shut down ends its core when the interpreter exits: before
    multiprocessing's own exit hook (registered earlier, so run later) joins the core, which
    would wait forever, since the core ends when our end of the pipe closes."""
    client = ref()
    if client is not None:
        client.shutdown()


class CoreClient:
    def __init__(self, config):
        from shoal.runtime.engine.structured_output import StructuredOutputs
        from shoal.runtime.models.loader import load_tokenizer, resolve_model

        self.config = config
        ctx = multiprocessing.get_context("spawn")
        core_in, self._send_conn = ctx.Pipe(duplex=False)
        self._recv_conn, core_out = ctx.Pipe(duplex=False)
        # not a daemon: a daemon may not start processes (tensor-parallel ranks); it ends on
        # "shutdown" or when our end of its pipe closes (our exit, even a killed one)
        self.process = ctx.Process(target=core_process.main, args=(core_in, core_out, config), name="shoal-engine-core")
        self.process.start()
        atexit.register(_end_at_exit, weakref.ref(self))
        core_in.close()
        core_out.close()
        self.tokenizer = load_tokenizer(resolve_model(config.model))  # while the core loads the model
        msg = self._recv()
        if msg[0] == "error":
            self.shutdown()
            raise RuntimeError(f"the engine core failed to start: {msg[1]}")
        info = msg[1]
        self.max_model_len, self.vocab_size = info["max_model_len"], info["vocab_size"]
        self.load_times = info["load_times"]
        self.scores_prompts = info["scores_prompts"]
        self.eos_ids = info["eos_ids"]
        self.structured = StructuredOutputs(self.tokenizer, self.vocab_size, self.eos_ids)  # to refuse a bad grammar here
        self.pool = BlockMirror(info["prefix_caching"])
        self._lora_names: dict[str, str] | None = info["lora"]  # None: LoRA is off; replaced whole on each reply
        self._stats, self._group_ready = info["stats"], info["group_ready"]
        self.requests: dict[str, Request] = {}  # mirrors of the requests in the core
        self._ready: list[RequestOutput] = []  # outputs received, not yet returned by step()
        self._adds_sent = self._adds_seen = 0
        self._call_ids = itertools.count()

    # -- transport ----------------------------------------------------------------------
    def _send(self, msg: tuple) -> None:
        try:
            self._send_conn.send(msg)
        except (BrokenPipeError, ConnectionResetError, EOFError, OSError) as e:
            raise self._died() from e

    def _recv(self) -> tuple:
        try:
            return self._recv_conn.recv()
        except (EOFError, ConnectionResetError, OSError) as e:
            raise self._died() from e

    def _died(self) -> CoreDied:
        self.process.join(1.0)
        return CoreDied(f"the engine core process exited (exit code {self.process.exitcode})")

    def _pump(self, block: bool) -> None:
        """Handle the core's messages waiting in the pipe (with `block`, at least one)."""
        while block or self._recv_conn.poll(0):
            self._handle(self._recv())
            block = False

    # -- the engine's surface -------------------------------------------------------------
    def add_request(self, request_id: str, prompt, params, arrival_time: float | None = None, lora: str | None = None) -> None:
        """Refuse the request here as the core would (ValueError), else mirror it and send it."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if lora is not None:
            if self._lora_names is None:
                raise LoraError("LoRA adapters are not enabled on this server (--enable-lora)")
            if lora not in self._lora_names:
                raise LoraError(f"no adapter named {lora!r} is loaded", 404)
        text, ids = request_checks.check_request(self.tokenizer, self.vocab_size, self.max_model_len, self.scores_prompts,
                                                 prompt, params)
        if params.structured_outputs is not None:
            self.structured.compile(params.structured_outputs)  # ValueError for a bad one; cached
        request = Request(request_id, text, ids, params, arrival_time or time.time())
        detokenizer.start(request.seqs[0])
        self._send(("add", request_id, ids, dataclasses.replace(params, output_kind="delta"), request.arrival_time, lora))
        self.requests[request_id] = request
        self._adds_sent += 1

    def abort_request(self, request_id: str) -> None:
        if self.requests.pop(request_id, None) is not None:
            self._send(("abort", request_id))

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests or self._ready)

    def step(self) -> list[RequestOutput]:
        """The outputs of the core's next step (and of any others already received)."""
        if not self._ready:
            self._pump(block=True)
        self._pump(block=False)
        outputs, self._ready = self._ready, []
        return outputs

    def stats(self):
        """The core's latest stats; requests sent it but not yet seen by it count as waiting."""
        self._pump(block=False)
        unseen = self._adds_sent - self._adds_seen
        return dataclasses.replace(self._stats, num_waiting=self._stats.num_waiting + unseen) if unseen else self._stats

    def group_ready(self) -> bool:
        return self._group_ready

    def load_lora(self, name: str, path: str, replace: bool = False) -> None:
        self._call("load_lora", name, path, replace)

    def add_lora(self, name: str, path: str, base_model_name: str | None = None) -> None:
        self._call("add_lora", name, path, base_model_name)

    def remove_lora(self, name: str) -> None:
        self._call("remove_lora", name)

    def lora_names(self) -> dict[str, str]:
        """The adapters loaded in the core (as of its last reply): name -> path."""
        return dict(self._lora_names or {})

    def shutdown(self, timeout: float = 10.0) -> None:
        if self.process.is_alive():
            try:
                self._send_conn.send(("shutdown",))
            except OSError:
                pass
            self.process.join(timeout)
        if self.process.is_alive():
            log.warning("the engine core did not exit in %.0f s: terminating it", timeout)
            self.process.terminate()
            self.process.join(5.0)
        self._send_conn.close()
        self._recv_conn.close()

    def _call(self, op: str, *args) -> None:
        """Run engine.op(*args) in the core between its steps; raise its error here."""
        call_id = next(self._call_ids)
        self._send(("call", call_id, op, args))
        while True:
            msg = self._recv()
            if msg[0] == "reply" and msg[1] == call_id:
                break
            self._handle(msg)
        _, _, error, adapters = msg
        if self._lora_names is not None:
            self._lora_names = adapters
        if error is not None:
            kind, text, status = error
            if kind == "LoraError":
                raise LoraError(text, status or 400)
            if kind == "ValueError":
                raise ValueError(text)
            raise RuntimeError(f"{kind}: {text}")

    # -- the core's step messages -----------------------------------------------------------
    def _handle(self, msg: tuple) -> None:
        if msg[0] != "step":
            raise RuntimeError(f"unexpected message from the engine core: {msg[0]!r}")
        _, items, errors, self._stats, changes, self._adds_seen, self._group_ready = msg
        if changes is not None:
            self.pool.apply(changes)
        now = time.time()
        for rid, scheduled, prompt_logprobs, seqs in items:
            request = self.requests.get(rid)
            if request is None:  # aborted, or ended here by a stop string
                continue
            m = request.metrics
            if m.first_scheduled_time is None:
                m.first_scheduled_time = scheduled
            if prompt_logprobs is not None:
                request.prompt_logprobs = prompt_logprobs
            stopped_here = []
            for index, token_ids, logprobs, cumulative, reason, stop_reason, drop_last in seqs:
                seq = _sequence(request, index)
                if seq.finished:
                    continue
                if self._append(seq, token_ids, logprobs, cumulative, reason, stop_reason, drop_last):
                    stopped_here.append(seq)
            if m.first_token_time is None:
                m.first_token_time = now
            m.last_token_time = now
            if request.finished:
                m.finished_time = now
                del self.requests[rid]
                if stopped_here:  # the core may still run it: free its blocks
                    self._send(("abort", rid))
            else:
                for seq in stopped_here:
                    self._send(("stop", rid, seq.index, seq.stop_reason))
            if (out := request.output()) is not None:
                self._ready.append(out)
        for rid, why in errors:  # the core could not add it
            request = self.requests.pop(rid, None)
            if request is not None:
                failed = CompletionOutput(0, "", [], None, None, "error", why)
                self._ready.append(RequestOutput(rid, request.prompt, request.prompt_token_ids, [failed], True, request.metrics))

    def _append(self, seq: Sequence, token_ids, logprobs, cumulative, reason, stop_reason, drop_last) -> bool:
        """LLMEngine._append's text half for the core's new tokens; True if a stop string ended the sequence here."""
        params = seq.params
        stop = params.stop
        last = len(token_ids) - 1
        for k, token in enumerate(token_ids):
            seq.token_ids.append(token)
            if seq.logprobs is not None and logprobs:
                seq.logprobs.append(logprobs[k])
            seq.drop_last_text = drop_last and k == last  # an EOS or stop token adds no text
            delta = ""
            if (stop or params.output_kind != "final_only") and not seq.drop_last_text:
                delta = detokenizer.append_text(self.tokenizer, seq)
            # the core ended it on an EOS, stop token or grammar: no stop string is looked for
            # (as in LLMEngine._append); a "length" end comes after stop strings
            ended_by_token = k == last and reason not in (None, "length")
            may_stop = len(seq.token_ids) - seq.num_prompt_tokens >= params.min_tokens
            if stop and may_stop and not ended_by_token and (matched := detokenizer.find_stop(seq, delta)) is not None:
                self._finish(seq, "stop", matched)
                return True
        if cumulative is not None:
            seq.cumulative_logprob = cumulative
        if reason is not None:
            self._finish(seq, reason, stop_reason)
        return False

    def _finish(self, seq: Sequence, reason: str, stop_reason) -> None:
        seq.finish_reason, seq.stop_reason = reason, stop_reason
        seq.status = Status.FINISHED
        if not seq.params.stop and seq.params.output_kind == "final_only":  # all of its text, once
            detokenizer.append_text(self.tokenizer, seq, final=True, end=len(seq.token_ids) - seq.drop_last_text)


def _sequence(request: Request, index: int) -> Sequence:
    """The request's sequence `index`; n > 1 siblings are made when the core first reports them."""
    while len(request.seqs) <= index:
        child = Sequence(request, len(request.seqs), request.prompt_token_ids)
        detokenizer.start(child)
        request.seqs.append(child)
    return request.seqs[index]
