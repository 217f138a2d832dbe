"""Sampling draws from the distribution it claims, reproducibly per (seed, position)."""

from collections import Counter

import numpy as np
import pytest
import torch

from shared.batch import sampling
from shared.batch.sampling import DRAW_BLOCK, LogitInputs, SamplingParams, sample

LOGITS = torch.tensor([[2.0, 1.0, 0.0, -1.0, -3.0]])
N = 20000


def frequencies(params_for_seed, logits=LOGITS):
    """How often each token is drawn over N seeds: one batch of N copies of the row, seed s on row s (a row draws
    the same alone as in a batch: test_min_p_draws_are_the_same_alone_and_in_a_batch)."""
    c = Counter(sample(logits.expand(N, -1), [params_for_seed(s) for s in range(N)], [0] * N)[0])
    return [c.get(i, 0) / N for i in range(logits.shape[1])]


def test_temperature_sampling_matches_softmax():
    expected = torch.softmax(LOGITS[0] / 0.7, 0).tolist()
    got = frequencies(lambda s: SamplingParams(temperature=0.7, seed=s))
    assert got == pytest.approx(expected, abs=0.015)


@pytest.mark.slow
def test_top_k_and_top_p_keep_exactly_their_support():
    probs = torch.softmax(LOGITS[0], 0).tolist()
    got = frequencies(lambda s: SamplingParams(temperature=1.0, top_k=2, seed=s))
    assert got[2:] == [0, 0, 0] and got[0] == pytest.approx(probs[0] / (probs[0] + probs[1]), abs=0.015)
    # top_p 0.8: token 0 alone has 0.64 < 0.8, tokens 0+1 reach 0.87 -> support {0, 1}
    got = frequencies(lambda s: SamplingParams(temperature=1.0, top_p=0.8, seed=s))
    assert got[2:] == [0, 0, 0] and got[1] == pytest.approx(probs[1] / (probs[0] + probs[1]), abs=0.015)


@pytest.mark.slow
def test_min_p_keeps_tokens_at_least_min_p_times_as_likely_as_the_top_one():
    probs = torch.softmax(LOGITS[0], 0).tolist()  # ~[0.64, 0.23, 0.09, 0.03, 0.004]; 0.3 x 0.64 = 0.19 -> {0, 1}
    want = probs[1] / (probs[0] + probs[1])
    for extra in ({}, {"top_p": 0.95}):  # alone (full vocabulary) and after top-p's support {0, 1, 2}
        got = frequencies(lambda s, extra=extra: SamplingParams(temperature=1.0, min_p=0.3, seed=s, **extra))
        assert got[2:] == [0, 0, 0] and got[1] == pytest.approx(want, abs=0.015), extra
    with pytest.raises(ValueError, match="min_p"):
        SamplingParams(min_p=1.5)


def reference_support(row: torch.Tensor, p: SamplingParams) -> set[int]:
    """The tokens a draw may give, by the filters' definitions over a full sort in float64: the top_k most likely,
    then the smallest most-likely prefix holding top_p of their mass, then those at least min_p x the top one."""
    probs = torch.softmax(row.double() / p.temperature, 0).tolist()
    keep = sorted(range(len(probs)), key=lambda t: (-probs[t], t))
    if p.top_k:
        keep = keep[:p.top_k]
    if p.top_p < 1.0:
        mass, cum, prefix = sum(probs[t] for t in keep), 0.0, []
        for t in keep:
            if cum >= p.top_p * mass:
                break
            prefix.append(t)
            cum += probs[t]
        keep = prefix
    if p.min_p:
        keep = [t for t in keep if probs[t] >= p.min_p * max(probs)]
    return set(keep)


def support(row: torch.Tensor, p: SamplingParams) -> set[int]:
    probs, ids = sampling._filtered_probs(sampling.tempered(row[None], [p])[0], p)
    ids = np.arange(probs.size) if ids is None else ids
    return set(ids[probs > 0].tolist())


def rows_of_every_shape() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    below_first_floor = torch.full((6000,), -9.0) + 0.1 * torch.randn(6000, generator=g)  # ~1.2e-4 x the top one's
    below_first_floor[17] = 0.0
    return {"peaked": 3 * torch.randn(6000, generator=g), "flat": 0.2 * torch.randn(6000, generator=g),
            "mass below the first floor": below_first_floor}


