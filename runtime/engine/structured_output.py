"""Structured outputs: a grammar per request (xgrammar), a token bitmask per sampling row.

    StructuredOutputsParams --compile (LRU, 256)--> CompiledGrammar   (server: tokenizer pool)
    CompiledGrammar --one GrammarMatcher per sequence--> next-token bitmask  (engine: each step)
    the bitmask (with allowed_token_ids and bans folded in) --> layers/sampler.py masks logits

One GrammarCompiler, made at first use from the tokenizer with the logits' width as its
vocabulary size (a model's LM head is often wider than its tokenizer: the extra ids are
never allowed). Compiled grammars are kept in an LRU keyed by the spec, so the server
compiles a request's grammar on its tokenizer pool (a bad schema is a 400 there) and the
engine's add_request finds it compiled. Each sequence (n > 1: each of them) owns a matcher,
advanced with every token it appends; the sequence finishes when its matcher terminates,
which happens only on EOS, which the grammar allows only where the text is complete.
A preempted sequence keeps its tokens and its matcher: recomputing the cache samples
nothing, so the matcher's state stays right.

JSON whitespace is capped (MAX_WHITESPACE characters between tokens of the JSON text;
disable_any_whitespace: none at all), so sampled output cannot wander in blanks forever.
"""

from __future__ import annotations

import collections
import copy
import json
import re
import threading

import numpy as np
import torch

from shoal.runtime.sampling_params import StructuredOutputsParams

CACHE_SIZE = 256
MAX_WHITESPACE = 4


def spec_key(spec: StructuredOutputsParams) -> str:
    """A string that names the grammar a spec compiles to (its cache key)."""
    value = spec.json if spec.json is not None else spec.regex if spec.regex is not None else spec.choice if spec.choice is not None else spec.grammar
    kind = next(k for k in ("json", "regex", "choice", "grammar") if getattr(spec, k) is not None) if not spec.json_object else "json_object"
    if kind == "json" and isinstance(value, str):  # the same schema as text or as a dict: one entry
        try:
            value = json.loads(value)
        except ValueError:
            pass
    return json.dumps([kind, value, spec.disable_any_whitespace], sort_keys=True, ensure_ascii=False)


_SKIP = ("enum", "const", "default", "examples")  # values, not schemas


def strict_strings(schema):
    """A copy of a JSON schema in which each string with minLength/maxLength (and no pattern
    or format) has them as a pattern instead. xgrammar compiles a bounded string to any
    characters but quote, backslash, CR and LF, so raw control characters (invalid JSON, which
    strict parsers refuse) could be sampled inside it; its pattern strings exclude them."""
    if isinstance(schema, list):
        return [strict_strings(x) for x in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: v if k in _SKIP else strict_strings(v) for k, v in schema.items()}
    lo, hi = out.get("minLength", 0), out.get("maxLength")
    if (out.get("type") == "string" and ("minLength" in out or "maxLength" in out) and "pattern" not in out and "format" not in out
            and isinstance(lo, int) and (hi is None or isinstance(hi, int)) and 0 <= lo <= (hi if hi is not None else lo) <= 4096):
        out.pop("minLength", None)
        out.pop("maxLength", None)
        out["pattern"] = '^[^\\x00-\\x1f"\\\\]{%d,%s}$' % (lo, "" if hi is None else hi)
    return out


def choice_grammar(choices: list[str]) -> str:
    """EBNF for exactly one of the strings (JSON string escapes are EBNF's too)."""
    return "root ::= " + " | ".join(json.dumps(c) for c in choices)


def words_allowed(row: np.ndarray, vocab_size: int) -> bool:
    """Whether a packed int32 bitmask row allows any token id below vocab_size."""
    return bool(np.unpackbits(row.view(np.uint8), bitorder="little")[:vocab_size].any())


def pack_ids(ids: list[int], vocab_size: int) -> np.ndarray:
    """The packed int32 bitmask row that allows exactly these ids."""
    bits = np.zeros(num_words(vocab_size) * 32, dtype=np.uint8)
    bits[ids] = 1
    return np.packbits(bits, bitorder="little").view(np.int32)


