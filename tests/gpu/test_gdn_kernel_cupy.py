"""The Gated DeltaNet kernels (gpu_worker/kernels/gdn_recurrent.py) on the GPU: the same bits
as their NumPy twin (gdn_reference.py, the gates included), a slot's rows the same bits
alone, one at a time and in any layout of slots (tracked per-row states included), and the
Qwen3-Next tiny model on CuPy against NumPy, with speculation's adopt path."""

from __future__ import annotations

import numpy as np
import pytest

from gpu_worker.backend import to_numpy
from gpu_worker.kernels import gdn_recurrent as kern
from gpu_worker.kernels import gdn_reference as ref
from gpu_worker.loader import load_checkpoint
from gpu_worker.model import gdn
from gpu_worker.model.batch import RaggedBatch
from gpu_worker.model.model import Model
from scripts.tiny_model import make_tiny_model

cupy = pytest.importorskip("cupy")


@pytest.fixture(autouse=True)
def _kernels_on(monkeypatch):
    """The model takes the kernels under test (gpu_worker/kernels/enabled.py)."""
    monkeypatch.setenv("TANDEM_GPU_KERNELS", "all")

SHAPES = {  # Hk, Hv, Dk, Dv, K
    "tiny": (2, 4, 16, 16, 4),
    "real": (2, 4, 128, 128, 4),  # Qwen3-Next-80B's head dims, fewer heads
    "odd": (1, 3, 24, 40, 3),  # Dk not a power of two, a partial Dv tile, K = 3
}
NAMES = ("y", "out", "window", "state", "track_conv", "track_rec")


def _inputs(rng, dtype, shape, slots: int, rows: int) -> dict:
    Hk, Hv, Dk, Dv, K = shape
    C = 2 * Hk * Dk + Hv * Dv
    a = {"x": rng.normal(size=(rows, C)), "w": rng.normal(size=(C, K)) * 0.5,
         "window": rng.normal(size=(slots, K - 1, C)),
         "state": rng.normal(size=(slots, Hv, Dk, Dv)) * 0.1,
         "decay": rng.uniform(0.5, 1.0, size=(rows, Hv)), "beta": rng.uniform(size=(rows, Hv))}
    return {k: v.astype(dtype) for k, v in a.items()}


def _table(segs) -> tuple[np.ndarray, int]:
    """segs: (slot, rows, tracked) in row order -> int32 [segments, 4] and the tracked rows."""
    table, row0, tracked = [], 0, 0
    for slot, num, track in segs:
        table.append((slot, row0, num, tracked if track else -1))
        row0 += num
        tracked += num if track else 0
    return np.array(table, np.int32).reshape(-1, 4), tracked


def _run(xp, a: dict, table: np.ndarray, tracked: int, shape) -> dict:
    """Both kernels over ``table`` on ``xp`` (cupy: the kernels; numpy: the twin); host
    results. The input states are copied, not changed."""
    Hk, Hv, Dk, Dv, K = shape
    mod = kern if xp is cupy else ref
    x, w, decay, beta = (xp.asarray(a[k]) for k in ("x", "w", "decay", "beta"))
    window, state = xp.array(a["window"]), xp.array(a["state"])
    dt = a["x"].dtype
    tc = xp.zeros((tracked, K - 1, x.shape[1]), dt) if tracked else None
    tr = xp.zeros((tracked, Hv, Dk, Dv), dt) if tracked else None
    tab = xp.asarray(table)
    y = mod.conv_silu(x, w, window, tab, tc)
    out = mod.recurrence(y, decay, beta, state, tab, key_heads=Hk,
                         scale=float(dt.type(Dk ** -0.5)), track=tr)
    got = dict(zip(NAMES, (y, out, window, state, tc, tr), strict=True))
    return {k: None if v is None else to_numpy(v) for k, v in got.items()}


