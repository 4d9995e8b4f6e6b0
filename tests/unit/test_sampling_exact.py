"""The exact sampling definition (docs/sampling.md): the exp polynomial, the generator, the
integer filters and the drawn frequencies against the exact distribution q / Q."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest

from gpu_worker.kernels import exact_math as em
from gpu_worker.kernels import sampler
from gpu_worker.sampling import filtered_logprobs, kept_masses, sample
from gpu_worker.verify import sample_and_match, sample_and_match_all
from protocol.messages import SamplingParams, SlotWork, WorkKind

ONE = 1 << em.MASS_BITS


def chi_square_z(observed: np.ndarray, expected: np.ndarray) -> float:
    """Wilson-Hilferty normal score of Pearson's statistic (df = bins - 1): < 4 passes."""
    stat = float(((observed - expected) ** 2 / expected).sum())
    df = observed.size - 1
    return ((stat / df) ** (1 / 3) - (1 - 2 / (9 * df))) / math.sqrt(2 / (9 * df))


def test_exp_polynomial_is_within_one_ulp_of_numpy():
    x = np.concatenate([np.linspace(em.X_CUT, 0, 1_000_001),
                        -np.logspace(-300, math.log10(28), 20_000)])
    e, ref = em.exp_nonpos(x), np.exp(x)
    rel = np.abs(e - ref) / ref
    # measured: 2.2e-16 (one ulp); the masses keep 40 bits, so this is far below their step
    assert rel.max() <= 2.0**-52 * 1.001, (rel.max(), x[rel.argmax()])
    assert em.exp_nonpos(np.zeros(1))[0] == 1.0


def test_masses_of_special_logits():
    z = np.array([2.0, -np.inf, np.nan, 2.0, 1.0, -100.0], np.float32)
    q = em.masses(z, 0.5)
    assert q[0] == q[3] == ONE and q[1] == q[2] == q[5] == 0
    assert abs(int(q[4]) - math.exp(-2.0) * ONE) <= 1
    assert list(em.masses(np.array([np.inf, 1.0, np.inf]), 1.0)) == [ONE, 0, ONE]
    assert not em.masses(np.array([-np.inf, np.nan]), 1.0).any()


def test_generator_is_uniform_and_keyed():
    draws = np.array([em.draw64(11, pos) for pos in range(20_000)], dtype=np.uint64)
    assert len(set(draws.tolist())) == draws.size
    top = np.bincount((draws >> np.uint64(58)).astype(np.int64), minlength=64)
    assert chi_square_z(top, np.full(64, draws.size / 64)) < 4
    bits = (draws[:, None] >> np.arange(64, dtype=np.uint64)) & np.uint64(1)
    assert np.abs(bits.mean(axis=0) - 0.5).max() < 0.02
    by_seed = np.array([em.draw64(seed, 5) >> 58 for seed in range(20_000)])
    assert chi_square_z(np.bincount(by_seed, minlength=64), np.full(64, 20_000 / 64)) < 4


def test_uniform_below_covers_the_range():
    assert em.uniform_below(0, 7) == 0
    assert em.uniform_below((1 << 64) - 1, 7) == 6
    assert em.uniform_below(1 << 63, 10) == 5


