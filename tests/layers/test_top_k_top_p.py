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