@pytest.mark.slow
@pytest.mark.parametrize("params", [dict(top_p=0.9), dict(top_p=0.5), dict(top_k=40), dict(top_k=3000),
                                    dict(top_k=50, top_p=0.8), dict(min_p=0.05), dict(top_p=0.95, min_p=0.01)],
                         ids=str)
def test_the_filters_keep_exactly_the_support_a_full_sort_gives(params, monkeypatch):
    """Only candidates above a floor are sorted (sampling.CANDIDATE_FLOORS): the support must still be the full sort's,
    where the first floor's candidates suffice, where the next one's must be taken, and past the last floor (made
    coarse here, so a 6,000-token row falls through to the whole row)."""
    for floors in (sampling.CANDIDATE_FLOORS, (0.5,)):
        monkeypatch.setattr(sampling, "CANDIDATE_FLOORS", floors)
        for name, row in rows_of_every_shape().items():
            for temperature in (0.7, 1.5):
                p = SamplingParams(temperature=temperature, **params)
                assert support(row, p) == reference_support(row, p), (floors, name, temperature)


def test_a_draw_is_the_inverse_cdf_and_never_a_token_without_probability():
    """The draw finds its block by block sums, then its token in the block: the token an exact cumulative sum gives,
    never one of probability 0 (masked tokens, a block of them, and a draw at the very top of the range)."""
    g = torch.Generator().manual_seed(3)
    probs = torch.rand(5 * DRAW_BLOCK + 100, generator=g).numpy()
    probs[DRAW_BLOCK:2 * DRAW_BLOCK] = 0  # a whole block without mass
    probs[::7] = 0
    probs[-50:] = 0  # the tail block ends in tokens without mass
    cdf = np.cumsum(probs, dtype=np.float64)
    for u in [*torch.rand(2000, generator=g).tolist(), 0.0, 1 - 2**-53]:
        i = sampling._draw(probs, u)
        assert probs[i] > 0, u
        exact = min(int(np.searchsorted(cdf, u * cdf[-1], side="right")), int(np.flatnonzero(probs)[-1]))
        assert abs(cdf[i] - cdf[exact]) <= 1e-9 * cdf[-1], (u, i, exact)  # the same token, or one of equal cdf


def test_greedy_seeded_and_logprobs():
    logits = torch.randn(3, 1000)
    greedy = sample(logits, [SamplingParams()] * 3, [1, 2, 3])[0]
    assert greedy == logits.argmax(-1).tolist()
    p = SamplingParams(temperature=1.0, seed=42)
    a = [sample(logits[:1], [p], [pos])[0][0] for pos in range(20)]
    b = [sample(logits[:1], [p], [pos])[0][0] for pos in range(20)]
    assert a == b and len(set(a)) > 1  # same seed and position: same token; positions differ: draws differ
    tok, lp, _ = sample(logits[:1], [SamplingParams(logprobs=True)], [0])
    assert lp[0] == pytest.approx(float(torch.log_softmax(logits[0], 0)[tok[0]]))


@pytest.mark.parametrize("temperature", [1e-38, 1e-39, 5e-324])
def test_tiny_temperature_is_greedy_not_nan(temperature):
    """Issue 11 item 4: logits / 1e-38 overflows float32 (inf - inf = NaN in softmax). Below 1e-5 the draw is
    greedy, as vLLM does (_SAMPLING_EPS); the chosen token is the argmax whatever the seed."""
    logits = torch.randn(4, 500, generator=torch.Generator().manual_seed(0)) * 10
    params = [SamplingParams(temperature=temperature, top_p=0.9, seed=s, logprobs=True) for s in range(4)]
    tokens, logprobs, _ = sample(logits, params, [0, 1, 2, 3])
    assert tokens == logits.argmax(-1).tolist()
    assert all(lp is not None and lp == lp and lp > -1e9 for lp in logprobs)  # finite, not NaN


def test_small_temperature_above_the_greedy_bound_still_samples_finite_probabilities():
    logits = torch.tensor([[30.0, 30.0 - 1e-4, -5.0]])  # two near-ties: at T=1e-4 they stay ~ e^-1 apart
    picks = Counter(sample(logits, [SamplingParams(temperature=1e-4, seed=s)], [0])[0][0] for s in range(4000))
    assert set(picks) == {0, 1}
    expected = float(torch.softmax(logits[0].double() / 1e-4, 0)[1])
    assert picks[1] / 4000 == pytest.approx(expected, abs=0.03)


