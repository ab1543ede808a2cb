"""top-k and top-p over a batch of rows, each with its own values (or none), on every path
the sampler takes (a threshold for top-k alone; top-p among the top candidates, or after a
full sort when a row's nucleus may reach past them) against transformers' warpers applied
row by row in their order: top-k, then top-p over what top-k kept."""

import pytest
import torch
from transformers import TopKLogitsWarper, TopPLogitsWarper

from shoal.runtime.layers.sampler import SamplingMetadata, apply_top_k_top_p_min_p

VOCAB = 3000


def batch(rows: int, with_top_k: bool, with_top_p: bool, seed: int = 0, scales=(0.3, 1.0, 3.0, 8.0)):
    g = torch.Generator().manual_seed(seed)
    # some rows peaked (a nucleus of a few tokens), some flat (a nucleus of thousands)
    scale = torch.tensor(scales)[torch.arange(rows) % len(scales)][:, None]
    logits = torch.randn(rows, VOCAB, generator=g) * scale
    top_k = [int(k) if i % 3 else VOCAB for i, k in enumerate(torch.randint(1, 400, (rows,), generator=g))]
    top_p = [float(p) if i % 5 else 1.0 for i, p in enumerate(torch.rand(rows, generator=g) * 0.9 + 0.05)]
    m = SamplingMetadata(temperature=torch.ones(rows), greedy=torch.zeros(rows, dtype=torch.bool), all_greedy=False)
    if with_top_k:
        m.top_k = torch.tensor(top_k)
        m.max_top_k = max(k for k in top_k if k < VOCAB)
    if with_top_p:
        m.top_p = torch.tensor(top_p)
    return logits, m, top_k if with_top_k else [VOCAB] * rows, top_p if with_top_p else [1.0] * rows


def reference(logits, top_k, top_p):
    out = []
    for row, k, p in zip(logits, top_k, top_p, strict=True):
        x = row[None].clone()
        if k < VOCAB:
            x = TopKLogitsWarper(k)(None, x)
        if p < 1.0:
            x = TopPLogitsWarper(p)(None, x)
        out.append(x[0])
    return torch.stack(out)


@pytest.mark.parametrize("candidates", [None, 0, 64], ids=["default", "sorted", "few-candidates"])
@pytest.mark.parametrize("which", ["top_k", "top_p", "both"])
def test_kept_tokens_match_transformers(candidates, which):
    logits, m, top_k, top_p = batch(48, which != "top_p", which != "top_k")
    ours = apply_top_k_top_p_min_p(logits.clone(), m, candidates=candidates)
    want = reference(logits, top_k, top_p)
    kept, wanted = torch.isfinite(ours), torch.isfinite(want)
    assert torch.equal(kept, wanted), (kept.sum(-1) - wanted.sum(-1)).tolist()
    assert torch.equal(ours[kept], logits[kept])  # what is kept is unchanged
    if which != "top_k":
        assert (wanted.sum(-1) > 64).any() and (wanted.sum(-1) < 64).any()  # nuclei inside and past the candidates


@pytest.mark.parametrize("which", ["top_p", "both"])
def test_nuclei_within_the_candidates_never_sort(which, monkeypatch):
    from shoal.runtime.layers import sampler

    logits, m, top_k, top_p = batch(48, which == "both", True, scales=(4.5, 6.0, 9.0))
    want = reference(logits, top_k, top_p)
    nuclei = torch.isfinite(want).sum(-1)[torch.tensor(top_p) < 1.0]  # rows with top_p 1 keep all (or top-k's)
    assert (nuclei <= 64).all() and (nuclei > 8).any()

    def no_sort(*_):
        raise AssertionError("sorted the whole vocabulary")

    monkeypatch.setattr(sampler, "_top_k_top_p_sorted", no_sort)
    ours = apply_top_k_top_p_min_p(logits.clone(), m, candidates=64)
    assert torch.equal(torch.isfinite(ours), torch.isfinite(want))


def _sampling(rows, temperature, top_p=None, top_k=None, greedy=None):
    greedy = torch.zeros(rows, dtype=torch.bool) if greedy is None else greedy
    m = SamplingMetadata(temperature=temperature, greedy=greedy, all_greedy=False)
    if top_p is not None:
        m.top_p = top_p
    if top_k is not None:
        m.top_k, m.max_top_k = top_k, int(top_k[top_k < VOCAB].max())
    return m


