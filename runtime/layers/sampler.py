"""Turn a step's logits into tokens, batched over every row that samples.

The sampler sees tensors and parameters only (SamplingMetadata, built by the engine's
step_input.py), never the engine's sequences, so it runs wherever the logits are (the
CPU, or the device). Penalties, min_tokens, temperature, top-k, top-p and min-p are each
applied only when some row asks for them, so an all-greedy batch costs one argmax.
Rows sample by inverse CDF: one uniform a row, the first token whose cumulative
probability reaches it (a cumsum and a searchsorted; on a CPU 3.6x cheaper than the
exponential race it replaced, which drew a random number for every logit). A seeded
row's uniform is a fixed function of (seed, how many tokens the sequence has sampled
before): splitmix64 on int64 tensors, one batched op for all seeded rows, no generator
objects and no per-row work. So a seed gives the same text whatever else is in the
batch, after a preemption, and on any device that computes the same probabilities.

On the CPU the runner hands in `native` (models/cpu_llama.py, sample_top_p): temperature,
top-p and the draw in C, a few passes over each row and no sort. It draws from the whole
distribution and keeps the token when the mass strictly above it is below p (the rule of the
sorted cumsum), else draws again: the nucleus's distribution exactly, whatever its size (the
candidate set below falls back to a full sort when the nucleus is wide, as in a flat
distribution). min-p and top-k are applied in torch first.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field

import torch

log = logging.getLogger(__name__)


@dataclass
class SamplingMetadata:
    """One row per sampling sequence; optional tensors are None when no row uses them."""

    temperature: torch.Tensor  # [S] float32, as asked; greedy rows ignore it
    greedy: torch.Tensor  # [S] bool
    all_greedy: bool
    top_k: torch.Tensor | None = None  # [S] long; >= vocab means off
    max_top_k: int = 0  # the largest k below the vocabulary (known on the host: no sync to read it)
    top_p: torch.Tensor | None = None  # [S] float32
    min_p: torch.Tensor | None = None  # [S] float32
    repetition_penalty: torch.Tensor | None = None  # [S] float32
    seen_ids: torch.Tensor | None = None  # [S, W] long: prompt + output ids, padded with -1
    presence_penalty: torch.Tensor | None = None  # [S] float32
    frequency_penalty: torch.Tensor | None = None  # [S] float32
    output_ids: torch.Tensor | None = None  # [S, W] long: output ids, padded with -1
    banned_rows: torch.Tensor | None = None  # [N] long, with banned_ids: (row, token) pairs set to -inf
    banned_ids: torch.Tensor | None = None  # [N] long
    bias_rows: torch.Tensor | None = None  # [B] long, with bias_ids, bias_values: logit_bias added at (row, token)
    bias_ids: torch.Tensor | None = None  # [B] long
    bias_values: torch.Tensor | None = None  # [B] float32
    # [S, ceil(V / 32)] int32: bit j of word i allows token 32 i + j (xgrammar's layout);
    # rows without a grammar or allowed_token_ids are all ones
    token_bitmask: torch.Tensor | None = None
    # [4, F] long (async scheduling): rows whose last token is still in flight; the runner writes
    # it at seen_ids[row, column 1] and output_ids[row, column 2], from the previous step's row 3
    history_fill: torch.Tensor | None = None
    seed_rows: torch.Tensor | None = None  # [K] long: the rows with a seed, with seeds and seed_steps:
    seeds: torch.Tensor | None = None  # [K] int64: the request's seed + the sequence's index (n > 1)
    seed_steps: torch.Tensor | None = None  # [K] int64: tokens the sequence sampled before this one
    num_logprobs: list[int | None] | None = None  # per row: top-k log-probabilities wanted, or None

    def select(self, row: int) -> "SamplingMetadata":
        """The metadata of one row alone (a batch of one)."""
        one = {k: v[row : row + 1] if isinstance(v, torch.Tensor) else v for k, v in vars(self).items()}
        # entries addressed by row number (rows, then their values): that row's, renumbered 0
        for rows, *values in (("banned_rows", "banned_ids"), ("bias_rows", "bias_ids", "bias_values"),
                              ("seed_rows", "seeds", "seed_steps")):
            if one[rows] is not None:
                mine = getattr(self, rows) == row
                one[rows] = torch.zeros(int(mine.sum()), dtype=torch.long, device=mine.device)
                one.update({name: getattr(self, name)[mine] for name in values})
        one["all_greedy"] = bool(self.greedy[row])
        one["num_logprobs"] = None if self.num_logprobs is None else [self.num_logprobs[row]]
        return SamplingMetadata(**one)


@dataclass
class SampleResult:
    token_ids: list[int]
    logprobs: list[dict[int, float]] | None  # per row, when any row asked for them
    chosen_logprobs: list[float] | None
    failed: dict[int, str] = field(default_factory=dict)  # row -> why its sampling raised (its token is 0)


def _counts(ids: torch.Tensor, vocab: int) -> torch.Tensor:
    """[S, W] ids padded with -1 -> [S, V] occurrence counts."""
    valid = ids >= 0
    counts = torch.zeros(ids.shape[0], vocab, dtype=torch.float32, device=ids.device)
    return counts.scatter_add_(1, ids.clamp(min=0), valid.float())


def apply_penalties(logits: torch.Tensor, m: SamplingMetadata) -> None:
    vocab = logits.shape[1]
    if m.repetition_penalty is not None:
        # as transformers and vLLM: every token seen (prompt and output) is penalized once
        seen = _counts(m.seen_ids, vocab) > 0
        r = m.repetition_penalty[:, None].expand_as(logits)
        penalized = torch.where(logits > 0, logits / r, logits * r)
        logits.copy_(torch.where(seen, penalized, logits))
    if m.presence_penalty is not None:
        counts = _counts(m.output_ids, vocab)
        logits -= m.frequency_penalty[:, None] * counts + m.presence_penalty[:, None] * (counts > 0)


# On a CPU, top-p first looks for each row's nucleus among this many top tokens (a topk,
# O(V)), sorting the whole vocabulary (O(V log V), ~5x a plain sampling step) only when
# some row's candidates hold less than its p. On a GPU the sort is cheap and needs no sync.
TOP_P_CANDIDATES = 1024


def apply_top_k_top_p_min_p(logits: torch.Tensor, m: SamplingMetadata, candidates: int | None = None) -> torch.Tensor:
    """min-p on the full distribution (vLLM's order), then top-k, then top-p over what top-k
    kept (vLLM's and transformers' order). `candidates`: see TOP_P_CANDIDATES (0: sort)."""
    if m.min_p is not None:
        probs = logits.softmax(-1)
        threshold = probs.max(-1, keepdim=True).values * m.min_p[:, None]
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    if m.top_p is None:
        return logits if m.top_k is None else _top_k_only(logits, m.top_k, m.max_top_k)
    if candidates is None:
        candidates = TOP_P_CANDIDATES if logits.device.type == "cpu" else 0
    if candidates and max(candidates, m.max_top_k) < logits.shape[1]:
        kept = _top_k_top_p_among(logits, m, max(candidates, m.max_top_k))
        if kept is not None:
            return kept
    return _top_k_top_p_sorted(logits, m)


def _top_k_only(logits: torch.Tensor, top_k: torch.Tensor, max_top_k: int) -> torch.Tensor:
    """Each row's k-th largest logit as a threshold (ties kept, as transformers' TopKLogitsWarper):
    one topk of the largest k asked for, no sort; rows without top-k (k >= V) keep everything."""
    vocab = logits.shape[1]
    top = logits.topk(max(1, min(max_top_k, vocab)), dim=-1).values
    kth = top.gather(1, (top_k.clamp(1, top.shape[1]) - 1)[:, None])
    kth = kth.masked_fill((top_k >= vocab)[:, None], float("-inf"))
    return logits.masked_fill(logits < kth, float("-inf"))


def _keep_top_k(ordered: torch.Tensor, top_k: torch.Tensor | None) -> torch.Tensor:
    """Logits sorted largest first, with each row's entries past its k set to -inf."""
    if top_k is None:
        return ordered
    ranks = torch.arange(ordered.shape[1], device=ordered.device)[None, :]
    return ordered.masked_fill(ranks >= top_k.clamp(max=ordered.shape[1])[:, None], float("-inf"))