def _same_bits(got: np.ndarray, want: np.ndarray, what: str) -> None:
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    u = np.uint32 if got.dtype == np.float32 else np.uint64
    eq = np.ascontiguousarray(got).view(u) == np.ascontiguousarray(want).view(u)
    if not eq.all():
        first = tuple(int(i) for i in np.argwhere(~eq)[0])
        diff = np.abs(got.astype(np.float64) - want.astype(np.float64))
        raise AssertionError(f"{what} {got.dtype} {got.shape}: {int((~eq).sum())} values "
                             f"differ, first at {first}: {got[first]!r} != {want[first]!r}, "
                             f"max |diff| {np.nanmax(diff):.3g}")


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("name", list(SHAPES))
def test_kernels_give_the_bits_of_the_numpy_twin(dtype, name):
    shape = SHAPES[name]
    table, tracked = _table([(2, 3, True), (0, 1, False), (3, 5, True), (1, 9, False)])
    a = _inputs(np.random.default_rng(0), dtype, shape, 4, 18)
    got, want = _run(cupy, a, table, tracked, shape), _run(np, a, table, tracked, shape)
    for k in NAMES:
        _same_bits(got[k], want[k], f"{name} {k}")
    assert np.abs(got["out"]).max() > 0 and not np.isnan(got["out"]).any()


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_a_segment_without_a_slot_starts_from_zeros_and_keeps_nothing(dtype):
    """Table slot -1 (the capacity buckets' padding, gpu_worker/graph_buckets.py): the
    segment's outputs are those of a slot whose window and state are zero, no slot's window
    or state changes, and the other segments' bits are as without it."""
    shape = SHAPES["real"]
    a = _inputs(np.random.default_rng(3), dtype, shape, 3, 10)
    table, tracked = _table([(2, 3, True), (0, 4, False), (-1, 3, False)])
    got, want = _run(cupy, a, table, tracked, shape), _run(np, a, table, tracked, shape)
    for k in NAMES:
        _same_bits(got[k], want[k], f"slot -1 {k}")
    zero = dict(a, window=np.concatenate([a["window"], np.zeros_like(a["window"][:1])]),
                state=np.concatenate([a["state"], np.zeros_like(a["state"][:1])]))
    as_zero = _run(cupy, zero, _table([(2, 3, True), (0, 4, False), (3, 3, False)])[0],
                   tracked, shape)
    for k in ("y", "out", "track_conv", "track_rec"):
        _same_bits(got[k], as_zero[k], f"slot -1 against a zero slot: {k}")
    for k in ("window", "state"):  # slots 0-2 as with a zero slot 3 (its loads read slot 0)
        _same_bits(got[k], as_zero[k][:3], f"slot -1 keeps no {k}")


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_gates_give_the_bits_of_the_numpy_twin(dtype):
    Hk, r, R = 2, 3, 700
    rng = np.random.default_rng(4)
    ba = rng.normal(scale=8.0, size=(R, Hk * 2 * r))
    edges = [0.0, -0.0, 20.0, 20.5, 19.99, -87.0, -87.5, -700.0, -710.0, 1e-41, -1e-41,
             1e-300, 50.0, -50.0, 1e-3, -1e-3, np.inf, -np.inf]
    ba[:len(edges)] = np.array(edges)[:, None]  # b and a alike, every head
    a_log = np.array([-3.0, -0.5, 0.0, 0.7, 1.5, 2.77])  # Hv = 6
    dt_bias = np.array([0.0, 1e-41, -2.0, 0.3, 5.0, -20.0])
    args = [v.astype(dtype) for v in (ba, a_log, dt_bias)]
    want = ref.gates(*args, key_heads=Hk)
    # computed by the conv kernel (a thread per value head of each segment's first block):
    # two segments, a slot's and a padding one's (slot -1), cover the rows
    C, K = 5, 4
    x, w = np.zeros((R, C), dtype), np.zeros((C, K), dtype)
    window = cupy.asarray(np.zeros((1, K - 1, C), dtype))
    table = cupy.asarray(np.array([[0, 0, 350, -1], [-1, 350, R - 350, -1]], np.int32))
    _, *got = kern.conv_silu(cupy.asarray(x), cupy.asarray(w), window, table,
                             gates=(*(cupy.asarray(v) for v in args), Hk))
    for name, g, w in zip(("beta", "decay"), got, want, strict=True):
        _same_bits(to_numpy(g), w, f"gates {name}")
    # and near the float64 formula of the token loop (Ops.sigmoid / Ops.softplus)
    ba, a_log, dt_bias = (v.astype(np.float64) for v in args)
    b, a = (ba.reshape(R, Hk, 2 * r)[..., sl].reshape(R, -1) for sl in (slice(0, r),
                                                                          slice(r, None)))
    with np.errstate(over="ignore"):
        beta = 1 / (1 + np.exp(-b))
        x = a + dt_bias
        decay = np.exp(-np.exp(a_log) * np.where(x > 20, x, np.logaddexp(0, x)))
    tol = 1e-6 if dtype == np.float32 else 1e-14
    np.testing.assert_allclose(want[0], beta, rtol=tol, atol=tol)
    np.testing.assert_allclose(want[1], decay, rtol=0, atol=tol)


