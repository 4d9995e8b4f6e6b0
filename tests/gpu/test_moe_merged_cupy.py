"""The merged expert kernels (gpu_worker/kernels/moe_merged.py): the build kernel's lists, bits
equal to the NumPy reference of the same order (float32, bf16), a float64 check, and a row's
bits alone equal to its bits in batches of 2..64 rows of any routing."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from gpu_worker.kernels.int8_stack import Int8Stack, quantize_stack
from gpu_worker.kernels.moe_merged_ref import build_lists_reference, experts_merged_reference
from gpu_worker.model.moe import experts_local
from gpu_worker.model.ops import Ops

cupy = pytest.importorskip("cupy")

BF16 = np.dtype(ml_dtypes.bfloat16)
# (E, I, H): I % 8 != 0 (scalar loads), H past one 256-wide lane sweep with a ragged tail,
# and the 80B's widths (16-byte loads, full sweeps)
SHAPES = [(12, 100, 200), (9, 96, 264), (24, 512, 2048)]


def _ids(rng, rows: int, k: int, E: int, pool: int | None = None) -> np.ndarray:
    """[rows, k] distinct experts per row out of the first ``pool`` ids, a quarter -1."""
    ids = np.stack([rng.permutation(pool or E)[:k] for _ in range(rows)])
    ids[rng.random((rows, k)) < 0.25] = -1
    return ids


def _stacks(rng, E: int, I: int, H: int, kind: str) -> list:
    """gate, up [E, I, H], down [E, H, I] as host arrays of the kind's storage (int8: stacks
    of int8 blocks by the CPU experts' rule)."""
    out = [rng.standard_normal(s, np.float32) * np.float32(0.1)
           for s in ((E, I, H), (E, I, H), (E, H, I))]
    if kind == "int8":
        return [quantize_stack(a) for a in out]
    return [a.astype(BF16).view(np.uint16) for a in out] if kind == "bf16" else out


def _dev(a):
    """A host stack on the device (an int8 stack's two arrays)."""
    if isinstance(a, Int8Stack):
        return Int8Stack(cupy.asarray(a.q), cupy.asarray(a.d))
    return cupy.asarray(a)


def _diff(got: np.ndarray, want: np.ndarray) -> str:
    """Enough to fix a mismatch without another run."""
    if got.shape != want.shape:
        return f"shape {got.shape} != {want.shape}"
    u = np.uint64 if got.dtype == np.float64 else np.uint32
    bad = np.argwhere(got.view(u) != want.view(u))
    if not len(bad):
        return "equal"
    i = tuple(bad[0])
    return (f"{len(bad)} of {got.size} differ; first at {i}: {got[i]!r} vs {want[i]!r}; "
            f"max abs diff {np.abs(got - want).max():.3g} (max |want| {np.abs(want).max():.3g})")


def _run(x, ids, w, stacks):
    from gpu_worker.kernels.moe_merged import experts_merged

    return cupy.asnumpy(experts_merged(cupy.asarray(x), cupy.asarray(ids), cupy.asarray(w),
                                       *(_dev(a) for a in stacks)))


def test_build_lists_match_the_reference():
    from gpu_worker.kernels.moe_merged import build_lists

    rng = np.random.default_rng(0)
    for R, k, E in [(1, 10, 512), (5, 4, 12), (40, 8, 6), (64, 10, 512), (70, 3, 1200)]:
        ids = _ids(rng, R, min(k, E), E)
        ids[0, 0] = E + 2  # not on this side either
        if k > 1:
            ids[-1, 1] = ids[-1, 0] = 3  # a row naming an expert twice
        got = {n: cupy.asnumpy(a) for n, a in build_lists(cupy.asarray(ids), E).items()}
        want = build_lists_reference(ids, E)
        n, q = int(want["n_active"]), int(want["act_count"].sum())
        where = f"R={R} k={k} E={E}"
        assert int(got["n_active"][0]) == n, where
        for name in ("act_expert", "act_start", "act_count"):
            assert got[name][:n].tolist() == want[name].tolist(), (where, name)
        assert got["list_row"][:q].tolist() == want["list_row"].tolist(), where
        assert got["pair_q"].tolist() == want["pair_q"].tolist(), where


