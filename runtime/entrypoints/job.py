"""One HTTP request's life in the engine: its engine requests (one per prompt), n choices
each, the items the engine thread posts folded into per-choice state, and the waits a
handler does on them (all accepted, all finished, the next deltas of a stream)."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from typing import TYPE_CHECKING, Any

from fastapi import Request

from shoal.runtime.engine.async_engine import Accepted, Delta, Failed, Output, Rejected
from shoal.runtime.entrypoints.errors import APIError, unavailable

if TYPE_CHECKING:
    from shoal.runtime.entrypoints.state import ServerState

logger = logging.getLogger("shoal.server")

_DISCONNECTED = object()


class Choice:
    __slots__ = ("text", "n_tokens", "token_ids", "logprobs", "finish_reason", "stop_reason", "started")

    def __init__(self):
        self.text: list[str] = []
        self.n_tokens = 0
        self.token_ids: list[int] = []
        self.logprobs: list[dict] = []
        self.finish_reason = None
        self.stop_reason = None
        self.started = False


class Job:
    """One HTTP request: one or more engine requests (prompts), n choices each."""

    def __init__(self, state: "ServerState", http_id: str, n: int):
        self.state = state
        self.http_id = http_id
        self.n = n
        self.queue: asyncio.Queue = asyncio.Queue()
        self.rids: list[str] = []
        self.unfinished: set[str] = set()
        self.prompt_tokens: dict[int, int] = {}
        self.choices: dict[int, Choice] = {}
        self.prompt_ids: list[list[int]] = []  # per prompt (tag), as submitted
        self.prompt_logprobs: dict[int, list] = {}  # per prompt, when the params ask for them

    @property
    def model(self) -> str:
        """The name its responses carry: the LoRA adapter it ran with, else the served model."""
        return self.lora or self.state.model_name

    lora: str | None = None

    def submit(self, prompts: list, params, lora: str | None = None) -> None:
        self.lora = lora
        arrival = time.time()
        self.prompt_ids = list(prompts)
        for p, prompt in enumerate(prompts):
            rid = f"{self.http_id}-{p}"
            self.rids.append(rid)
            self.unfinished.add(rid)
            self.state.engine.submit(rid, prompt, params, self.queue, tag=p, arrival_time=arrival, lora=lora)

    def abort(self) -> None:
        for rid in self.unfinished:
            self.state.engine.abort(rid)
        self.unfinished.clear()

    def choice(self, tag: int, index: int) -> Choice:
        key = tag * self.n + index
        c = self.choices.get(key)
        if c is None:
            c = self.choices[key] = Choice()
        return c

    def apply(self, item) -> list[tuple[int, Any]]:
        """Fold one queue item in; returns [(choice_index, delta)] of what it added."""
        if isinstance(item, Accepted):
            return []
        if isinstance(item, Rejected):
            self.unfinished.discard(item.request_id)
            raise APIError(400, item.message, "invalid_request_error", param="prompt")
        if isinstance(item, Failed):
            self.unfinished.discard(item.request_id)
            if item.engine_alive:  # this request alone failed inside the engine: a bug, not the client's fault
                raise APIError(500, item.message, "server_error", code="request_failed")
            raise unavailable(item.message, "engine_failed")
        assert isinstance(item, Output)
        if item.num_prompt_tokens:
            self.prompt_tokens[item.tag] = item.num_prompt_tokens
        if item.prompt_logprobs is not None:
            self.prompt_logprobs[item.tag] = item.prompt_logprobs
        added = []
        for d in item.deltas:
            c = self.choice(item.tag, d.index)
            if c.finish_reason is not None:
                continue
            if d.text:
                c.text.append(d.text)
            if d.token_ids:
                c.n_tokens += len(d.token_ids)
                c.token_ids.extend(d.token_ids)
                if d.logprobs:
                    c.logprobs.extend(d.logprobs)
            if d.finish_reason is not None:
                c.finish_reason = d.finish_reason
                c.stop_reason = d.stop_reason
            added.append((item.tag * self.n + d.index, d))
        if item.finished:
            self.unfinished.discard(item.request_id)
        return added

    def usage(self) -> dict:
        prompt = sum(self.prompt_tokens.values())
        completion = sum(c.n_tokens for c in self.choices.values())
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


async def _watch_disconnect(request: Request, job: Job) -> None:
    """Put a marker on the job's queue when the client goes away (non-streaming requests)."""
    try:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                job.queue.put_nowait(_DISCONNECTED)
                return
    except Exception:  # noqa: BLE001
        return


async def collect(request: Request, job: Job) -> None:
    """Wait for every engine request of a non-streaming job; abort them if the client leaves."""
    watcher = asyncio.ensure_future(_watch_disconnect(request, job))
    try:
        while job.unfinished:
            item = await job.queue.get()
            if item is _DISCONNECTED:
                logger.info("client disconnected: aborting %s", job.http_id)
                job.abort()
                raise APIError(499, "client disconnected")
            job.apply(item)
    except BaseException:
        job.abort()
        raise
    finally:
        watcher.cancel()


async def await_accepted(job: Job) -> list:
    """Wait until every engine request is accepted or one is rejected (-> 400).
    Returns items that arrived meanwhile (outputs of already-accepted requests)."""
    early = []
    accepted: set[str] = set()
    try:
        while len(accepted) < len(job.rids):
            item = await job.queue.get()
            if isinstance(item, (Rejected, Failed)):
                job.apply(item)  # raises
            accepted.add(item.request_id)
            if isinstance(item, Output):
                early.append(item)
    except BaseException:
        job.abort()
        raise
    return early


async def stream_items(job: Job, early: list, interval: int = 1):
    """Yield, per engine output, its [(choice index, delta)]: one token a choice, as the engine
    made it (a slow client finds them queued, each still its own event). With interval > 1
    (--stream-interval, vLLM's) a choice's deltas are held until `interval` tokens have
    gathered, except its first token and its last delta, which go at once."""
    held: dict[int, Delta] = {}
    started: set[int] = set()

    def gather(added):
        if interval <= 1:
            return added
        out = []
        for index, d in added:
            if index in held:
                d = _merge(held.pop(index), d)
            if index not in started or d.finish_reason is not None or len(d.token_ids) >= interval:
                started.add(index)
                out.append((index, d))
            else:
                held[index] = d
        return out

    for item in early:
        if added := gather(job.apply(item)):
            yield added
    while job.unfinished:
        if added := gather(job.apply(await job.queue.get())):
            yield added
    if held:
        yield list(held.items())


def _merge(a: Delta, b: Delta) -> Delta:
    """Two deltas of one choice as one (b the later)."""
    logprobs = None if a.logprobs is None and b.logprobs is None else (a.logprobs or []) + (b.logprobs or [])
    return dataclasses.replace(b, text=a.text + b.text, token_ids=a.token_ids + b.token_ids, logprobs=logprobs)
