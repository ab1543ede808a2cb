"""The engine-core process (`shoal serve --engine-core-process`): schedule, execute, sample,
and nothing else. Its client in the API process (core_client.py) detokenizes and checks
stop strings while this process runs the next step (vLLM V1's split).

    API process (CoreClient)                     this process (spawned)
    ------------------------                     ----------------------
    add / abort / stop / call / shutdown  --->   reader thread -> inbox
    step(): receive, detokenize, stop     <---   one "step" message per engine step

Messages are plain tuples (pickled by the Pipe):
  in : ("add", id, prompt ids, params, arrival, lora) | ("abort", id) | ("stop", id, index, stop string)
       | ("call", call id, op, args) | ("shutdown",)
  out: ("ready", info) | ("error", why) at start-up, then
       ("step", outputs, errors, stats, block changes, adds seen, group ready) | ("reply", call id, error, adapters)
where an output is (id, first scheduled time, prompt logprobs, [(index, new token ids,
new logprobs, cumulative logprob, finish reason, stop reason, drop last text)]).

A reader thread drains the pipe into a queue, so the core never blocks sending while its
client blocks sending (a big prompt, a big step). The process ends on "shutdown" or when
the pipe from its parent closes (the parent died).
"""

from __future__ import annotations

import logging
import queue
import signal
import threading
import traceback

log = logging.getLogger("shoal.engine_core")

# what a client may call between steps (LoRA adapters; the engine's methods of these names)
CALLS = ("load_lora", "add_lora", "remove_lora")


def main(conn_in, conn_out, config) -> None:
    """The spawned process's entry point."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is the server's to handle (it drains)
    try:
        from shoal.runtime.engine.engine import LLMEngine

        engine = LLMEngine(config, detokenize=False)
    except BaseException as e:  # noqa: BLE001 - reported to the client, which raises it
        conn_out.send(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
        return
    pool = engine.pool
    conn_out.send(("ready", {
        "max_model_len": engine.max_model_len, "vocab_size": engine.vocab_size, "load_times": engine.load_times,
        "eos_ids": list(engine.eos_ids), "scores_prompts": engine.executor.scores_prompts,
        "prefix_caching": pool.enable_prefix_caching, "lora": engine.lora_names() if engine.lora is not None else None,
        "stats": engine.stats(), "group_ready": engine.group_ready(),
    }))
    inbox: queue.SimpleQueue = queue.SimpleQueue()
    threading.Thread(target=_read, args=(conn_in, inbox), name="shoal-core-reader", daemon=True).start()
    try:
        Core(engine, conn_out, inbox).run()
    except (BrokenPipeError, EOFError, ConnectionResetError):
        pass  # the client went away
    finally:
        engine.shutdown()


def _read(conn, inbox: queue.SimpleQueue) -> None:
    try:
        while True:
            inbox.put(conn.recv())
    except (EOFError, OSError):
        inbox.put(("shutdown",))


class Core:
    def __init__(self, engine, conn, inbox: queue.SimpleQueue):
        self.engine, self.conn, self.inbox = engine, conn, inbox
        self.requests: dict = {}  # id -> the engine's Request, while it runs here
        self.errors: list[tuple[str, str]] = []  # adds that failed here: (id, why)
        self.adds_seen = 0
        self.events_seq, self.events_epoch = 0, None

    def run(self) -> None:
        engine = self.engine
        while True:
            busy = engine.has_unfinished_requests()
            messages = [] if busy else [self.inbox.get()]  # idle: sleep until told something
            while True:
                try:
                    messages.append(self.inbox.get_nowait())
                except queue.Empty:
                    break
            for msg in messages:
                if msg[0] == "shutdown":
                    return
                self._apply(msg)
            if engine.has_unfinished_requests():
                self._send_step(engine.step())
            elif messages:  # idle after aborts: the stats and block events that followed them
                self._send_step([])

    def _apply(self, msg: tuple) -> None:
        kind, engine = msg[0], self.engine
        if kind == "add":
            _, rid, ids, params, arrival, lora = msg
            self.adds_seen += 1
            try:
                engine.add_request(rid, ids, params, arrival_time=arrival, lora=lora)
            except Exception as e:  # noqa: BLE001 - the client checked it already; fail this one request
                log.exception("add_request %s failed", rid)
                self.errors.append((rid, f"{type(e).__name__}: {e}"))
            else:
                self.requests[rid] = engine.requests[rid]
        elif kind == "abort":
            self.requests.pop(msg[1], None)
            engine.abort_request(msg[1])
        elif kind == "stop":
            engine.stop_sequence(msg[1], msg[2], msg[3])
            if msg[1] not in engine.requests:
                self.requests.pop(msg[1], None)
        elif kind == "call":
            _, call_id, op, args = msg
            error = None
            try:
                if op not in CALLS:
                    raise ValueError(f"no engine call {op!r}")
                getattr(engine, op)(*args)
            except Exception as e:  # noqa: BLE001 - the caller's to report
                error = (type(e).__name__, str(e), getattr(e, "status", None))
            self.conn.send(("reply", call_id, error, engine.lora_names()))
        else:
            raise ValueError(f"unknown message {kind!r}")

    def _send_step(self, advanced: list) -> None:
        """`advanced`: the Requests the step advanced (LLMEngine(detokenize=False).step())."""
        items = []
        for request in advanced:
            if request.request_id not in self.requests:  # aborted meanwhile
                continue
            first = request.seqs[0].num_sent_tokens == 0  # nothing of it sent yet: the prompt logprobs go with its first tokens
            seqs = []
            for seq in request.seqs:
                new = seq.token_ids[seq.num_prompt_tokens + seq.num_sent_tokens:]
                if not new and seq.finish_reason is None:
                    continue
                logprobs = seq.logprobs[seq.num_sent_tokens:] if seq.logprobs is not None else None
                seq.num_sent_tokens += len(new)
                seqs.append((seq.index, new, logprobs, seq.cumulative_logprob if seq.logprobs is not None else None,
                             seq.finish_reason, seq.stop_reason, seq.finish_reason is not None and seq.drop_last_text))
            prompt_logprobs = request.prompt_logprobs if first and seqs else None
            items.append((request.request_id, request.metrics.first_scheduled_time, prompt_logprobs, seqs))
            if request.finished:
                del self.requests[request.request_id]
        engine = self.engine
        changes = None
        if engine.pool.enable_prefix_caching:
            changes = engine.pool.changes_since(self.events_seq, self.events_epoch)
            self.events_seq, self.events_epoch = changes["seq"], changes["epoch"]
            if not (changes["reset"] or changes["stored"] or changes["removed"]):
                changes = None
        errors, self.errors = self.errors, []
        self.conn.send(("step", items, errors, engine.stats(), changes, self.adds_seen, engine.group_ready()))

