"""OpenAI's response shapes, one renderer for /v1/completions and /v1/chat/completions.

The two APIs differ in a few places only, and those are the renderer's branches:
  object      text_completion            chat.completion / chat.completion.chunk
  a choice    "text": echo + text        "message": {"role": "assistant", "content"}
  a chunk     "text": delta              "delta": {"content"} (the first: {"role", "content": ""})
  logprobs    tokens/token_logprobs/     content: [{token, logprob, bytes, top_logprobs}]
              top_logprobs/text_offset
With tool calling (tool_parsers/output.py) a chat message also has "tool_calls", and its
chunks "delta": {"tool_calls"}. Everything else (ids, usage, stop_reason, the SSE framing,
usage chunk, errors mid-stream, [DONE]) is shared.

A stream, as vLLM's: a choice's first chunk (chat's role, completions' echoed prompt) goes
out with its first generated token, never before prefill, so a client that times the first
chunk reads the real TTFT; then one event per token (every --stream-interval tokens),
each written on its own, an empty text included; with stream_options.continuous_usage_stats
every chunk carries its choice's usage so far.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fastapi.responses import StreamingResponse

from shoal.runtime.entrypoints.errors import APIError, dumps, error_body, finite
from shoal.runtime.entrypoints.job import Job, stream_items
from shoal.runtime.entrypoints.tool_parsers.output import ToolOutput

if TYPE_CHECKING:
    from shoal.runtime.entrypoints.scoring import Extras
    from shoal.runtime.entrypoints.state import ServerState


def sse(obj: dict) -> str:
    return f"data: {dumps(obj)}\n\n"


def sse_response(gen) -> StreamingResponse:
    return StreamingResponse(gen, media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def completion_logprobs(state: "ServerState", token_ids: list[int], lps: list[dict], offset: int, tok=None) -> dict:
    tok = tok or state.tok_str  # token id -> its string (return_tokens_as_token_ids: "token_id:N")
    tokens, token_lps, top, offsets = [], [], [], []
    for tid, d in zip(token_ids, lps):
        s = tok(tid)
        tokens.append(s)
        token_lps.append(finite(d.get(tid, -9999.0)))
        top.append({tok(k): finite(v) for k, v in sorted(d.items(), key=lambda kv: -kv[1])})
        offsets.append(offset)
        offset += len(s)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": top, "text_offset": offsets}


def chat_logprobs(state: "ServerState", token_ids: list[int], lps: list[dict], k: int, tok=None) -> dict:
    tok = tok or state.tok_str
    content = []
    for tid, d in zip(token_ids, lps):
        s = tok(tid)
        top = sorted(d.items(), key=lambda kv: -kv[1])[:k]
        content.append({
            "token": s,
            "logprob": finite(d.get(tid, -9999.0)),
            "bytes": list(s.encode("utf-8")),
            "top_logprobs": [{"token": tok(t), "logprob": finite(v), "bytes": list(tok(t).encode("utf-8"))} for t, v in top],
        })
    return {"content": content}


class Renderer:
    """One job's response: `body()` when it has finished, or `stream(early)` as SSE."""

    def __init__(self, state: "ServerState", job: Job, created: int, *, chat: bool, logprobs: int | None,
                 echo_text: dict[int, str] | None = None, include_usage: bool = False, continuous_usage: bool = False,
                 extras: "Extras | None" = None, tools: ToolOutput | None = None, stream_interval: int = 1):
        self.state, self.job, self.created, self.chat = state, job, created, chat
        self.extras = extras  # scoring and token fields (scoring.py)
        self.tok = extras.tok(state) if extras is not None else state.tok_str
        self.tools = tools  # chat with tool calling: the text goes through its parser (tool_parsers/output.py)
        self.k = logprobs  # completions: top logprobs per token; chat: top_logprobs (None: none asked)
        self.echo_text = echo_text or {}
        self.include_usage = include_usage
        self.continuous_usage = continuous_usage  # a running usage on every chunk (vLLM's continuous_usage_stats)
        self.stream_interval = stream_interval
        self.opened: set[int] = set()  # streamed choices whose first chunk (role, echo, prompt part) went out
        self.tokens_sent: dict[int, int] = {}  # per streamed choice: completion tokens so far
        self.offsets: dict[int, int] = {}  # completions' text_offset, per streamed choice
        self.ids_sent: set[int] = set()  # streamed choices whose prompt_token_ids went out (return_token_ids)

    def _logprobs(self, token_ids: list[int], lps: list[dict], offset: int) -> dict:
        if self.chat:
            return chat_logprobs(self.state, token_ids, lps, self.k, self.tok)
        return completion_logprobs(self.state, token_ids, lps, offset, self.tok)

    # -- the whole body -------------------------------------------------------------------
    def body(self) -> dict:
        job, x = self.job, self.extras
        choices = []
        for key in sorted(job.choices):
            c = job.choices[key]
            tag = key // job.n
            prefix = "" if self.chat else self.echo_text.get(tag, "")
            token_ids, lps, text, finish = c.token_ids, c.logprobs, "".join(c.text), (c.finish_reason, c.stop_reason)
            if x is not None and x.echo_only:  # the token generated to get there is not part of the answer
                token_ids, lps, text, finish = [], [], "", ("length", None)
            lp = None
            if x is not None and x.k_echo is not None:  # the echoed prompt's tokens lead
                lp, end = x.echo_logprobs(self.state, job.prompt_ids[tag], job.prompt_logprobs.get(tag))
                rest = self._logprobs(token_ids, lps, end)
                lp = {name: lp[name] + rest[name] for name in lp}
            elif self.k is not None:
                lp = self._logprobs(token_ids, lps, len(prefix))
            if not self.chat:
                content = {"text": prefix + text}
            elif self.tools is not None:
                message, reason = self.tools.message(text, finish[0])
                finish, content = (reason, finish[1]), {"message": message}
            else:
                content = {"message": {"role": "assistant", "content": text}}
            choice = {"index": key, **content, "logprobs": lp, "finish_reason": finish[0], "stop_reason": finish[1]}
            if x is not None:
                x.choice(choice, job.prompt_ids[tag], token_ids, job.prompt_logprobs.get(tag))
            choices.append(choice)
        obj = "chat.completion" if self.chat else "text_completion"
        body = {"id": job.http_id, "object": obj, "created": self.created, "model": self.job.model, "choices": choices,
                "usage": self._usage()}
        if x is not None:
            x.body(body, job.prompt_ids[0] if job.prompt_ids else [], job.prompt_logprobs.get(0))
        return body

    def _usage(self) -> dict:
        usage = self.job.usage()
        if self.extras is not None and self.extras.echo_only:  # the token generated to get there is not counted
            usage = dict(usage, completion_tokens=0, total_tokens=usage["prompt_tokens"])
        return usage

    # -- the stream -----------------------------------------------------------------------
    @property
    def _base(self) -> dict:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {"id": self.job.http_id, "object": obj, "created": self.created, "model": self.job.model}

    def _chunk(self, index: int, payload, logprobs=None, finish_reason=None, stop_reason=None, token_ids=None, more=None) -> str:
        choice = {"index": index, ("delta" if self.chat else "text"): payload, "logprobs": logprobs, "finish_reason": finish_reason, "stop_reason": stop_reason,
                  **(more or {})}
        obj = dict(self._base, choices=[choice])
        if self.extras is not None and self.extras.return_token_ids:  # vLLM's: the prompt's ids once per choice
            choice["token_ids"] = token_ids or []
            if index not in self.ids_sent:
                self.ids_sent.add(index)
                ids = self.job.prompt_ids[index // self.job.n]
                if self.chat:
                    obj["prompt_token_ids"] = ids
                else:
                    choice["prompt_token_ids"] = ids
        if self.continuous_usage:
            obj["usage"] = self._running_usage(index)
        elif self.include_usage:
            obj["usage"] = None
        return sse(obj)

    def _running_usage(self, index: int) -> dict:
        """One choice's usage so far: its prompt's tokens and the tokens it has streamed (vLLM's)."""
        tag = index // self.job.n
        prompt = self.job.prompt_tokens.get(tag) or len(self.job.prompt_ids[tag])
        completion = self.tokens_sent.get(index, 0)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def _opening(self, index: int) -> list[str]:
        """A choice's first chunk, sent with its first output: chat's role; completions' echoed
        prompt, or its prompt part when prompt scores were asked for (_prompt_part)."""
        if index in self.opened:
            return []
        self.opened.add(index)
        if self.chat:
            return [self._chunk(index, {"role": "assistant", "content": ""})]
        if self.extras is not None and self.extras.prompt_part_waits:
            return [self._prompt_part(index)]
        text = self.echo_text.get(index // self.job.n)
        if text is None:
            return []
        self.offsets[index] = len(text)
        return [self._chunk(index, text)]

    def _prompt_part(self, index: int) -> str:
        """Completions, streamed: a choice's first chunk when its prompt's scores are asked
        for (they come with the request's first output): the echoed prompt with its
        logprobs, prompt_logprobs; with max_tokens 0 the whole answer."""
        x, job = self.extras, self.job
        tag = index // job.n
        text = self.echo_text.get(tag, "")
        entries = job.prompt_logprobs.get(tag)
        lp, self.offsets[index] = (x.echo_logprobs(self.state, job.prompt_ids[tag], entries) if x.k_echo is not None
                                   else (None, len(text)))
        more = {"prompt_logprobs": x.prompt_logprobs(entries)} if x.k_field is not None else None
        finish = "length" if x.echo_only else None
        return self._chunk(index, text, lp, finish, more=more)

    def _deltas(self, added) -> list[str]:
        """The SSE events of these deltas: a choice's first chunk before its first delta, then
        one event per delta (a token, or --stream-interval of them), an empty text included."""
        out = []
        x = self.extras
        for index, d in added:
            out.extend(self._opening(index))
            if x is not None and x.echo_only:
                continue  # the generated token is not part of the answer
            self.tokens_sent[index] = self.tokens_sent.get(index, 0) + len(d.token_ids)
            lp = None
            if self.k is not None and d.token_ids:
                off = self.offsets.get(index, 0)
                lp = self._logprobs(d.token_ids, d.logprobs or [{}] * len(d.token_ids), off)
                if not self.chat:
                    self.offsets[index] = off + sum(len(t) for t in lp["tokens"])
            if self.chat and self.tools is not None:
                out.extend(self._tool_chunks(index, d, lp))
            elif d.text or d.token_ids or d.finish_reason is not None or lp is not None:
                if self.chat:
                    payload = {"content": d.text} if (d.text or d.token_ids or lp is not None) else {}
                else:
                    payload = d.text
                out.append(self._chunk(index, payload, lp, d.finish_reason, d.stop_reason if d.finish_reason else None, d.token_ids))
        return out

    def _tool_chunks(self, index: int, d, lp) -> list[str]:
        """A chat delta through the tool-call parser: content and tool_calls deltas (held-back
        text may give none); the logprobs ride on the first chunk, finish_reason on the last."""
        s = self.tools.stream(index)
        deltas = s.feed(d.text) if d.text else []
        finish = None
        if d.finish_reason is not None:
            deltas += s.finish()
            finish = s.finish_reason(d.finish_reason)
        ids = self.extras is not None and self.extras.return_token_ids and d.token_ids
        if not deltas and (finish is not None or lp is not None or ids):
            deltas = [{}]
        last = len(deltas) - 1
        return [self._chunk(index, delta, lp if i == 0 else None, finish if i == last else None,
                            d.stop_reason if i == last and finish is not None else None, d.token_ids if i == 0 else None)
                for i, delta in enumerate(deltas)]

    async def _events(self, early: list):
        """The rendered deltas, one write per event, usage if asked, [DONE]; an error
        mid-stream becomes an error event; the request ends with the body."""
        try:
            async for added in stream_items(self.job, early, self.stream_interval):
                for event in self._deltas(added):
                    yield event
            if self.include_usage:
                yield sse(dict(self._base, choices=[], usage=self._usage()))
            yield "data: [DONE]\n\n"
        except APIError as e:
            yield sse(error_body(e.message, e.type, e.param, e.code))
            yield "data: [DONE]\n\n"
        finally:
            self.job.abort()

    def stream(self, early: list) -> StreamingResponse:
        return sse_response(self._events(early))