def num_words(vocab_size: int) -> int:
    return -(-vocab_size // 32)


class StructuredOutputs:
    """The engine's grammar compiler and cache. compile() is thread-safe (the server's pool
    and the engine thread both call it); matchers belong to the engine thread."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids: list[int]):
        self.vocab_size = vocab_size
        self.eos_ids = list(eos_ids)
        self._tokenizer = tokenizer
        self._compiler = None
        self._batch = None  # xgrammar's BatchGrammarMatcher (its thread pool), engine thread only
        self._lock = threading.Lock()
        self._cache: collections.OrderedDict[str, object] = collections.OrderedDict()

    def _get_compiler(self):
        with self._lock:
            if self._compiler is None:
                import xgrammar as xgr

                # a copy: the engine thread may be decoding with the original meanwhile
                info = xgr.TokenizerInfo.from_huggingface(copy.deepcopy(self._tokenizer), vocab_size=self.vocab_size,
                                                          stop_token_ids=self.eos_ids or None)
                self._compiler = xgr.GrammarCompiler(info, max_threads=2)
            return self._compiler

    def compile(self, spec: StructuredOutputsParams):
        """The compiled grammar of a spec (cached); ValueError names what cannot be compiled."""
        key = spec_key(spec)
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
        compiled = self._compile(spec, self._get_compiler())
        with self._lock:
            self._cache[key] = compiled
            self._cache.move_to_end(key)
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled

    @staticmethod
    def _compile(spec: StructuredOutputsParams, compiler):
        ws = dict(any_whitespace=not spec.disable_any_whitespace, max_whitespace_cnt=MAX_WHITESPACE)
        try:
            if spec.json_object:
                return compiler.compile_json_schema({"type": "object"}, **ws)
            if spec.json is not None:
                schema = spec.json
                if isinstance(schema, str):
                    try:
                        schema = json.loads(schema)
                    except ValueError as e:
                        raise ValueError(f"the JSON schema is not valid JSON: {e}") from None
                if not isinstance(schema, (dict, bool)):
                    raise ValueError("the JSON schema must be a JSON object")
                return compiler.compile_json_schema(json.dumps(strict_strings(schema)), **ws)
            if spec.regex is not None:
                return compiler.compile_regex(spec.regex)
            if spec.choice is not None:
                return compiler.compile_grammar(choice_grammar(spec.choice))
            return compiler.compile_grammar(spec.grammar)
        except ValueError:
            raise
        except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError with the parser's message
            what = "JSON schema" if spec.json is not None else "regex" if spec.regex is not None else "grammar"
            message = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            message = re.sub(r"^(\[[^\]]*\]\s*)?(\S+:\d+:\s*)?", "", message)  # drop the C++ log prefix (time, file:line)
            raise ValueError(f"the {what} cannot be compiled: {message}") from None

    def matcher(self, compiled):
        import xgrammar as xgr

        return xgr.GrammarMatcher(compiled)

    def fill(self, matchers: list, bitmask: torch.Tensor, rows: list[int]) -> None:
        """Each matcher's next allowed tokens into its row of the bitmask; many rows on
        xgrammar's threads (a JSON row takes ~0.1-1 ms, a batch of 256 would be the step)."""
        if len(matchers) == 1:
            matchers[0].fill_next_token_bitmask(bitmask, rows[0])
            return
        if self._batch is None:
            import xgrammar as xgr

            self._batch = xgr.BatchGrammarMatcher()
        self._batch.batch_fill_next_token_bitmask(matchers, bitmask, rows)


def narrow_row(bitmask: torch.Tensor, row: int, seq, vocab_size: int, bans: list[int]) -> None:
    """Narrow one row's mask (the grammar's tokens, or all ones) by allowed_token_ids and the
    bans (min_tokens, bad_words), each kept only while something is still allowed (the
    grammar wins: a row is never all -inf, which would sample NaN)."""
    words = bitmask[row].numpy()
    allowed = seq.request.allowed_mask
    if allowed is not None:
        narrowed = words & allowed
        if seq.matcher is None or words_allowed(narrowed, vocab_size):
            words[:] = narrowed
    if bans:
        kept = words.copy()
        ids = np.asarray(bans)
        np.bitwise_and.at(kept, ids // 32, ~(np.int32(1) << (ids % 32).astype(np.int32)))
        if words_allowed(kept, vocab_size):
            words[:] = kept