def _c_sampler():
    from shoal.runtime.models import cpu_llama

    if cpu_llama.cpu_supported() is not None:
        pytest.skip(cpu_llama.cpu_supported())
    return cpu_llama.sample_top_p


@pytest.mark.parametrize("with_top_k", [False, True])
def test_c_sampler_draws_the_nucleus_distribution_of_the_sorted_path(with_top_k):
    """The CPU's C sampler (temperature, top-p by drawing again until the token lies in the
    nucleus) against the distribution transformers' warpers keep after the temperature: every
    draw inside the nucleus, and each token's frequency within 5 standard deviations of its
    probability over 6000 draws a row; flat and peaked rows, greedy rows left greedy."""
    from shoal.runtime.layers.sampler import sample_tokens

    vocab, draws = 40, 6000
    g = torch.Generator().manual_seed(3)
    base = torch.randn(6, vocab, generator=g) * torch.tensor([0.2, 1.0, 3.0, 1.0, 0.5, 2.0])[:, None]
    temperature = torch.tensor([0.7, 1.0, 1.3, 0.8, 2.0, 1.0])
    top_p = torch.tensor([0.9, 0.5, 0.95, 1.0, 0.3, 0.8])
    top_k = torch.tensor([VOCAB, 12, 5, 20, VOCAB, 3]) if with_top_k else None
    want = []
    for i in range(6):
        x = (base[i] / temperature[i])[None]
        if top_k is not None and top_k[i] < VOCAB:
            x = TopKLogitsWarper(int(top_k[i]))(None, x)
        if top_p[i] < 1:
            x = TopPLogitsWarper(float(top_p[i]))(None, x)
        want.append(x[0].softmax(-1))
    want = torch.stack(want)
    rep = lambda t: None if t is None else t.repeat_interleave(draws, 0)  # noqa: E731
    greedy = torch.zeros(6 * draws, dtype=torch.bool)
    greedy[::97] = True
    m = _sampling(6 * draws, rep(temperature), rep(top_p), rep(top_k), greedy)
    logits = rep(base)
    torch.manual_seed(0)
    tokens = sample_tokens(logits.clone(), m, native=_c_sampler())
    assert torch.equal(tokens[greedy], logits[greedy].argmax(-1))
    rows = torch.arange(6).repeat_interleave(draws)[~greedy]
    tokens = tokens[~greedy]
    for i in range(6):
        mine = tokens[rows == i]
        freq = torch.bincount(mine, minlength=vocab).double() / len(mine)
        p = want[i].double()
        assert bool((freq[p == 0] == 0).all()), f"row {i}: drew outside the nucleus"
        sigma = (p * (1 - p) / len(mine)).sqrt()
        assert bool(((freq - p).abs() <= 5 * sigma + 1e-3).all()), (i, (freq - p).abs().max())


def test_c_sampler_with_a_tiny_p_over_a_flat_row_sorts_that_row():
    """p = 0.002 over 3000 nearly equal logits: draws from the whole row almost never land in
    the nucleus, so after 16 misses the row's threshold comes from a sort; still inside it."""
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(64, VOCAB, generator=g) * 0.01
    nucleus = torch.isfinite(TopPLogitsWarper(0.002)(None, logits.clone()))
    tokens = _c_sampler()(logits, torch.ones(64), torch.full((64,), 0.002), 1.0 - torch.rand(64, dtype=torch.float64))
    assert bool(nucleus[torch.arange(64), tokens].all())


def test_c_sampler_without_top_p_is_the_inverse_cdf_of_the_torch_path():
    """top_p 1: the same uniform gives the same token as torch's cumsum and searchsorted."""
    from shoal.runtime.layers.sampler import _inverse_cdf

    g = torch.Generator().manual_seed(2)
    logits = torch.randn(256, 49152, generator=g) * 2
    u = 1.0 - torch.rand(256, dtype=torch.float64, generator=g)
    ours = _c_sampler()(logits, torch.full((256,), 0.8), torch.ones(256), u)
    theirs = _inverse_cdf((logits / 0.8).softmax(-1), u)
    assert (ours == theirs).float().mean() >= 0.98  # float sums in another order may cross a boundary