def test_min_p_draws_are_the_same_alone_and_in_a_batch():
    logits = torch.randn(4, 300, generator=torch.Generator().manual_seed(0)) * 3
    mine = SamplingParams(temperature=1.2, min_p=0.05, seed=7, logprobs=True)
    others = [SamplingParams(), SamplingParams(temperature=0.8, top_k=5, seed=1), SamplingParams(temperature=1.0, seed=2)]
    for pos in range(20):
        alone = sample(logits[2:3], [mine], [pos])
        batched = sample(logits, [others[0], others[1], mine, others[2]], [pos] * 4)
        assert (alone[0][0], alone[1][0]) == (batched[0][2], batched[1][2])


def test_logit_bias_shifts_those_logits_only_and_leaves_logprobs_unbiased():
    """+bias on token 3 (of 5): the temperature draw follows softmax(logits + bias); -100 bans the top token under
    greedy; the row's neighbours in the batch keep their own draws; logprobs are the unbiased distribution's."""
    biased = LOGITS.clone()
    biased[0, 3] += 4.0
    expected = torch.softmax(biased[0], 0).tolist()
    got = frequencies(lambda s: SamplingParams(temperature=1.0, seed=s, logit_bias=((3, 4.0),)))
    assert all(abs(g - e) < 0.015 for g, e in zip(got, expected)), (got, expected)
    banned = SamplingParams(temperature=0.0, logit_bias=((0, -100.0),), logprobs=True)
    plain = SamplingParams(temperature=0.0, logprobs=True)
    tokens, logprobs, _ = sample(LOGITS.repeat(2, 1), [banned, plain], [0, 0])
    assert tokens == [1, 0]  # the banned top token gives way to the next; the other row is untouched
    assert logprobs[0] == pytest.approx(float(torch.log_softmax(LOGITS[0], 0)[1]))
    wire = SamplingParams.from_wire({**banned.to_wire(), "logit_bias": [[0, -100]]})  # msgpack's lists back
    assert wire == banned
    for bad in (((0, 101.0),), ((-1, 1.0),), ((0,),), tuple((i, 1.0) for i in range(301))):
        with pytest.raises(ValueError, match="logit_bias"):
            SamplingParams(logit_bias=bad)


