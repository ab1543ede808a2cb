"""Prompts to token ids, off the event loop and off the engine's step.

Tokenizing a multi-megabyte prompt takes seconds. On the event loop that freezes every
probe and stream; on the engine thread it stalls every running sequence. So the server
renders chat templates and tokenizes here, on a small thread pool (the Rust tokenizer
releases the GIL while it works), each worker with its own copy of the tokenizer (a fast
tokenizer is not safe to call from two threads at once), and hands the engine token ids.

Before tokenizing, a prompt whose size alone proves it cannot fit is refused: no token of
the vocabulary decodes to more than `max_token_chars` characters, so a text longer than
max_model_len * max_token_chars characters is more than max_model_len tokens, certainly.
(The raw vocabulary strings bound the decoded ones: a byte-level BPE writes one character
per byte, SentencePiece's byte-fallback tokens are longer than the byte they stand for.
A tokenizer with a normalizer, which may fold characters, gets four times the margin.)
"""

from __future__ import annotations

import concurrent.futures
import copy
import os
import threading

from shoal.runtime.entrypoints.tool_parsers.chat_template import has_tool_turns, named_template, tool_template


class PromptTooLong(ValueError):
    pass


# apply_chat_template's own arguments: the server sets them, a request's chat_template_kwargs may not
RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt", "continue_final_message",
    "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict", "return_assistant_tokens_mask",
    "tokenizer_kwargs", "sanitize_control_tokens", "self",
})


def check_template_kwargs(kwargs: dict | None) -> dict | None:
    """A request's chat_template_kwargs (vLLM's field): variables for the template; raises ValueError."""
    for key in kwargs or ():
        if key in RESERVED_TEMPLATE_KWARGS:
            raise ValueError(f"chat_template_kwargs may not set {key!r}: the server sets it")
    return kwargs


def context_error(num_tokens: int, max_model_len: int, max_tokens: int | None = None) -> str:
    """vLLM's wording, so clients that parse it keep working."""
    if max_tokens is None:
        return (f"This model's maximum context length is {max_model_len} tokens (max_model_len). However, your request has "
                f"{num_tokens} input tokens, which leaves no room to generate. Please reduce the length of the input.")
    return (f"This model's maximum context length is {max_model_len} tokens (max_model_len). However, you requested "
            f"{num_tokens + max_tokens} tokens ({num_tokens} in the input, {max_tokens} in the completion). "
            "Please reduce the length of the input or the completion.")


def max_token_chars(tokenizer) -> int:
    """An upper bound on the characters one token decodes to (see the module docstring)."""
    try:
        longest = max(len(t) for t in tokenizer.get_vocab())
    except Exception:  # noqa: BLE001 - no vocabulary to read: no size bound
        return 0
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or getattr(backend, "normalizer", None) is not None:
        longest *= 4
    return max(1, longest)


class PromptTokenizer:
    def __init__(self, tokenizer, max_model_len: int, *, chat_template: str | None = None, workers: int | None = None):
        self._base = tokenizer
        self.max_model_len = max_model_len
        self.chat_template = chat_template or getattr(tokenizer, "chat_template", None)
        per_token = max_token_chars(tokenizer)
        self.max_chars = max_model_len * per_token if per_token else None
        self._local = threading.local()
        self._copy_lock = threading.Lock()
        workers = workers or max(2, min(4, os.cpu_count() or 2))
        self.pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="shoal-tokenize")

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)

    def _tokenizer(self):
        tok = getattr(self._local, "tok", None)
        if tok is None:
            with self._copy_lock:
                tok = copy.deepcopy(self._base)
            if self.chat_template:
                tok.chat_template = self.chat_template
            self._local.tok = tok
        return tok

    def _check_size(self, text: str, what: str) -> None:
        if self.max_chars is not None and len(text) > self.max_chars:
            raise PromptTooLong(f"{what} has {len(text)} characters, more than the model's context of {self.max_model_len} tokens "
                                f"(max_model_len) can hold; it was refused without tokenizing")

    # -- on a pool thread ------------------------------------------------------------------
    def text_ids(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self._check_size(text, "the prompt")
        return self._tokenizer()(text, add_special_tokens=add_special_tokens).input_ids

    def decode(self, ids: list[int]) -> str:
        return self._tokenizer().decode(ids)

    def token_strs(self, ids: list[int]) -> list[str]:
        return self._tokenizer().convert_ids_to_tokens(ids)

    def chat_ids(self, messages: list[dict], add_generation_prompt: bool, add_special_tokens: bool = False, tools: list[dict] | None = None,
                 template_kwargs: dict | None = None) -> list[int]:
        tok = self._tokenizer()
        if not self.chat_template:
            raise ValueError("this model has no chat template; use /v1/completions")
        kw = dict(template_kwargs or {})  # a request's chat_template_kwargs, checked: no reserved names
        if tools or has_tool_turns(messages):  # a template that renders tools (docs/tools.md)
            kw.update(tools=tools or None, chat_template=tool_template(tok, named_template(self.chat_template, True)))
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt, **kw)
        self._check_size(text, "the conversation")
        return tok(text, add_special_tokens=add_special_tokens)["input_ids"]

    # -- on the event loop -----------------------------------------------------------------
    async def run(self, fn, *args):
        import asyncio

        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)