def test_a_slot_gives_the_same_bits_alone_row_by_row_and_in_any_layout():
    shape, dt, slots, most = SHAPES["real"], np.float32, 4, 5
    rng = np.random.default_rng(1)
    base = _inputs(rng, dt, shape, slots, 0)  # the slots' initial states
    rows = [_inputs(rng, dt, shape, 1, most) for _ in range(slots)]  # each slot's own rows

    def inputs(segs):  # the slots' rows in the layout's order
        return {**base, **{k: np.concatenate([rows[s][k][:n] for s, n, _ in segs])
                           for k in ("x", "decay", "beta")}}

    # row at a time: step[s][t] = (out row, window, state) after row t of slot s
    step = []
    for s in range(slots):
        a, mine = dict(base), []
        for t in range(most):
            a = {**a, **{k: rows[s][k][t:t + 1] for k in ("x", "decay", "beta")}}
            got = _run(cupy, a, *_table([(s, 1, False)]), shape)
            mine.append((got["out"][0], got["window"][s], got["state"][s]))
            a["window"], a["state"] = got["window"], got["state"]
        step.append(mine)
    layouts = [[(s, most, True) for s in range(slots)], [(s, 1, False) for s in range(slots)]]
    for _ in range(150):
        k = int(rng.integers(1, slots + 1))
        layouts.append([(int(s), int(rng.integers(1, most + 1)), bool(rng.random() < 0.5))
                        for s in rng.permutation(slots)[:k]])
    for segs in [[(s, n, False)] for s in range(slots) for n in range(1, most + 1)] + layouts:
        table, tracked = _table(segs)
        got = _run(cupy, inputs(segs), table, tracked, shape)
        for (s, row0, n, first), (_, _, track) in zip(table.tolist(), segs, strict=True):
            where = f"slot {s} rows {n} in layout {segs}"
            _same_bits(got["out"][row0:row0 + n], np.stack([o for o, _, _ in step[s][:n]]),
                       f"out, {where}")
            _same_bits(got["window"][s], step[s][n - 1][1], f"window, {where}")
            _same_bits(got["state"][s], step[s][n - 1][2], f"state, {where}")
            for t in range(n if track else 0):
                _same_bits(got["track_conv"][first + t], step[s][t][1], f"track {t}, {where}")
                _same_bits(got["track_rec"][first + t], step[s][t][2], f"track {t}, {where}")
        for s in set(range(slots)) - {s for s, _, _ in segs}:
            _same_bits(got["state"][s], base["state"][s], f"untouched slot {s} in {segs}")


@pytest.fixture(scope="module")
def next_ckpt(tmp_path_factory):
    path = make_tiny_model(tmp_path_factory.mktemp("m"), "qwen3_next", seed=5, tokenizer=False)
    return load_checkpoint(path, dtype=np.float64)


def _greedy(model, ids, steps: int) -> tuple[list[list[int]], list[np.ndarray]]:
    """Two slots: prefill, then ``steps`` greedy tokens each, decoded together."""
    caches = model.new_caches(2, 64)
    prompts = [ids[:11], ids[4:9]]
    out = model.forward(RaggedBatch.build([(s, 0, p) for s, p in enumerate(prompts)]), caches)
    tokens, logits = [[], []], []
    for _ in range(steps):
        lg = to_numpy(out.logits)
        logits.append(lg)
        for s in range(2):
            tokens[s].append(int(lg[s].argmax()))
        pos = [len(p) + len(t) - 1 for p, t in zip(prompts, tokens, strict=True)]
        out = model.forward(RaggedBatch.build([(s, pos[s], tokens[s][-1:]) for s in range(2)]),
                            caches)
    return tokens, logits


def test_tiny_qwen3_next_on_cupy_matches_numpy(next_ckpt, monkeypatch):
    ids = np.arange(1, 20) * 7 % 500
    want_tokens, want_logits = _greedy(Model(next_ckpt.config, next_ckpt.tensors, xp=np,
                                             dtype=np.float32), ids, 10)

    def no_loop(*args, **kwargs):
        raise AssertionError("CuPy float32 must take the GDN kernels, not the token loop")

    monkeypatch.setattr(gdn, "_token_loop", no_loop)
    model = Model(next_ckpt.config, next_ckpt.tensors, xp=cupy, dtype=np.float32)
    tokens, logits = _greedy(model, ids, 10)
    for i, (got, want) in enumerate(zip(logits, want_logits, strict=True)):
        np.testing.assert_allclose(got, want, rtol=0, atol=2e-4, err_msg=f"step {i}")
    assert tokens == want_tokens


def test_adopting_a_verified_row_equals_decoding_only_the_accepted_rows(next_ckpt):
    model = Model(next_ckpt.config, next_ckpt.tensors, xp=cupy, dtype=np.float64, exact=True)
    ids = np.arange(1, 20) * 5 % 500
    results = []
    for accepted in (None, 2):  # None: decode 3 rows plainly; 2: verify 5 rows, adopt 3
        caches = model.new_caches(2, 64)
        model.forward(RaggedBatch.build([(0, 0, ids[:8]), (1, 0, ids[8:12])]), caches)
        states = caches.states
        rows = ids[12:15] if accepted is None else ids[12:17]
        with states.verifying([0] if accepted is not None else []):
            model.forward(RaggedBatch.build([(0, 8, rows), (1, 4, ids[2:3])]), caches)
            if accepted is not None:
                assert states.track_rec.shape[1] == 5
                states.adopt(0, 1 + accepted)
        nxt = model.forward(RaggedBatch.build([(0, 11, ids[17:18])]), caches)
        results.append((to_numpy(states.conv[:, 0]), to_numpy(states.rec[:, 0]),
                        to_numpy(nxt.logits)))
    for got, want, what in zip(results[1], results[0], ("conv", "rec", "logits"), strict=True):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-12, err_msg=what)