@pytest.mark.slow
def test_penalties_follow_vllms_formulas_on_the_rows_they_are_given():
    """Repetition divides a positive logit of a seen token and multiplies a negative one; frequency subtracts
    penalty x count, presence subtracts the penalty once for generated tokens (count > 0), not prompt-only ones
    (count 0); the temperature draw then follows the penalized softmax; a row without inputs is untouched."""
    seen = ((0, 2), (3, 0), (4, 1))  # token 0 generated twice, 3 only in the prompt, 4 generated once
    p = SamplingParams(temperature=1.0, repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    expected = LOGITS[0].clone()
    expected[0] = 2.0 / 2.0 - 0.5 * 2 - 0.25
    expected[3] = -1.0 * 2.0
    expected[4] = -3.0 * 2.0 - 0.5 * 1 - 0.25
    c = Counter(sample(LOGITS, [SamplingParams(**{**p.to_wire(), "seed": s})], [0], [LogitInputs(None, seen)])[0][0]
                for s in range(N))
    got = [c.get(i, 0) / N for i in range(5)]
    assert all(abs(g - e) < 0.015 for g, e in zip(got, torch.softmax(expected, 0).tolist())), (got, expected)
    greedy = SamplingParams(frequency_penalty=2.0)
    tokens = sample(LOGITS.repeat(2, 1), [greedy, greedy], [0, 0], [LogitInputs(None, ((0, 1),)), None]).tokens
    assert tokens == [1, 0]  # 2 - 2 < 1: the generated top token gives way; the row without history keeps it
    for bad in ({"presence_penalty": 2.5}, {"frequency_penalty": -3}, {"repetition_penalty": 0}):
        with pytest.raises(ValueError, match="penalty"):
            SamplingParams(**bad)


def test_an_allowed_mask_limits_the_draw_to_its_tokens():
    """Bit t of the little-endian bitmask allows token t; tokens past the mask's end are not allowed; a mask that
    allows nothing of the vocabulary is an error, never a draw from nothing."""
    mask = bytearray(4)
    mask[0] = 0b00010100  # tokens 2 and 4
    draws = {sample(LOGITS, [SamplingParams(temperature=1.0, seed=s)], [0], [LogitInputs(bytes(mask))])[0][0]
             for s in range(200)}
    assert draws == {2, 4}
    assert sample(LOGITS, [SamplingParams()], [0], [LogitInputs(bytes(mask))])[0] == [2]
    with pytest.raises(ValueError, match="permits no token"):
        sample(LOGITS, [SamplingParams()], [0], [LogitInputs(bytes([0b11100000, 0, 0, 0]))])
    with pytest.raises(ValueError, match="32-bit words"):
        LogitInputs(b"\x01")


def test_top_logprobs_are_the_rows_most_likely_tokens_whatever_shares_the_batch():
    """top_logprobs k: the k largest of log_softmax(row), most likely first, the greedy pick first of them; a
    row's alternatives are the same alone and beside rows with other params (hot, biased, asking other k); ties go
    to the lower token id."""
    logits = torch.randn(3, 2000, generator=torch.Generator().manual_seed(1)) * 4
    mine = SamplingParams(logprobs=True, top_logprobs=5)
    alone = sample(logits[1:2], [mine], [0])
    expected = torch.log_softmax(logits[1], 0)
    values, ids = torch.topk(expected, 5)
    top = alone.top[0]
    assert [t for t, _ in top] == ids.tolist() and len(top) == 5
    assert [lp for _, lp in top] == pytest.approx(values.tolist()) and [lp for _, lp in top] == sorted(
        (lp for _, lp in top), reverse=True)
    assert top[0] == (alone.tokens[0], alone.logprobs[0])
    first0, first2 = (int(logits[i].argmax()) for i in (0, 2))
    others = [SamplingParams(temperature=1.3, seed=4, top_logprobs=20, logit_bias=((first0, -100.0),)),
              SamplingParams(temperature=0.7, top_k=3, seed=5, logit_bias=((first2, -100.0),))]
    for pos in range(5):
        batched = sample(logits, [others[0], mine, others[1]], [pos] * 3)
        assert batched.top[1] == top and batched.tokens[1] == alone.tokens[0]
        assert batched.top[2] is None and batched.logprobs[0] is None  # nothing computed where nothing was asked
        assert batched.top[0] == sample(logits[:1], [SamplingParams(top_logprobs=20)], [0]).top[0]  # unbiased
        assert batched.top[0][0][0] == first0 != batched.tokens[0]
    tied = torch.tensor([[0.0, 3.0, 1.0, 3.0, 3.0, -2.0]])
    assert [t for t, _ in sample(tied, [SamplingParams(top_logprobs=4)], [0]).top[0]] == [1, 3, 4, 2]
    assert [t for t, _ in sample(tied, [SamplingParams(top_logprobs=2)], [0]).top[0]] == [1, 3]


def test_tempered_rows_are_torchs_softmax_numerators_with_or_without_the_kernel(monkeypatch):
    """sampling.tempered: qdot.cpp's temper where it loads, torch's exp row by row elsewhere; both are exp((row - max)
    / T) to an ulp, so a seeded stream draws the same tokens on either but for a draw within an ulp of a boundary."""
    from shared.kernels import qdot

    g = torch.Generator().manual_seed(5)
    logits = torch.randn(3, 49152, generator=g) * 3
    params = [SamplingParams(temperature=t, seed=1) for t in (0.7, 1.0, 1.6)]
    got = np.stack(sampling.tempered(logits, params))
    want = np.stack([torch.softmax(row.double() / p.temperature, 0).numpy() for row, p in zip(logits, params)])
    # float32 arguments: (x - max) / T rounds to ~6e-8 of itself, ~4e-6 of a probability at e^-60
    np.testing.assert_allclose(got / got.sum(1, keepdims=True), want, rtol=1e-5, atol=1e-30)
    monkeypatch.setattr(qdot, "usable", lambda: False)
    torch_rows = np.stack(sampling.tempered(logits, params))
    np.testing.assert_allclose(torch_rows, got, rtol=3e-7, atol=1e-37)
    assert sampling.tempered(logits[:0], []) == []
