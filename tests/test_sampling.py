"""`Sampler` and `next_tokens`: the next token, chosen on the device inside the decode step."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from policyzoo.sampling import Sampler, SamplingMode, next_tokens

GREEDY, SAMPLE, NUCLEUS = SamplingMode(), SamplingMode(do_sample=True), SamplingMode(do_sample=True, nucleus=True)


def _draw(logits, mode, generator, temperature=1.0, top_p=1.0):
    noise = torch.empty_like(logits, dtype=torch.float32).exponential_(generator=generator)
    return next_tokens(logits, noise, torch.tensor(temperature), torch.tensor(top_p), mode)


def test_greedy_is_argmax_and_ties_go_to_the_lowest_index():
    logits = torch.tensor([[0.0, 3.0, 3.0, 1.0], [5.0, 5.0, 5.0, 5.0]])
    assert next_tokens(logits, torch.ones(2, 4), torch.tensor(1.0), torch.tensor(1.0), GREEDY).tolist() == [1, 0]


def test_the_exponential_race_draws_each_token_with_its_softmax_probability():
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0, -30.0])
    n = 40_000
    g = torch.Generator().manual_seed(0)
    tokens = _draw(logits.expand(n, -1).clone(), SAMPLE, g, temperature=1.5)
    freq = torch.bincount(tokens, minlength=5).double() / n
    p = torch.softmax(logits.double() / 1.5, -1)
    assert torch.all((freq - p).abs() <= 4 * (p * (1 - p) / n).sqrt() + 1e-9)  # 4 sigma per token
    assert freq[4] == 0  # a token of probability ~1e-9 is not drawn in 40K draws


@settings(max_examples=30, deadline=None)
@given(vocab=st.integers(2, 40), top_p=st.floats(0.05, 0.999), seed=st.integers(0, 2**16))
def test_nucleus_sampling_never_leaves_the_nucleus(vocab, top_p, seed):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(64, vocab, generator=g) * 3
    tokens = _draw(logits, NUCLEUS, g, top_p=top_p)
    p = torch.softmax(logits, -1)
    sorted_p, order = p.sort(-1, descending=True)
    before = sorted_p.cumsum(-1) - sorted_p  # mass strictly above each token
    rank = (order == tokens[:, None]).float().argmax(-1)
    assert torch.all(before.gather(1, rank[:, None]).squeeze(1) < top_p)  # the top token always qualifies


def test_same_generator_seed_same_draws():
    logits = torch.randn(3, 50)
    a = _draw(logits, SAMPLE, torch.Generator().manual_seed(7))
    b = _draw(logits, SAMPLE, torch.Generator().manual_seed(7))
    assert torch.equal(a, b)


def test_sampler_finishes_rows_at_eos_and_pads_them_afterwards():
    s = Sampler(batch=3, vocab=6, device="cpu")
    s.configure(eos=[4, 5], pad=0)
    assert s.mode == GREEDY
    step1 = torch.tensor([[0, 0, 0, 0, 9.0, 0], [0, 9.0, 0, 0, 0, 0], [0, 0, 0, 0, 0, 9.0]])
    assert s.choose(step1).tolist() == [4, 1, 5]
    assert s.finished.tolist() == [True, False, True] and s.report.tolist() == [4, 1, 5, 0]
    step2 = torch.tensor([[9.0, 0, 0, 0, 0, 0], [0, 0, 0, 0, 9.0, 0], [0, 0, 9.0, 0, 0, 0]])
    assert s.choose(step2).tolist() == [0, 4, 0]  # finished rows get the pad id
    assert s.report.tolist() == [0, 4, 0, 1]  # every row has finished
    s.configure()  # a new request: nothing finished, no EOS id
    assert not s.finished.any() and not s.eos.any()


def test_sampler_settings_are_checked_and_kept_as_tensors():
    s = Sampler(batch=1, vocab=6, device="cpu")
    with pytest.raises(ValueError, match="eos_token_id 6 is outside the vocabulary"):
        s.configure(eos=[6])
    s.configure(do_sample=True, temperature=0.5, top_p=0.9)
    assert s.mode == NUCLEUS and float(s.temperature) == 0.5 and float(s.top_p) == pytest.approx(0.9)
    before = s.noise.clone()
    s.draw()
    assert not torch.equal(s.noise, before) and bool((s.noise >= 0).all())


@settings(max_examples=60, deadline=None)
@given(b=st.integers(1, 3), v=st.integers(1, 70), chunk=st.integers(1, 9), levels=st.integers(1, 4), seed=st.integers(0, 2**16),
       inf=st.booleans())
def test_first_argmax_is_argmax_with_ties_to_the_lowest_index(b, v, chunk, levels, seed, inf):
    """Few distinct values make ties common; -inf entries (a masked vocabulary) included."""
    from policyzoo.sampling import first_argmax

    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, levels, (b, v), generator=g).float()
    if inf:
        x[torch.rand(b, v, generator=g) < 0.5] = -torch.inf
    assert torch.equal(first_argmax(x, chunk), x.argmax(-1))
