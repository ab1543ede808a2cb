"""Rows sample by inverse CDF from one uniform each; a seeded row's is splitmix64 of (seed,
step) on int64 tensors, checked against the reference algorithm in Python integers. The
tokens drawn, seeded or not, follow the row's distribution."""

import random

import torch

from shoal.runtime.layers.sampler import SamplingMetadata, sample_tokens, seeded_uniforms

MASK = (1 << 64) - 1


def splitmix64(x: int) -> int:  # the reference (Steele, Lea, Flood 2014; Vigna's C code), on uint64
    x = (x + 0x9E3779B97F4A7C15) & MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK
    return x ^ (x >> 31)


def test_uniforms_are_splitmix64_of_the_seed_then_the_step():
    rng = random.Random(0)
    seeds = [0, 1, -1, 2**63 - 1, -(2**63)] + [rng.randrange(-(2**63), 2**63) for _ in range(200)]
    steps = [0, 1, 7, 2**31] + [rng.randrange(0, 2**40) for _ in range(201)]
    got = seeded_uniforms(torch.tensor(seeds), torch.tensor(steps)).tolist()
    for seed, step, u in zip(seeds, steps, got, strict=True):
        x = splitmix64((splitmix64(seed & MASK) + step) & MASK)
        assert u == ((x >> 11) + 0.5) / 2**53
        assert 0.0 < u < 1.0


def metadata(rows: int, seeds, steps, **extra) -> SamplingMetadata:
    return SamplingMetadata(temperature=torch.ones(rows), greedy=torch.zeros(rows, dtype=torch.bool), all_greedy=False,
                            seed_rows=torch.arange(rows), seeds=torch.tensor(seeds), seed_steps=torch.tensor(steps), **extra)


def test_seeded_tokens_follow_the_distribution_and_never_a_masked_token():
    probs = torch.tensor([0.4, 0.3, 0.0, 0.2, 0.1, 0.0])
    rows = 20000
    logits = probs.log().expand(rows, -1).clone()  # log 0 = -inf: never drawn
    tokens = sample_tokens(logits, metadata(rows, list(range(rows)), [3] * rows))
    counts = torch.bincount(tokens, minlength=6).double()
    assert counts[2] == counts[5] == 0
    expected = probs.double() * rows
    live = expected > 0
    chi2 = float((((counts - expected) ** 2)[live] / expected[live]).sum())
    assert chi2 < 30, (counts, chi2)  # 3 degrees of freedom: p < 1e-6 beyond 30


def test_unseeded_tokens_follow_the_distribution_too():
    torch.manual_seed(0)
    probs = torch.tensor([0.05, 0.0, 0.45, 0.3, 0.2])
    rows = 20000
    m = SamplingMetadata(temperature=torch.ones(rows), greedy=torch.zeros(rows, dtype=torch.bool), all_greedy=False)
    counts = torch.bincount(sample_tokens(probs.log().expand(rows, -1).clone(), m), minlength=5).double()
    assert counts[1] == 0
    expected = probs.double() * rows
    live = expected > 0
    assert float((((counts - expected) ** 2)[live] / expected[live]).sum()) < 30, counts


def test_a_seed_gives_the_same_token_at_the_same_step_whatever_the_row_and_different_ones_at_other_steps():
    torch.manual_seed(0)
    logits = torch.randn(1, 512)
    one = [int(sample_tokens(logits.clone(), metadata(1, [77], [step]))[0]) for step in range(40)]
    crowd = torch.randn(5, 512)
    crowd[3] = logits[0]
    m = SamplingMetadata(temperature=torch.ones(5), greedy=torch.zeros(5, dtype=torch.bool), all_greedy=False,
                         seed_rows=torch.tensor([3]), seeds=torch.tensor([77]), seed_steps=torch.tensor([11]))
    assert int(sample_tokens(crowd, m)[3]) == one[11]
    assert len(set(one)) > 10  # the steps draw different uniforms


def test_a_uniform_of_one_never_lands_past_the_last_token_with_mass():
    from shoal.runtime.layers.sampler import _inverse_cdf

    probs = torch.tensor([[0.1, 0.6, 0.3, 0.0, 0.0], [1 / 3, 1 / 3, 1 / 3, 0.0, 0.0]])
    for u in (1.0, 1.0 - 1e-12, 1.0 - 2**-53):
        assert _inverse_cdf(probs, torch.tensor([u, u], dtype=torch.float64)).tolist() == [2, 2]