@pytest.mark.parametrize("kind", ["float32", "bf16", "int8"])
@pytest.mark.parametrize("shape", SHAPES)
def test_bits_equal_the_numpy_reference(kind, shape):
    E, I, H = shape
    if kind == "int8" and (I % 32 or H % 32):
        I, H = -(-I // 32) * 32, -(-H // 32) * 32  # int8 blocks of 32 along every row
    rng = np.random.default_rng(E)
    stacks = _stacks(rng, E, I, H, kind)
    for R, k in [(1, 10), (6, 10)] if E == 24 else [(1, 4), (7, 8), (20, 6)]:  # NumPy's time
        x = rng.standard_normal((R, H)).astype(np.float32)
        ids = _ids(rng, R, k, E)
        ids[0, :2] = ids[0, 0] if ids[0, 0] >= 0 else 1  # a row naming an expert twice
        if R > 1:
            ids[-1] = -1  # and one with no expert here
        w = rng.random((R, k)).astype(np.float32)
        got = _run(x, ids, w, stacks)
        want = experts_merged_reference(x, ids, w, *stacks)
        assert got.tobytes() == want.tobytes(), f"{kind} {shape} R={R} k={k}: " + _diff(got, want)
        assert R == 1 or not got[-1].any()


@pytest.mark.parametrize("kind,tol", [("float64", 1e-12), ("float32", 2e-5), ("bf16", 2e-5)])
def test_against_float64(kind, tol):
    E, I, H = SHAPES[1]
    rng = np.random.default_rng(5)
    stacks = _stacks(rng, E, I, H, kind)
    R, k = 16, 6
    dtype = np.float64 if kind == "float64" else np.float32
    x = rng.standard_normal((R, H)).astype(dtype)
    ids, w = _ids(rng, R, k, E), rng.random((R, k)).astype(dtype)
    wide = [(a.astype(np.uint32) << 16).view(np.float32) if kind == "bf16" else a
            for a in stacks]
    if kind == "float64":
        stacks = [a.astype(np.float64) for a in stacks]
    want = experts_local(Ops(np, np.float64), *(a.astype(np.float64) for a in wide), x, ids, w)
    got = _run(x, ids, w, stacks)
    assert got.dtype == dtype
    np.testing.assert_allclose(got, want, rtol=0, atol=tol * np.abs(want).max())


@pytest.mark.parametrize("kind", ["float32", "bf16", "int8"])
def test_a_rows_bits_do_not_depend_on_its_batch(kind):
    """64 candidate rows: 40 of them share expert 3, experts 20..23 have no row, a quarter of
    the pairs are -1, row 63 has none; every row alone, then batches of 2..64 rows."""
    E, I, H, k = (24, 64, 160, 5) if kind == "int8" else (24, 72, 136, 5)
    rng = np.random.default_rng(7)
    stacks = _stacks(rng, E, I, H, kind)
    x = rng.standard_normal((64, H)).astype(np.float32)
    ids = _ids(rng, 64, k, E, pool=20)
    for r in range(40):
        ids[r][ids[r] == 3] = -1
        ids[r, r % k] = 3
    ids[63] = -1
    w = rng.random((64, k)).astype(np.float32)
    alone = np.concatenate([_run(x[r:r + 1], ids[r:r + 1], w[r:r + 1], stacks)
                            for r in range(64)])
    want = experts_merged_reference(x, ids, w, *stacks)
    assert alone.tobytes() == want.tobytes(), "alone vs reference: " + _diff(alone, want)
    for n in (2, 3, 5, 8, 12, 16, 17, 33, 40, 64):
        for trial in range(2):
            pick = np.arange(n) if trial == 0 and n <= 40 else rng.permutation(64)[:n]
            got = _run(x[pick], ids[pick], w[pick], stacks)
            assert got.tobytes() == alone[pick].tobytes(), (
                f"{kind} batch of {n} (rows {pick.tolist()[:8]}...): " + _diff(got, alone[pick]))


@pytest.mark.parametrize("kind", ["float32", "bf16", "int8"])
def test_rows_per_pass_does_not_change_the_bits(kind):
    """RC (rows a block applies each weight load to) only changes the passes: 20 rows of
    top-6 of 8 experts (up to 20 rows an expert) give the same bits at RC 1..16."""
    from gpu_worker.kernels.moe_merged import experts_merged

    E, I, H = 8, 64, 256
    rng = np.random.default_rng(11)
    stacks = [_dev(a) for a in _stacks(rng, E, I, H, kind)]
    x = cupy.asarray(rng.standard_normal((20, H)).astype(np.float32))
    ids = cupy.asarray(_ids(rng, 20, 6, E))
    w = cupy.asarray(rng.random((20, 6)).astype(np.float32))
    outs = {rc: cupy.asnumpy(experts_merged(x, ids, w, *stacks, rc=rc)) for rc in (1, 2, 4, 8, 16)}
    for rc, got in outs.items():
        assert got.tobytes() == outs[16].tobytes(), f"RC {rc} vs 16: " + _diff(got, outs[16])


def test_experts_local_takes_the_merged_kernels(monkeypatch):
    from gpu_worker.kernels.moe_experts import experts_grouped
    from gpu_worker.kernels.moe_merged import experts_merged
    from gpu_worker.model import moe

    E, I, H = SHAPES[0]
    rng = np.random.default_rng(9)
    stacks = [cupy.asarray(a) for a in _stacks(rng, E, I, H, "float32")]
    x = cupy.asarray(rng.standard_normal((6, H)).astype(np.float32))
    ids = cupy.asarray(_ids(rng, 6, 4, E))
    w = cupy.asarray(rng.random((6, 4)).astype(np.float32))
    ops = Ops(cupy, np.float32)
    assert moe.GPU_EXPERT_KERNELS == "merged"
    got = cupy.asnumpy(experts_local(ops, *stacks, x, ids, w))
    assert got.tobytes() == cupy.asnumpy(experts_merged(x, ids, w, *stacks)).tobytes()
    monkeypatch.setattr(moe, "GPU_EXPERT_KERNELS", "grouped")
    old = cupy.asnumpy(experts_local(ops, *stacks, x, ids, w))
    assert old.tobytes() == cupy.asnumpy(experts_grouped(x, ids, w, *stacks)).tobytes()
    np.testing.assert_allclose(got, old, rtol=0, atol=2e-5 * np.abs(old).max())


def test_bad_shapes_are_refused():
    from gpu_worker.kernels.moe_merged import experts_merged

    rng = np.random.default_rng(4)
    gate, up, down = (cupy.asarray(a) for a in _stacks(rng, 6, 40, 64, "float32"))
    x = cupy.asarray(rng.standard_normal((2, 64)).astype(np.float32))
    ids, w = cupy.asarray(_ids(rng, 2, 3, 6)), cupy.ones((2, 3), cupy.float32)
    with pytest.raises(ValueError, match="do not fit"):
        experts_merged(x[:, :-1], ids, w, gate, up, down)
    with pytest.raises(TypeError, match="dtype"):
        experts_merged(x, ids, w, gate.astype(cupy.float64), up, down)


@pytest.mark.parametrize("kind", ["float32", "bf16", "int8"])
def test_a_pass_past_the_row_cap_keeps_each_rows_bits(kind, monkeypatch):
    """More rows than GROUPED_MAX_ROWS (a full prefill chunk beside decode rows): the kernels
    run over row blocks, and every row has the bits of a pass under the cap (not those of
    the per-expert loop's other order)."""
    from gpu_worker.model import moe

    E, I, H, R = 8, 64, 256, 21
    rng = np.random.default_rng(13)
    stacks = [_dev(a) for a in _stacks(rng, E, I, H, kind)]
    x = cupy.asarray(rng.standard_normal((R, H)).astype(np.float32))
    ids, w = cupy.asarray(_ids(rng, R, 4, E)), cupy.asarray(rng.random((R, 4)).astype(np.float32))
    ops = Ops(cupy, np.float32)
    whole = cupy.asnumpy(experts_local(ops, *stacks, x, ids, w))
    monkeypatch.setattr(moe, "GROUPED_MAX_ROWS", 8)  # blocks of 8, 8 and 5 rows
    got = cupy.asnumpy(experts_local(ops, *stacks, x, ids, w))
    assert got.tobytes() == whole.tobytes(), _diff(got, whole)


def test_int8_experts_in_experts_local():
    """int8 stacks: decode batches and a prefill chunk past GROUPED_MAX_ROWS take the
    merged kernels (the reference's bits), close to float64 of the exact values; a mix of
    int8 and float stacks is refused, and the grouped kernels refuse int8."""
    from gpu_worker.kernels.moe_experts import experts_grouped
    from gpu_worker.model import moe

    E, I, H, k = 10, 64, 96, 4
    rng = np.random.default_rng(21)
    host = _stacks(rng, E, I, H, "int8")
    stacks = [_dev(a) for a in host]
    ops = Ops(cupy, np.float32)
    for R in (3, moe.GROUPED_MAX_ROWS + 5):
        x = rng.standard_normal((R, H)).astype(np.float32)
        ids, w = _ids(rng, R, k, E), rng.random((R, k)).astype(np.float32)
        got = cupy.asnumpy(experts_local(ops, *stacks, cupy.asarray(x), cupy.asarray(ids),
                                         cupy.asarray(w)))
        want = experts_merged_reference(x, ids, w, *host)
        assert got.tobytes() == want.tobytes(), _diff(got, want)
        wide = [a.values().astype(np.float64) for a in host]
        ref = experts_local(Ops(np, np.float64), *wide, x.astype(np.float64), ids, w)
        np.testing.assert_allclose(got, ref, rtol=0, atol=2e-5 * np.abs(ref).max())
    x, ids = cupy.asarray(x[:2]), cupy.asarray(ids[:2])
    w = cupy.asarray(w[:2])
    with pytest.raises(TypeError, match="int8"):
        experts_local(ops, stacks[0], cupy.asarray(host[1].values()), stacks[2], x, ids, w)
    with pytest.raises(TypeError, match="int8"):
        experts_grouped(x, ids, w, *stacks)