@pytest.mark.parametrize("seed", range(5))
def test_ceil_times_is_exact(seed):
    rng = np.random.default_rng(seed)
    for _ in range(200):
        p = float(rng.random()) * 10.0 ** -int(rng.integers(0, 40))
        total = int(rng.integers(1, 2**58))
        assert em.ceil_times(p, total) == -((-Fraction(p) * total).numerator
                                            // (Fraction(p) * total).denominator)
    assert em.ceil_times(0.5, 10) == 5 and em.ceil_times(0.75, 4) == 3
    assert em.ceil_times(5e-324, 3) == 1


def test_top_k_keeps_exactly_k_ties_to_the_lowest_ids():
    z = np.array([1.0, 3.0, 3.0, 3.0, 0.0, 3.0])
    kept = kept_masses(z, SamplingParams(temperature=1.0, top_k=2))
    assert list(np.flatnonzero(kept)) == [1, 2]
    assert list(np.flatnonzero(kept_masses(z, SamplingParams(top_k=5)))) == [0, 1, 2, 3, 5]


def test_top_p_bound_is_exact():
    z = np.zeros(4)  # four masses of 2**40: Q = 4 * 2**40
    half = kept_masses(z, SamplingParams(top_p=0.5))  # bound 2 * 2**40: the third has it before
    assert list(np.flatnonzero(half)) == [0, 1]
    assert list(np.flatnonzero(kept_masses(z, SamplingParams(top_p=np.nextafter(0.5, 1))))) == [
        0, 1, 2]
    # top-p applies to the top-k's mass: of the top 2, 0.5 keeps only the first
    assert list(np.flatnonzero(kept_masses(z, SamplingParams(top_k=2, top_p=0.5)))) == [0]


def test_min_p_compares_integer_masses():
    z = np.array([0.0, -math.log(2.0), -math.log(4.0)])
    q = em.masses(z, 1.0)
    kept = kept_masses(z, SamplingParams(min_p=0.5))
    assert list(kept > 0) == [True, bool(q[1] >= ONE // 2), False]
    assert list(kept_masses(z, SamplingParams(min_p=0.2)) > 0) == [True, True, True]
    assert list(kept_masses(z, SamplingParams(min_p=1.0)) > 0) == [True, False, False]


def test_degenerate_rows_fall_back_to_argmax():
    p = SamplingParams(temperature=1.0, seed=1)
    assert sample(np.full(5, -np.inf), p, 3) == 0
    assert sample(np.array([-np.inf, np.nan, 1.0]), SamplingParams(temperature=0), 3) == 1


@pytest.mark.parametrize("kw", [dict(), dict(top_k=8, top_p=0.95, min_p=0.01),
                                dict(temperature=2.5, top_p=0.7),
                                dict(temperature=2.0, min_p=0.1)])
def test_frequencies_match_the_exact_distribution(kw):
    logits = np.random.default_rng(3).normal(size=12).astype(np.float32)
    params = SamplingParams(seed=17, **{"temperature": 0.9, **kw})
    kept = kept_masses(logits, params).astype(np.float64)
    n = 20_000
    counts = np.bincount([sample(logits, params, pos) for pos in range(n)], minlength=12)
    assert not counts[kept == 0].any()
    live = kept > 0
    assert live.sum() >= 3  # a test of frequencies, not of a forced choice
    assert chi_square_z(counts[live], n * kept[live] / kept.sum()) < 4


def test_the_exact_distribution_is_softmax_within_the_quantisation():
    z = np.random.default_rng(4).normal(size=1000) * 3
    p = SamplingParams(temperature=0.7)
    exact = np.exp(filtered_logprobs(z, p))
    soft = np.exp((z - z.max()) / 0.7)
    soft /= soft.sum()
    # q_i / 2**40 loses < 2**-40 of e_i = soft_i / soft_max, so Q loses < V 2**-40 of its
    # sum 1 / soft_max: |q_i / Q - soft_i| <= 2**-40 soft_max (1 + V soft_i)
    bound = 2.0**-40 * soft.max() * (1 + z.size * soft) * 1.01 + 1e-15
    assert (np.abs(exact - soft) <= bound).all(), np.abs(exact - soft).max()


class _DeviceArray:
    """Stands in for a CuPy array in verify's device branch (shape and .get() only)."""

    def __init__(self, a: np.ndarray) -> None:
        self.a, self.shape = a, a.shape

    def get(self) -> np.ndarray:
        return self.a


def test_the_device_branch_packs_rows_and_splits_results(monkeypatch):
    """verify.sample_and_match_all's bookkeeping around the kernels, with the kernels
    replaced by the reference applied to the packed per-row parameters."""
    def fake(logits, fp, ip, row0, drafts):
        rows = [sample(logits.a[i], SamplingParams(temperature=fp[i, 0], top_p=fp[i, 1],
                                                   min_p=fp[i, 2], top_k=int(ip[i, 0]),
                                                   seed=int(ip[i, 1])), int(ip[i, 2]))
                for i in range(len(fp))]
        acc = []
        for r, d in zip(row0, drafts, strict=True):
            a = 0
            while a < len(d) and rows[r + a] == d[a]:
                a += 1
            acc.append(a)
        return _DeviceArray(np.array(rows + acc, np.int32))

    monkeypatch.setattr(sampler, "sample_and_match_rows", fake)
    rng = np.random.default_rng(6)
    logits = rng.normal(size=(7, 30)).astype(np.float32)
    mk = lambda slot, start, drafts, t: SlotWork(  # noqa: E731
        slot=slot, request_id="r", kind=WorkKind.DECODE, input_ids=np.array([1], np.int32),
        start_pos=start, num_tokens=1, needs_logits=True, prompt_len=1,
        sampling=SamplingParams(temperature=t, seed=slot + 1, top_k=5),
        draft_ids=np.array(drafts, np.int32), draft_sources=np.zeros(len(drafts), np.uint8))
    work = [mk(0, 40, [], 0.8), mk(1, 7, [], 1.0), mk(2, 90, [3, 4, 5], 0.0),
            mk(3, 12, [1, 2], 1.3)]
    first = {0: 0, 2: 1, 3: 4}
    work[2].draft_ids[:2] = [sample(logits[1 + j], work[2].sampling, 91 + j) for j in range(2)]
    want = [sample_and_match(w, logits, first.get(w.slot)) for w in work]
    assert sample_and_match_all(work, _DeviceArray(logits), first) == want
    assert want[1] == ([], 0) and want[2][1] == 2
