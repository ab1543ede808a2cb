"""From a scheduled batch to what the executor and the sampler take: flat tensors.

The engine owns its sequences; the executor and the sampler below it see only these
tensors and parameters (imports run downhill: engine -> executor -> layers).
"""

from __future__ import annotations

import itertools

import numpy as np
import torch

from shoal.runtime.cache.block_tables import BlockTables
from shoal.runtime.engine import bad_words
from shoal.runtime.engine.request import Sequence, Status
from shoal.runtime.engine.scheduler import ScheduledBatch
from shoal.runtime.engine.structured_output import narrow_row, num_words
from shoal.runtime.executor.base import StepInput
from shoal.runtime.layers.attention import AttentionMetadata
from shoal.runtime.layers.sampler import SamplingMetadata


def _padded(rows: list[list[int]], fill: int = 0, spare: int = 0) -> np.ndarray:
    """[len(rows), longest + spare] int64, each row padded with `fill`: the values stream through
    numpy in C (a nested list into torch.tensor costs ~50 ns a value, 256 block tables 0.15 ms)."""
    lens = np.fromiter(map(len, rows), dtype=np.int64, count=len(rows))
    width = max(1, int(lens.max()) + spare)
    out = np.full((len(rows), width), fill, dtype=np.int64)
    out[np.arange(width) < lens[:, None]] = np.fromiter(itertools.chain.from_iterable(rows), dtype=np.int64, count=int(lens.sum()))
    return out


def pad_rows(rows: list[list[int]], fill: int = 0, spare: int = 0) -> torch.Tensor:
    return torch.from_numpy(_padded(rows, fill, spare))


def _long(values) -> torch.Tensor:
    return torch.from_numpy(np.asarray(values, dtype=np.int64))


