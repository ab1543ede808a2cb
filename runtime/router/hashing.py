"""A request body -> the block hashes of its prompt, as the servers will compute them.

The body is read with the server's own request models (entrypoints/protocol.py) and the
prompt rendered with the server's own code: a chat's messages as `request_messages` hands
them to the template, with the request's `tools` when the server would render them
(tool_choice not "none"), through `PromptTokenizer.chat_ids` (its tool template included);
a completion prompt tokenized with special tokens; token ids as they are (the first prompt
of a batch decides; `truncate_prompt_tokens` applied). It runs on the same kind of
tokenizer pool (entrypoints/prompts.py) and is hashed with the engine's own function
(cache/block_pool.py). Only the blocks the engine can reuse count: all full blocks but the
one holding the last token.

A body the router cannot read gets no hashes: it is routed by load, and the server answers
its 400. So does a prompt whose size alone proves it cannot fit the groups' context (they
refuse it without tokenizing, by the same bound: prompts.max_token_chars): the router never
tokenizes what no group would.
"""

from __future__ import annotations

import logging
from typing import Callable

from shoal.runtime.cache.block_pool import block_hashes
from shoal.runtime.entrypoints.prompts import PromptTokenizer, max_token_chars
from shoal.runtime.entrypoints.protocol import ChatCompletionRequest, CompletionRequest
from shoal.runtime.entrypoints.tool_parsers.chat_template import request_messages

logger = logging.getLogger("shoal.router")

NO_LIMIT = 1 << 40  # the servers enforce the context length; the router only reads
# A prompt this short tokenizes on the event loop: ~30 us, against ~180 us for the hop to a
# pool thread and back (measured; it is most of a short request's time in the router).
INLINE_CHARS = 2048


class PromptHasher:
    def __init__(self, tokenizer=None, chat_template: str | None = None, on_skip: Callable[[str], None] | None = None):
        self.prompts = PromptTokenizer(tokenizer, NO_LIMIT, chat_template=chat_template) if tokenizer is not None else None
        self.per_token = max_token_chars(tokenizer) if tokenizer is not None else 0
        self.on_skip = on_skip  # called with why a request got no hashes: "unreadable", "too_long"

    def close(self) -> None:
        if self.prompts is not None:
            self.prompts.close()

    def _too_long(self, chars: int, max_model_len: int | None) -> bool:
        """Whether a text of `chars` characters is refused by the groups without tokenizing."""
        return bool(max_model_len and self.per_token and chars > max_model_len * self.per_token)

    async def token_ids(self, path: str, body, max_model_len: int | None = None) -> list[int] | None:
        """The prompt's token ids; None when the groups refuse it by its size alone."""
        if not isinstance(body, dict):
            raise ValueError("the body is not a JSON object")
        if path.endswith("/chat/completions"):
            req = ChatCompletionRequest.model_validate(body)
            if self.prompts is None:
                return []
            messages = request_messages(req.messages)
            size = sum(len(m["content"]) for m in messages)
            if self._too_long(size, max_model_len):  # the rendered text is longer still
                return None
            tools = req.tools if req.tools and req.tool_choice != "none" else None  # what the server renders (ToolChoice.template_tools)
            args = (messages, req.add_generation_prompt, False, tools)
            ids = (self.prompts.chat_ids(*args) if size <= INLINE_CHARS and tools is None
                   else await self.prompts.run(self.prompts.chat_ids, *args))
        else:
            req = CompletionRequest.model_validate(body)
            prompt = req.prompts()[0]
            if isinstance(prompt, list):
                ids = prompt
            elif self.prompts is None:
                return []
            elif self._too_long(len(prompt), max_model_len):
                return None
            else:
                ids = (self.prompts.text_ids(prompt, True) if len(prompt) <= INLINE_CHARS
                       else await self.prompts.run(self.prompts.text_ids, prompt, True))
        k = req.truncate_prompt_tokens
        if k is not None and k != 0 and (k > 0 or max_model_len):
            ids = ids[-(k if k > 0 else max_model_len):]  # the server keeps the last k (-1: max_model_len)
        return ids

    async def hashes(self, path: str, body, block_size: int, max_model_len: int | None = None) -> list[int]:
        try:
            ids = await self.token_ids(path, body, max_model_len)
            if ids is None:
                self._skipped("too_long")
                return []
            usable = max(0, (len(ids) - 1) // block_size)
            if usable > 32 and self.prompts is not None:  # ~2 us a block: a long prompt's hashes off the event loop
                return await self.prompts.run(block_hashes, ids[: usable * block_size], block_size)
            return block_hashes(ids[: usable * block_size], block_size)
        except Exception as e:  # noqa: BLE001 - not the server's body, a template error: the server will say
            logger.debug("no prefix for this request: %s: %s", type(e).__name__, e)
            self._skipped("unreadable")
            return []

    def _skipped(self, why: str) -> None:
        if self.on_skip is not None:
            self.on_skip(why)
