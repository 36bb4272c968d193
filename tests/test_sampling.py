"""The engine's inverse-CDF sampler (`inverse_cdf`): each token drawn with its probability, never
one of probability 0, rare tokens at the end of a large vocabulary kept, the same tokens as a
single float64 running sum over the row."""

from __future__ import annotations

import pytest
import torch

from areal_lite.engines.local.sampling import CDF_BLOCK, SMALL_VOCAB, inverse_cdf


def one_level(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The reference: one float64 running sum over each whole row."""
    cdf = probs.double().cumsum(dim=-1)
    return torch.searchsorted(cdf, u * cdf[:, -1:], right=True)[:, 0].clamp(max=probs.shape[1] - 1)


@pytest.mark.parametrize("vocab", [7, CDF_BLOCK, 600, SMALL_VOCAB + 1, 2 * SMALL_VOCAB + 100, 49152, 151936])
def test_same_tokens_as_one_float64_running_sum(vocab: int) -> None:
    g = torch.Generator().manual_seed(vocab)
    rows = 8 if vocab > 10000 else 200
    probs = torch.softmax(3 * torch.randn(rows, vocab, generator=g), dim=-1)
    u = torch.rand(rows, 1, generator=g, dtype=torch.float64)
    assert torch.equal(inverse_cdf(probs, u), one_level(probs, u))


def test_each_token_takes_its_probability_of_the_unit_interval() -> None:
    """On a grid of 200001 uniforms the tokens come out in order, each over a share of the grid
    equal to its probability (to the grid's step): the sampler is the inverse CDF, exactly."""
    g = torch.Generator().manual_seed(0)
    vocab = SMALL_VOCAB + 2 * CDF_BLOCK + 88  # two levels, the last block partial
    probs = torch.softmax(torch.randn(1, vocab, generator=g), dim=-1)
    n = 200001
    u = torch.linspace(0, 1, n, dtype=torch.float64)[:-1, None]
    tokens = torch.cat([inverse_cdf(probs.expand(len(c), -1), c) for c in u.split(20000)])
    assert bool((tokens[1:] >= tokens[:-1]).all())
    share = torch.bincount(tokens, minlength=vocab).double() / (n - 1)
    torch.testing.assert_close(share, probs[0].double() / probs[0].double().sum(), atol=2 / n, rtol=0)


@pytest.mark.parametrize("vocab", [5 * CDF_BLOCK + 17, 10 * CDF_BLOCK + 17])
def test_never_a_token_of_probability_zero(vocab: int) -> None:
    """Zeros everywhere but a few tokens, whole blocks of zeros first and last (suppressed or
    filtered tokens), and the extreme uniforms 0 and the largest below 1; one running sum (a
    small vocabulary) and two levels."""
    probs = torch.zeros(4, vocab)
    probs[0, [300, 301, 900]] = torch.tensor([0.2, 0.3, 0.5])
    probs[1, CDF_BLOCK - 1] = 1.0  # the last entry of the first block
    probs[2, 2 * CDF_BLOCK] = 1e-30  # one tiny token
    probs[3, ::2] = 1.0 / len(range(0, vocab, 2))
    for value in (0.0, 1.0 - 2**-53, 0.5, 0.9999999):
        u = torch.full((4, 1), value, dtype=torch.float64)
        tokens = inverse_cdf(probs, u)
        assert bool((probs.gather(1, tokens[:, None]) > 0).all()), (value, tokens)
    assert inverse_cdf(probs[1:3], torch.rand(2, 1, dtype=torch.float64)).tolist() == [CDF_BLOCK - 1, 2 * CDF_BLOCK]


def test_a_rare_token_at_the_end_of_a_large_vocabulary_keeps_its_share() -> None:
    """A token of probability 1e-12 after 151935 others: a float32 running sum (1 + 1e-12 == 1)
    would never reach it. Here it holds the top 1e-12 of the unit interval."""
    vocab = 151936
    probs = torch.zeros(1, vocab)
    probs[0, :1000] = (1 - 1e-12) / 1000
    probs[0, -1] = 1e-12
    top = torch.tensor([[1.0 - 2**-53]], dtype=torch.float64)
    below = torch.tensor([[1.0 - 3e-12]], dtype=torch.float64)
    assert inverse_cdf(probs, top).item() == vocab - 1
    assert inverse_cdf(probs, below).item() < 1000