def prepare(batch: ScheduledBatch, sample_rows: list[int], block_size: int, tables: BlockTables, decode_plan=None,
            prev_rows: dict | None = None) -> StepInput:
    """Flatten a scheduled batch (decodes first, then prefill chunks) into model inputs. A
    decode step of 256 rows is a few list comprehensions and numpy ops, no per-row arithmetic;
    its block tables are one gather from `tables`, the rows the KV-cache manager keeps.
    A decode whose token is still in flight (async scheduling) gets a placeholder and a
    `fill_rows` entry naming its row in the previous step's sampled tokens (`prev_rows`)."""
    nd = batch.num_decodes
    decodes, prefills, chunks = batch.seqs[:nd], batch.seqs[nd:], batch.num_new_tokens[nd:]
    ids = [0 if s.num_pending else s.token_ids[s.num_computed] for s in decodes]
    fill = [(i, prev_rows[s]) for i, s in enumerate(decodes) if s.num_pending] if prev_rows else None
    pos = np.fromiter((s.num_computed for s in decodes), dtype=np.int64, count=nd)
    # With several KV-cache groups (sliding windows) every table and slot array gains a leading
    # group axis (the `...` below); one group keeps the 2-D arrays
    grouped = tables.table.shape[0] > 1
    decode_tables = np.ascontiguousarray(tables.gather(decodes)) if decodes else None
    slots = [decode_tables[..., np.arange(nd), pos // block_size] * block_size + pos % block_size] if decodes else []
    positions = [pos]
    starts = [0]
    rows = tables.rows
    for s, n in zip(prefills, chunks):
        p = np.arange(s.num_computed, s.num_computed + n)
        ids.extend(s.token_ids[s.num_computed : s.num_computed + n])
        positions.append(p)
        slots.append(rows[..., s.kv_row, p // block_size] * block_size + p % block_size)
        starts.append(starts[-1] + n)
    prefill_tables = np.ascontiguousarray(tables.gather(prefills)) if prefills else None
    # C order: numpy's fancy indexing may hand back a group-major array in Fortran order, and
    # a kernel reads a group's slots as one contiguous row (the cache write takes no stride)
    slots = np.ascontiguousarray(np.concatenate(slots, axis=-1)) if slots else None
    first = (lambda a: a[0]) if grouped else (lambda a: a)  # group 0's, in the fields every layer reads without groups
    meta = AttentionMetadata(
        slot_mapping=torch.from_numpy(first(slots)) if slots is not None else _long([]),
        num_decode_tokens=nd,
        decode_block_tables=torch.from_numpy(first(decode_tables)) if decodes and decode_plan is None else None,
        decode_context_lens=torch.from_numpy(pos + 1) if decodes else None,
        prefill_block_tables=torch.from_numpy(first(prefill_tables)) if prefills else None,
        prefill_query_start_loc=_long(starts) if prefills else None,
        prefill_context_lens=_long([s.num_computed + n for s, n in zip(prefills, chunks)]) if prefills else None,
        decode_plan=decode_plan,
    )
    if grouped and slots is not None:  # each layer reads its own group's (AttentionMetadata.per_group)
        meta.group_slot_mapping = torch.from_numpy(slots)
        meta.group_decode_block_tables = torch.from_numpy(decode_tables) if decodes else None
        meta.group_prefill_block_tables = torch.from_numpy(prefill_tables) if prefills else None
    step = StepInput(_long(ids), torch.from_numpy(np.concatenate(positions)), meta, _long(sample_rows))
    slots = [s.lora_slot for s in batch.seqs]
    if any(s is not None for s in slots):  # each token's adapter slot; None when all are base rows
        step.lora_slots = torch.from_numpy(np.repeat(np.array([-1 if s is None else s for s in slots], dtype=np.int64),
                                                     batch.num_new_tokens))
    if fill:
        step.fill_rows = _long(fill).T.contiguous()
    return step


def _column(values: list, dtype=torch.float32) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype)


def sampling_metadata(seqs: list[Sequence], eos_ids: list[int], vocab_size: int, structured=None,
                      prev_rows: dict | None = None) -> SamplingMetadata:
    """The sampling rows' parameters as tensors: one row per sequence that samples this step.
    Temperatures go through numpy; only the rows of requests that ask for more than a
    temperature and top-k/p (Request.plain_sampling) are looked at one by one. With async
    scheduling, a penalized row whose last token is still in flight gets a spare history
    column and a `history_fill` entry naming its row in the previous step (`prev_rows`)."""
    params = [s.request.params for s in seqs]
    temperature = np.fromiter([p.temperature for p in params], dtype=np.float64, count=len(params))
    greedy = temperature < 1e-5  # SamplingParams.greedy, in the same precision
    m = SamplingMetadata(temperature=torch.from_numpy(temperature.astype(np.float32)), greedy=torch.from_numpy(greedy),
                         all_greedy=bool(greedy.all()))
    penalized = repeated = logprobs = False
    bans: dict[int, list[int]] = {}  # min_tokens: EOS (unless ignored) and the stop ids cannot end it yet; bad_words
    masked, biased = [], []
    # a finished row (a step sampled late, after the one before ended it) is dropped unread: plain
    for row in [row for row, s in enumerate(seqs) if not s.request.plain_sampling and s.status is not Status.FINISHED]:
        s, p = seqs[row], params[row]
        request = s.request
        if p.min_tokens and len(s.token_ids) + s.num_pending - s.num_prompt_tokens < p.min_tokens and (p.stop_token_ids or not p.ignore_eos):
            bans[row] = ([] if p.ignore_eos else eos_ids) + p.stop_token_ids
        if request.bad_words and (words := bad_words.banned_now(request.bad_words, s.output_ids)):
            bans[row] = bans.get(row, []) + words
        if request.grammar is not None or request.allowed_mask is not None:
            masked.append(row)
        if p.logit_bias:
            biased.extend((row, t, b) for t, b in p.logit_bias.items())
        repeated |= p.repetition_penalty != 1.0
        penalized |= bool(p.presence_penalty or p.frequency_penalty)
        logprobs |= p.logprobs is not None
    if not m.all_greedy:
        top_k = [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params]
        if any(k < vocab_size for k in top_k):
            m.top_k = _column(top_k, torch.long)
            m.max_top_k = max(k for k in top_k if k < vocab_size)
        if any(p.top_p < 1.0 for p in params):
            m.top_p = _column([p.top_p for p in params])
        if any(p.min_p > 0 for p in params):
            m.min_p = _column([p.min_p for p in params])
        seeded = [(row, s) for row, (s, p) in enumerate(zip(seqs, params)) if p.seed is not None]
        if seeded:  # each sequence's own stream: seed + its index, then one draw per token it samples
            m.seed_rows = _long([row for row, _ in seeded])
            m.seeds = _long([(params[row].seed + s.index + 2**63) % 2**64 - 2**63 for row, s in seeded])  # int64, wrapped
            m.seed_steps = _long([len(s.token_ids) + s.num_pending - s.num_prompt_tokens for _, s in seeded])
    fill = [(row, s) for row, s in enumerate(seqs) if s.num_pending] if prev_rows and (repeated or penalized) else []
    spare = 1 if fill else 0  # the token in flight: -1 (no token) until the runner writes it
    if repeated:
        m.repetition_penalty = _column([p.repetition_penalty for p in params])
        m.seen_ids = pad_rows([s.token_ids for s in seqs], fill=-1, spare=spare)
    if penalized:
        m.presence_penalty = _column([p.presence_penalty for p in params])
        m.frequency_penalty = _column([p.frequency_penalty for p in params])
        m.output_ids = pad_rows([s.output_ids for s in seqs], fill=-1, spare=spare)
    if fill:
        m.history_fill = _long([(row, len(s.token_ids), len(s.token_ids) - s.num_prompt_tokens, prev_rows[s])
                                for row, s in fill]).T.contiguous()
    if masked:  # grammar, allowed_token_ids, and those rows' bans: one packed bitmask (structured_output.py)
        m.token_bitmask = torch.full((len(seqs), num_words(vocab_size)), -1, dtype=torch.int32)
        grammar_rows = [row for row in masked if seqs[row].request.grammar is not None]
        for row in grammar_rows:
            if seqs[row].matcher is None:
                seqs[row].matcher = structured.matcher(seqs[row].request.grammar)
        if grammar_rows:
            structured.fill([seqs[row].matcher for row in grammar_rows], m.token_bitmask, grammar_rows)
        for row in masked:
            row_bans = bans.pop(row, [])
            if row_bans or seqs[row].request.allowed_mask is not None:
                narrow_row(m.token_bitmask, row, seqs[row], vocab_size, row_bans)
    banned = [(row, t) for row, ids in bans.items() for t in ids]
    if banned:
        m.banned_rows = _column([r for r, _ in banned], torch.long)
        m.banned_ids = _column([t for _, t in banned], torch.long)
    if biased:
        m.bias_rows = _column([r for r, _, _ in biased], torch.long)
        m.bias_ids = _column([t for _, t, _ in biased], torch.long)
        m.bias_values = _column([b for _, _, b in biased])
    if logprobs:
        m.num_logprobs = [p.logprobs for p in params]
    return m
