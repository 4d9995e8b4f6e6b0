import numpy as np
import pytest

from gpu_worker.kernels.exact_math import draw64
from gpu_worker.sampling import filtered_logprobs, sample
from protocol.messages import SamplingParams


def test_noise_is_keyed_by_seed_and_position_only():
    a = draw64(7, 100)
    assert a == draw64(7, 100)
    assert a != draw64(7, 101)
    assert a != draw64(8, 100)
    logits = np.random.default_rng(0).normal(size=500)
    p = SamplingParams(temperature=1.5, seed=7)
    picks = [sample(logits, p, pos) for pos in range(40)]
    assert picks == [sample(logits, p, pos) for pos in range(40)]
    assert len(set(picks)) > 10  # positions draw independently
    other = [sample(logits, SamplingParams(temperature=1.5, seed=8), pos) for pos in range(40)]
    assert other != picks


def test_draws_follow_the_distribution():
    logits = np.log(np.array([0.5, 0.3, 0.2]))
    params = SamplingParams(temperature=1.0, seed=3)
    draws = np.bincount([sample(logits, params, pos) for pos in range(6000)], minlength=3)
    assert np.allclose(draws / 6000, [0.5, 0.3, 0.2], atol=0.03)


def test_greedy_ties_go_to_the_lowest_id():
    assert sample(np.array([1.0, 3.0, 3.0, 0.0]), SamplingParams(temperature=0), 5) == 1


def _reference_filter(logits, p: SamplingParams):
    """Slow, literal transcription of top-k / top-p / min-p (float probabilities)."""
    z = np.asarray(logits, float) / p.temperature
    keep = np.ones(z.size, bool)
    if p.top_k:
        keep &= z >= np.sort(z)[::-1][p.top_k - 1]
    probs = np.exp(z - z.max()) * keep
    probs /= probs.sum()
    if p.top_p < 1:
        order = sorted(range(z.size), key=lambda i: (-probs[i], i))
        mass = 0.0
        for i in order:
            if mass >= p.top_p:
                keep[i] = False
            mass += probs[i]
    probs = probs * keep
    probs /= probs.sum()
    if p.min_p:
        keep &= probs >= p.min_p * probs.max()
    return keep


@pytest.mark.parametrize("kw", [dict(top_k=3), dict(top_p=0.6), dict(min_p=0.2),
                                dict(top_k=5, top_p=0.9, min_p=0.05)])
def test_filters_keep_the_reference_set(kw):
    rng = np.random.default_rng(1)
    for _ in range(20):
        logits = rng.normal(size=12) * 2
        p = SamplingParams(temperature=0.8, **kw)
        kept = np.isfinite(filtered_logprobs(logits, p))
        assert np.array_equal(kept, _reference_filter(logits, p))
        assert np.isclose(np.exp(filtered_logprobs(logits, p)).sum(), 1.0)


@pytest.mark.parametrize("bad", [dict(temperature=-1), dict(top_p=0), dict(top_p=1.5),
                                 dict(top_k=-1), dict(min_p=2), dict(seed=-1),
                                 dict(temperature=float("nan"))])
def test_bad_parameters_are_rejected(bad):
    with pytest.raises(ValueError):
        SamplingParams(**bad)
