"""GPU sampling (gpu_worker/kernels/sampler.py) equals the NumPy reference
(gpu_worker/sampling.py) bit for bit: 10,000 rows of varied parameters and logits (ties, -inf,
NaN, +inf, vocabularies of 1000 and 151936), device sample-and-match, and a chi-square of GPU
samples against the exact distribution q / Q."""

from __future__ import annotations

import numpy as np
import pytest

from gpu_worker.sampling import kept_masses, sample
from gpu_worker.verify import sample_and_match, sample_and_match_all
from protocol.messages import SamplingParams, SlotWork, WorkKind
from tests.unit.test_sampling_exact import chi_square_z

cp = pytest.importorskip("cupy")

from gpu_worker.kernels import sampler  # noqa: E402


def random_params(rng: np.random.Generator, n: int) -> list[SamplingParams]:
    temps = [0.0, 0.1, 0.3, 0.7, 1.0, 1.5, 2.0]
    return [SamplingParams(temperature=float(rng.choice(temps)),
                           top_k=int(rng.choice([0, 0, 1, 5, 50])),
                           top_p=float(rng.choice([1.0, 1.0, 0.5, 0.8, 0.95, 0.99])),
                           min_p=float(rng.choice([0.0, 0.0, 0.02, 0.1, 0.2])),
                           seed=int(rng.integers(0, 2**63))) for _ in range(n)]


def random_logits(rng: np.random.Generator, n: int, V: int, dtype) -> np.ndarray:
    """Rows of varied spread; every 3rd rounded (many ties), every 5th with -inf entries,
    a few special rows (all -inf, a NaN, +inf, all equal)."""
    x = rng.standard_normal((n, V)) * rng.uniform(0.3, 8.0, (n, 1))
    x[::3] = np.round(x[::3])
    x[1::5, rng.integers(0, V, 50)] = -np.inf
    x = x.astype(dtype)
    if n > 8:
        x[0] = -np.inf
        x[2, 7] = np.nan
        x[4, [3, 9]] = np.inf
        x[6] = 1.5
    return x


def check_rows(logits: np.ndarray, params: list[SamplingParams], positions: np.ndarray) -> None:
    fp, ip = sampler.params_rows(params, positions)
    got = sampler.launch(cp.asarray(logits), fp, ip).get()
    want = np.array([sample(logits[i], params[i], int(positions[i]))
                     for i in range(len(params))])
    bad = np.flatnonzero(got != want)
    if bad.size:
        i = int(bad[0])
        kept = kept_masses(logits[i], params[i]) if params[i].temperature else None
        pytest.fail(f"{bad.size}/{len(params)} rows differ (V={logits.shape[1]}, "
                    f"{logits.dtype}); first row {i}: gpu {got[i]} numpy {want[i]}, "
                    f"{params[i]}, position {positions[i]}, kept tokens "
                    f"{None if kept is None else int((kept > 0).sum())}, rows "
                    f"{bad[:20].tolist()}")


@pytest.mark.parametrize("V, rows, dtype", [(1000, 9000, np.float32), (151936, 1000, np.float32),
                                            (1000, 600, np.float64)])
def test_gpu_sampling_equals_numpy_bit_for_bit(V, rows, dtype):
    rng = np.random.default_rng(V + rows)
    for start in range(0, rows, 500):
        n = min(500, rows - start)
        check_rows(random_logits(rng, n, V, dtype), random_params(rng, n),
                   rng.integers(0, 2**40, n))


def _work(slot: int, params: SamplingParams, start: int, drafts: list[int]) -> SlotWork:
    return SlotWork(slot=slot, request_id=f"r{slot}", kind=WorkKind.DECODE,
                    input_ids=np.array([1], np.int32), start_pos=start, num_tokens=1,
                    needs_logits=True, prompt_len=1, sampling=params,
                    draft_ids=np.array(drafts, np.int32),
                    draft_sources=np.zeros(len(drafts), np.uint8))


def test_sample_and_match_on_the_device_equals_the_host():
    rng = np.random.default_rng(9)
    V = 151936
    for trial in range(20):
        work, first, rows = [], {}, 0
        for slot in range(4):
            params = random_params(rng, 1)[0]
            if slot == 3 and trial % 2:
                work.append(_work(slot, params, 10, []))  # no logits asked: not in first
                continue
            k = int(rng.integers(0, 5))
            first[slot] = rows
            rows += k + 1
            work.append(_work(slot, params, int(rng.integers(5, 10**6)), [0] * k))
        logits = random_logits(rng, rows, V, np.float32)
        # drafts: the host's own picks, with one wrong at a random depth in half the slots
        for w in work:
            if w.slot in first and len(w.draft_ids):
                w.draft_ids[:] = [sample(logits[first[w.slot] + j], w.sampling,
                                         w.start_pos + w.num_tokens + j)
                                  for j in range(len(w.draft_ids))]
                if rng.random() < 0.5:
                    j = int(rng.integers(0, len(w.draft_ids)))
                    w.draft_ids[j] = (w.draft_ids[j] + 1) % V
        want = [sample_and_match(w, logits, first.get(w.slot)) for w in work]
        got = sample_and_match_all(work, cp.asarray(logits), first)
        assert got == want, (trial, [(w.slot, w.sampling, list(w.draft_ids)) for w in work])


@pytest.mark.parametrize("kw", [dict(temperature=1.0), dict(temperature=0.8, top_k=5),
                                dict(temperature=1.2, top_p=0.9, min_p=0.02)])
def test_gpu_frequencies_match_the_exact_distribution(kw):
    logits = np.random.default_rng(2).standard_normal(1000).astype(np.float32)
    params = SamplingParams(seed=5, **kw)
    n = 100_000
    fp, ip = sampler.params_rows([params] * n, np.arange(n))
    got = sampler.launch(cp.broadcast_to(cp.asarray(logits), (n, 1000)), fp, ip).get()
    kept = kept_masses(logits, params).astype(np.float64)
    counts = np.bincount(got, minlength=1000)
    assert not counts[kept == 0].any()
    expected = n * kept / kept.sum()
    bins = expected >= 5  # pool the rare tokens into one bin
    obs = np.append(counts[bins], counts[~bins & (kept > 0)].sum())
    exp = np.append(expected[bins], expected[~bins & (kept > 0)].sum())
    obs, exp = (obs, exp) if exp[-1] > 0 else (obs[:-1], exp[:-1])
    assert chi_square_z(obs, exp) < 4, (obs[:10], exp[:10])


def test_sample_token_on_a_device_row():
    rng = np.random.default_rng(3)
    logits = random_logits(rng, 1, 5000, np.float32)[0]
    for params in random_params(rng, 50):
        assert sampler.sample_token(cp.asarray(logits), params, 77) == sample(logits, params,
                                                                                 77)