def _past_nucleus(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """For probabilities sorted largest first: True past each row's nucleus. The token that
    crosses p is kept; a row with p = 1 keeps all (its float sum may reach 1 early)."""
    return ((probs.cumsum(-1) - probs) >= top_p[:, None]) & (top_p < 1.0)[:, None]


def _top_k_top_p_sorted(logits: torch.Tensor, m: SamplingMetadata) -> torch.Tensor:
    sorted_logits, order = logits.sort(-1, descending=True)
    sorted_logits = _keep_top_k(sorted_logits, m.top_k)
    drop = _past_nucleus(sorted_logits.softmax(-1), m.top_p)
    return logits.scatter(1, order, sorted_logits.masked_fill(drop, float("-inf")))


def _top_k_top_p_among(logits: torch.Tensor, m: SamplingMetadata, count: int) -> torch.Tensor | None:
    """top-k then top-p among each row's `count` largest logits (count >= every k asked for),
    or None when a row's candidates hold less than its p of the mass (its nucleus may reach
    past them). The probabilities are the full distribution's (or top-k's, where set)."""
    values, index = logits.topk(count, dim=-1)  # sorted, largest first
    values = _keep_top_k(values, m.top_k)
    limited = (m.top_k < logits.shape[1]) if m.top_k is not None else torch.zeros_like(m.top_p, dtype=torch.bool)
    norm = torch.where(limited, values.logsumexp(-1), logits.logsumexp(-1))
    probs = (values - norm[:, None]).exp()
    whole = m.top_p >= 1.0  # top-p off: keeps what top-k kept, or everything
    if not bool(((probs.sum(-1) >= m.top_p) | whole).all()):
        return None
    drop = _past_nucleus(probs, m.top_p)
    out = torch.full_like(logits, float("-inf")).scatter_(1, index, values.masked_fill(drop, float("-inf")))
    return torch.where((whole & ~limited)[:, None], logits, out)


# splitmix64's constants as int64 (torch has no uint64 arithmetic; int64 products wrap the same)
_GOLDEN, _MIX1, _MIX2 = (c - (1 << 64) for c in (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB))


def _shift_right(x: torch.Tensor, k: int) -> torch.Tensor:
    """x >> k as on uint64: torch's >> on int64 copies the sign bit in."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def _splitmix64(x: torch.Tensor) -> torch.Tensor:
    x = x + _GOLDEN
    x = (x ^ _shift_right(x, 30)) * _MIX1
    x = (x ^ _shift_right(x, 27)) * _MIX2
    return x ^ _shift_right(x, 31)


def seeded_uniforms(seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """[K] float64 in (0, 1), a fixed function of each (seed, step) pair (int64 tensors)."""
    x = _splitmix64(_splitmix64(seeds) + steps)
    return (_shift_right(x, 11).double() + 0.5) / 2.0**53


def _inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """[K, V] probabilities, [K] uniforms in (0, 1] -> [K] tokens: the first whose cumulative
    mass reaches u of the row's total (never a token of probability 0, as u > 0)."""
    cdf = probs.cumsum(-1)
    total = cdf[:, -1:]
    # u <= 1 and the total is a value of cdf's dtype, so the rounded target never passes it
    return torch.searchsorted(cdf, (u[:, None] * total.double()).to(cdf.dtype)).squeeze(1)


_MASK_TABLES: dict[torch.device, torch.Tensor] = {}


def _mask_table(device: torch.device) -> torch.Tensor:
    """[256, 8] float32: for each byte value, 0 where its bit is set and -inf where it is not."""
    table = _MASK_TABLES.get(device)
    if table is None:
        bits = (torch.arange(256)[:, None] >> torch.arange(8)) & 1
        table = _MASK_TABLES[device] = torch.zeros(256, 8).masked_fill_(bits == 0, float("-inf")).to(device)
    return table


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """logits [S, V] (in place): -inf wherever the packed bitmask [S, ceil(V / 32)] has a 0
    bit, unchanged elsewhere, on whatever device they are. The int32 words are read as bytes
    (little-endian, as on x86, ARM and GPUs: token t is bit t % 8 of byte t // 8), each byte
    looked up in a 256 x 8 table of 0 / -inf and the result added: one gather and one add,
    ~8x faster on a CPU than unpacking with shifts and masked_fill (32 x 49k: 0.85 against 6.6 ms)."""
    rows = bitmask.shape[0]
    bias = torch.nn.functional.embedding(bitmask.contiguous().view(torch.uint8).long(), _mask_table(logits.device))
    logits.add_(bias.view(rows, -1)[:, : logits.shape[1]])


def _uniforms(m: SamplingMetadata, n: int, device) -> torch.Tensor:
    """[n] float64 in (0, 1]: each row's draw, a fixed function of (seed, step) for seeded rows."""
    u = 1.0 - torch.rand(n, dtype=torch.float64, device=device)
    if m.seed_rows is not None:
        u[m.seed_rows] = seeded_uniforms(m.seeds, m.seed_steps)
    return u


def _sample_native(logits: torch.Tensor, m: SamplingMetadata, native) -> torch.Tensor:
    """The CPU's C sampler: temperature and top-p in C; min-p and top-k in torch beforehand."""
    temperature = torch.where(m.greedy, 0.0, m.temperature)
    if m.min_p is not None or m.top_k is not None:
        scaled = logits / torch.where(m.greedy, 1.0, m.temperature)[:, None]
        logits = apply_top_k_top_p_min_p(scaled, dataclasses.replace(m, top_p=None))
        temperature = torch.where(m.greedy, 0.0, 1.0)
    top_p = m.top_p if m.top_p is not None else torch.ones_like(temperature)
    return native(logits, temperature, top_p, _uniforms(m, len(logits), logits.device))


def sample_tokens(logits: torch.Tensor, m: SamplingMetadata, native=None) -> torch.Tensor:
    """logits [S, V] float32 (modified in place) -> token ids [S], on the logits' device.
    `native`: the CPU's C sampler (module docstring), or None."""
    if m.repetition_penalty is not None or m.presence_penalty is not None:
        apply_penalties(logits, m)
    if m.bias_rows is not None:
        logits.index_put_((m.bias_rows, m.bias_ids), m.bias_values, accumulate=True)
    if m.banned_rows is not None:
        logits[m.banned_rows, m.banned_ids] = float("-inf")
    if m.token_bitmask is not None:  # last: the grammar wins over the bias (the engine keeps a bit set)
        apply_token_bitmask(logits, m.token_bitmask)
    if m.all_greedy:
        return logits.argmax(-1)
    if native is not None and logits.device.type == "cpu":
        return _sample_native(logits, m, native)
    scaled = apply_top_k_top_p_min_p(logits / torch.where(m.greedy, 1.0, m.temperature)[:, None], m)
    probs = scaled.softmax(-1)
    u = _uniforms(m, len(probs), probs.device)
    return torch.where(m.greedy, logits.argmax(-1), _inverse_cdf(probs, u))


def _to_host(t: torch.Tensor) -> tuple[torch.Tensor, object]:
    """Start copying a device tensor to pinned host memory now, queued right behind the work
    that makes it; (the host copy, an event that marks it done). Waiting on that event later
    waits for this step only, not for a next step queued meanwhile (async scheduling). On the
    CPU: the tensor itself, no event."""
    if t.device.type != "cuda":
        return t, None
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    done = torch.cuda.Event()
    done.record()
    return host, done


class Sampled:
    """A batch's sampled tokens (and log-probabilities), on their way to the host: the step's
    one device-to-host transfer is queued at once, and result() waits for it. `tokens` stays
    on the device, where the next step may read it as its input (StepInput.fill_rows)."""

    def __init__(self, tokens: torch.Tensor, want: list[int | None] | None, raw_logprobs: torch.Tensor | None):
        self.want = want
        self.tokens = tokens
        if raw_logprobs is None:
            packed = tokens
        else:
            chosen = raw_logprobs.gather(1, tokens[:, None])
            top_vals, top_ids = raw_logprobs.topk(max(1, max(k or 0 for k in want)), dim=-1)
            # one tensor, one transfer: float64 holds token ids and float32 values exactly
            packed = torch.cat((tokens[:, None].double(), chosen.double(), top_vals.double(), top_ids.double()), 1)
        self.packed, self.copied = _to_host(packed)

    def result(self) -> SampleResult:
        if self.copied is not None:
            self.copied.synchronize()
        if self.want is None:
            return SampleResult(self.packed.tolist(), None, None)
        rows = self.packed.tolist()
        k_max = (len(rows[0]) - 2) // 2 if rows else 0
        tokens = [int(r[0]) for r in rows]
        chosen = [r[1] for r in rows]
        per_row = []
        for row, k in zip(rows, self.want):
            entry = {}
            if k is not None:
                entry = dict(zip((int(t) for t in row[2 + k_max : 2 + k_max + k]), row[2 : 2 + k]))
                entry[int(row[0])] = row[1]
            per_row.append(entry)
        return SampleResult(tokens, per_row, chosen)


@torch.inference_mode()
def sample_on_device(logits: torch.Tensor, m: SamplingMetadata, native=None):
    """logits [S, V], one row per sampling sequence -> the tokens, not yet read back
    (.result()). When the batch raises, the rows are sampled one by one and those that
    still raise are reported in the result's `failed`: one request's values fail that
    request, never the batch. (Rows sampled again start from logits that the failed
    attempt may already have penalized: a rare path, not worth a copy of every step's logits.)"""
    logits = logits.float()
    try:
        return _sample_batch(logits, m, native)
    except Exception:  # noqa: BLE001 - isolate the row(s) that raise
        return _sample_rows(logits, m, native)


def _sample_batch(logits: torch.Tensor, m: SamplingMetadata, native=None) -> Sampled:
    raw_logprobs = logits.log_softmax(-1) if m.num_logprobs is not None else None  # the model's, before penalties
    return Sampled(sample_tokens(logits, m, native), m.num_logprobs, raw_logprobs)


def _sample_rows(logits: torch.Tensor, m: SamplingMetadata, native=None) -> "Sampled":
    tokens, logprobs, chosen, failed = [], [], [], {}
    for row in range(logits.shape[0]):
        try:
            r = _sample_batch(logits[row : row + 1], m.select(row), native).result()
        except Exception as e:  # noqa: BLE001
            log.exception("sampling failed for row %d", row)
            failed[row] = f"sampling failed: {type(e).__name__}: {e}"
            r = SampleResult([0], [{}], [0.0])
        tokens.append(r.token_ids[0])
        logprobs.append(r.logprobs[0] if r.logprobs else {})
        chosen.append(r.chosen_logprobs[0] if r.chosen_logprobs else 0.0)
    done = SampleResult(tokens, logprobs if m.num_logprobs is not None else None,
                        chosen if m.num_logprobs is not None else None, failed)
    return Finished(done, torch.tensor(tokens, dtype=torch.long, device=logits.device))


class Finished:
    """A result that is already there (on the host, or a step run to its end): .result() returns it.
    `tokens`: a sampled result's tokens on the sampling device (see Sampled)."""

    def __init__(self, value, tokens: torch.Tensor | None = None):
        self.value = value
        self.tokens = tokens

    def result(self):
        return self.value


def sample(logits: torch.Tensor, m: SamplingMetadata) -> SampleResult:
    """logits [S, V], one row per sampling sequence -> tokens (and log-probabilities) on the host."""
    return sample_on_device(logits, m).result()
