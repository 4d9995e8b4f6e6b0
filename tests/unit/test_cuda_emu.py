"""The CUDA emulator (scripts/cuda_emu): kernels' CUDA sources compiled with g++ and run on the
CPU give their NumPy references' bits; a barrier under a per-thread condition is reported as a
deadlock naming the kernel and the lines; -ftz=true is modelled (subnormals flushed, PTX
without .ftz kept); kernel arguments are checked as CuPy would need them."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from scripts.cuda_emu.module import DeadlockError, KernelFault, LaunchTimeout, RawModule, gxx

pytestmark = pytest.mark.skipif(gxx() is None, reason="no g++ for the CUDA emulator")
OPTS = ("--fmad=false",)


@pytest.fixture
def cupy(monkeypatch):
    """The fake CuPy as ``cupy`` for the kernel modules' lazy imports."""
    from scripts.cuda_emu import fake_cupy  # noqa: PLC0415

    monkeypatch.setitem(sys.modules, "cupy", fake_cupy)
    return fake_cupy


def _bits_equal(got, want, what: str) -> None:
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape, (what, got.shape, want.shape)
    diff = got.tobytes() != want.tobytes()
    assert not diff, (what, np.argwhere(got != want)[:3].tolist(), float(np.abs(got - want).max()))


def test_rowtile_kernel_gives_the_reference_bits(cupy):
    from gpu_worker.kernels.rowtile import linear_rows  # noqa: PLC0415
    from gpu_worker.kernels.rowtile_ref import linear_rows_reference  # noqa: PLC0415

    rng = np.random.default_rng(0)
    K, N, R = 300, 19, 3  # element loads (K % 8 = 4), a partial block of outputs
    w = (rng.standard_normal((N, K)) * 0.05).astype(np.float32)
    w[1] *= np.float32(1e-37)  # subnormal weights: kept by the kernel's PTX even under -ftz
    x = rng.standard_normal((R, K)).astype(np.float32)
    bias = rng.standard_normal(N).astype(np.float32)
    for b in (None, bias):
        got = cupy.asnumpy(linear_rows(cupy.asarray(x), cupy.asarray(w),
                                       None if b is None else cupy.asarray(b)))
        _bits_equal(got, linear_rows_reference(x, w, b), f"rowtile, bias {b is not None}")
    assert (cupy.asnumpy(linear_rows(cupy.asarray(x), cupy.asarray(w)))[:, 1] != 0).all()


def test_gdn_kernels_with_a_partial_tile_give_the_twin_bits(cupy):
    from gpu_worker.kernels import gdn_recurrent as kern  # noqa: PLC0415
    from gpu_worker.kernels import gdn_reference as ref  # noqa: PLC0415

    Hk, Hv, Dk, Dv, K, R = 1, 3, 24, 40, 3, 5  # Dv 40: a tile of 32 and one of 8 threads
    C = 2 * Hk * Dk + Hv * Dv
    rng = np.random.default_rng(1)
    a = {"x": rng.normal(size=(R, C)), "w": rng.normal(size=(C, K)) * 0.5,
         "window": rng.normal(size=(2, K - 1, C)), "state": rng.normal(size=(2, Hv, Dk, Dv)),
         "decay": rng.uniform(0.5, 1, (R, Hv)), "beta": rng.uniform(size=(R, Hv))}
    a = {k: v.astype(np.float32) for k, v in a.items()}
    table = np.array([[1, 0, 2, -1], [0, 2, 3, -1]], np.int32)
    outs = []
    for xp, mod in ((cupy, kern), (np, ref)):
        window, state = xp.array(a["window"]), xp.array(a["state"])
        y = mod.conv_silu(xp.asarray(a["x"]), xp.asarray(a["w"]), window, xp.asarray(table))
        out = mod.recurrence(y, xp.asarray(a["decay"]), xp.asarray(a["beta"]), state,
                             xp.asarray(table), key_heads=Hk, scale=float(Dk ** -0.5))
        outs.append([v.get() if xp is cupy else v for v in (y, out, window, state)])
    for name, got, want in zip(("y", "out", "window", "state"), *outs, strict=True):
        _bits_equal(got, want, name)


@pytest.mark.parametrize(("hd", "hkv", "g", "quant", "part", "bs"), [
    (32, 2, 2, False, 64, 16),   # one partition per row
    (48, 1, 10, False, 16, 16),  # a lane with two dims, another with one; 10 heads: 2 blocks
    (16, 2, 3, False, 16, 8),    # lanes past hd; several partitions; chunks across blocks
    (64, 1, 2, True, 32, 16),    # the int8 cache
    (128, 1, 2, False, 16, 4),   # hd = 32 x 4: the unclamped variant; blocks of 4
    (256, 1, 1, True, 32, 32),   # hd = 32 x 8, int8
])
def test_paged_attention_gives_the_reference_bits(cupy, hd, hkv, g, quant, part, bs):
    from gpu_worker.kernels import paged_attention as pa  # noqa: PLC0415
    from gpu_worker.kv_cache import KVCache  # noqa: PLC0415

    lengths = (3, 40)
    rng = np.random.default_rng(2)
    kv = KVCache(cupy, 2, 2 * -(-40 // bs) + 1, bs, hkv, hd, np.dtype(np.float32), quant=quant)
    host = []
    for s, n in enumerate(lengths):
        kv.reserve(s, 0, n)
        k, v = (rng.standard_normal((n, hkv, hd)).astype(np.float32) for _ in range(2))
        meta = np.array([np.arange(n), np.full(n, s), np.arange(n)], np.int32)
        pa.write_kv(kv, 1, cupy.asarray(k), cupy.asarray(v), cupy.asarray(meta),
                    kv.device_tables())
        host.append((k, v))
    rows = [(0, 0, 2), (1, 1, 39), (2, 1, 16), (3, 1, 15)]
    q = rng.standard_normal((len(rows), hkv * g, hd)).astype(np.float32)
    out = cupy.empty(q.shape, np.float32)
    scale = np.float32(hd ** -0.5)
    meta = cupy.asarray(np.array(rows, np.int32).T.copy())
    pa.paged_attention(cupy.asarray(q), kv, 1, meta, kv.device_tables(), out, scale,
                       partition=part)
    keys, values = (np.zeros((len(rows), 40, hkv, hd), np.float32) for _ in range(2))
    for i, (_, s, p) in enumerate(rows):
        if quant:
            for a, pool, scales in ((keys, kv.k, kv.ks), (values, kv.v, kv.vs)):  # as stored
                a[i, :p + 1] = _dequant(kv, cupy.asnumpy(pool), cupy.asnumpy(scales), s, p)
        else:
            keys[i, :p + 1], values[i, :p + 1] = host[s][0][:p + 1], host[s][1][:p + 1]
    want = pa.attention_reference(q, keys, values, np.array([p for *_, p in rows]), scale,
                                  partition=part)
    _bits_equal(out.get(), want, "paged attention")
    looped = cupy.empty(q.shape, np.float32)  # a grid of one partition: warps loop over all
    pa.paged_attention(cupy.asarray(q), kv, 1, meta, kv.device_tables(), looped, scale,
                       partition=part, grid_warps=1, min_blocks=2)
    _bits_equal(looped.get(), want, "paged attention, partitions looped, 2 blocks per SM")


def _dequant(kv, pool, scales, slot: int, pos: int) -> np.ndarray:
    """Positions 0..pos of a slot in layer 1 of an int8 pool, as the kernel widens them."""
    out = []
    for p in range(pos + 1):
        blk = kv.tables[slot][p // kv.block_size]
        q = pool[1, blk, p % kv.block_size].astype(np.float32)  # [Hkv, hd]
        d = scales[1, blk, p % kv.block_size].view(np.float16).astype(np.float32)
        out.append(q * np.repeat(d, 32, axis=-1))
    return np.stack(out)


_BARRIERS = r"""
extern "C" __global__ void partial_tile(const float* x, float* y, int n) {
    __shared__ float s[64];
    int j = blockIdx.x * blockDim.x + threadIdx.x;
    bool on = j < n;
    s[threadIdx.x] = on ? x[j] : 0.0f;
    if (on) __syncwarp();   // lanes past n skip it and wait at __syncthreads
    __syncthreads();
    if (on) y[j] = s[threadIdx.x ^ 1];
}
extern "C" __global__ void early_exit(const float* x, float* y, int n) {
    int j = threadIdx.x;
    if (j >= n) return;     // exited threads count as arrived at __syncthreads
    __shared__ float s[64];
    s[j] = x[j];
    __syncthreads();
    y[j] = s[n - 1 - j];
}
extern "C" __global__ void spin(volatile int* flag) {
    while (!*flag) __nanosleep(100);
}
"""


def test_a_barrier_under_a_condition_is_reported_as_a_deadlock(cupy):
    mod = RawModule(code=_BARRIERS, options=OPTS)
    x = cupy.asarray(np.arange(64, dtype=np.float32))
    y = cupy.zeros(64, np.float32)
    with pytest.raises(DeadlockError) as err:
        mod.get_function("partial_tile")((2,), (32,), (x, y, np.int32(40)))
    msg = str(err.value)
    assert "kernel partial_tile, block (1,0,0)" in msg, msg
    assert "threads 0-7: __syncwarp (line 7)" in msg and "threads 8-31: __syncthreads (line 8)" \
        in msg, msg
    y = cupy.zeros(64, np.float32)  # all 64 lanes on: no deadlock, every value swapped
    mod.get_function("partial_tile")((2,), (32,), (x, y, np.int32(64)))
    _bits_equal(y.get(), np.arange(64, dtype=np.float32).reshape(-1, 2)[:, ::-1].ravel(), "xor")
    y = cupy.zeros(64, np.float32)
    mod.get_function("early_exit")((1,), (64,), (x, y, np.int32(50)))
    assert y.get()[:50].tolist() == list(range(49, -1, -1)) and not y.get()[50:].any()


def test_a_launch_that_never_ends_times_out(cupy, monkeypatch):
    monkeypatch.setenv("CUDA_EMU_TIMEOUT", "0.5")
    mod = RawModule(code=_BARRIERS, options=OPTS)
    with pytest.raises(LaunchTimeout, match="kernel spin"):
        mod.get_function("spin")((1,), (32,), (cupy.zeros(1, np.int32),))


_FTZ = r"""
extern "C" __global__ void ops(const float* a, const float* b, float* y) {
    int i = threadIdx.x;
    y[4 * i] = a[i] + b[i];              // add.ftz.f32 under -ftz=true
    y[4 * i + 1] = __fmaf_rn(a[i], 1.0f, b[i]);
    float d;
    asm("add.rn.f32 %0, %1, %2;" : "=f"(d) : "f"(a[i]), "f"(b[i]));  // IEEE whatever the flags
    y[4 * i + 2] = d;
    y[4 * i + 3] = (float)((double)a[i] * 2.0);  // double: not flushed by nvcc's -ftz
}
"""


@pytest.mark.parametrize("ftz", [True, False])
def test_ftz_flushes_float_subnormals_but_not_ieee_ptx(cupy, ftz):
    a = np.array([1e-39, 3e-39, 1.0], np.float32)  # subnormal, subnormal, normal
    b = np.array([0.0, -1e-39, 2e-39], np.float32)
    y = cupy.zeros(12, np.float32)
    RawModule(code=_FTZ, options=OPTS, ftz=ftz).get_function("ops")(
        (1,), (3,), (cupy.asarray(a), cupy.asarray(b), y))
    got = y.get().reshape(3, 4)
    exact = a + b
    want_flushed = np.where(np.abs(exact) < np.finfo(np.float32).tiny, 0, exact)
    want_flushed[2] = np.float32(1.0)  # 1 + subnormal: the subnormal input is read as 0
    _bits_equal(got[:, 0], want_flushed if ftz else exact, f"a + b, ftz {ftz}")
    _bits_equal(got[:, 1], want_flushed if ftz else exact, f"__fmaf_rn, ftz {ftz}")
    _bits_equal(got[:, 2], exact, f"PTX add.rn.f32, ftz {ftz}")
    if not ftz:
        _bits_equal(got[:, 3], (a.astype(np.float64) * 2).astype(np.float32), "double")


def test_arguments_are_checked_as_the_device_needs_them(cupy):
    fn = RawModule(code=_BARRIERS, options=OPTS).get_function("early_exit")
    x, y = cupy.zeros(4, np.float32), cupy.zeros(4, np.float32)
    with pytest.raises(TypeError, match="device array is needed"):
        fn((1,), (4,), (np.zeros(4, np.float32), y, np.int32(4)))
    with pytest.raises(TypeError, match="int64 for a 4-byte signed integer"):
        fn((1,), (4,), (x, y, np.int64(4)))
    with pytest.raises(TypeError, match="NumPy scalar"):
        fn((1,), (4,), (x, y, 4))
    with pytest.raises(TypeError, match="Implicit conversion"):
        np.asarray(x)
    assert not isinstance(x, np.ndarray) and isinstance(x.get(), np.ndarray)


def test_a_misaligned_vector_load_faults(cupy):
    src = r"""extern "C" __global__ void v(const float* x, float* y) {
        float4 a = __ldg((const float4*)(x + 1)); y[0] = a.x; }"""
    with pytest.raises(KernelFault, match="misaligned"):
        RawModule(code=src, options=OPTS).get_function("v")(
            (1,), (1,), (cupy.zeros(8, np.float32), cupy.zeros(1, np.float32)))


def test_the_graph_and_router_gpu_tests_pass_on_the_emulator():
    """CUDA graphs' host side (layouts, capacity buckets, static inputs, shared buffers,
    start-up capture, MTP drafting graphs with buckets), the router, top-k and synthetic
    routing kernels, the input stacks (one product for matrices that read the same rows), run
    by their GPU tests on the emulator (a stand-in capture there; real capture and the CPU
    experts' ring only on a GPU)."""
    import subprocess  # noqa: PLC0415

    files = ["tests/gpu/test_step_graph_cupy.py", "tests/gpu/test_router_cupy.py",
             "tests/gpu/test_topk_cupy.py", "tests/gpu/test_synthetic_routing_cupy.py",
             "tests/gpu/test_input_stacks_cupy.py"]
    proc = subprocess.run(
        [sys.executable, "-m", "scripts.cuda_emu.run", *files, "-q", "-p", "no:cacheprovider",
         "-k", "not cpu_experts and not exact"],
        capture_output=True, text=True, timeout=900,
        cwd=Path(__file__).resolve().parents[2])
    tail = (proc.stdout + proc.stderr)[-3000:]
    assert proc.returncode == 0, tail
    assert " passed" in tail and " failed" not in tail, tail


def test_paged_attention_refuses_a_head_dim_past_its_registers(cupy):
    from gpu_worker.kernels import paged_attention as pa  # noqa: PLC0415
    from gpu_worker.kv_cache import KVCache  # noqa: PLC0415

    hd = pa.MAX_DIM + 32
    kv = KVCache(cupy, 1, 4, 16, 1, hd, np.dtype(np.float32))
    q = cupy.zeros((1, 2, hd), np.float32)
    meta = cupy.asarray(np.zeros((3, 1), np.int32))
    with pytest.raises(ValueError, match="head dims of up to 256"):
        pa.paged_attention(q, kv, 0, meta, kv.device_tables(), cupy.empty_like(q),
                           np.float32(1.0))


@pytest.mark.parametrize("H", [16, 200, 256, 300, 2048, 2100])
def test_fused_norm_gives_the_reference_bits_in_registers_and_in_batches(cupy, H):
    """Rows of up to 256 and 2,048 held in registers, longer ones in batches: one order."""
    from gpu_worker.kernels.fused_norm import rms_norm_rows  # noqa: PLC0415
    from gpu_worker.kernels.fused_norm_ref import rms_norm_reference  # noqa: PLC0415

    rng = np.random.default_rng(H)
    x = (rng.standard_normal((3, H + 5)) * 3).astype(np.float32)[:, :H]  # rows at a stride
    x[1, :7] *= np.float32(1e-20)
    w = rng.standard_normal(H).astype(np.float32)
    for zc in (False, True):
        got = cupy.asnumpy(rms_norm_rows(cupy.asarray(x), cupy.asarray(w), 1e-6,
                                         zero_centered=zc))
        _bits_equal(got, rms_norm_reference(x, w, 1e-6, zero_centered=zc), f"norm {H} {zc}")


@pytest.mark.parametrize("H", [200, 2048, 2100])
def test_fused_add_norm_gives_the_sum_and_its_norm(cupy, H):
    """x + r (float32) stored, and the norm of that sum: the bits of the two steps apart."""
    from gpu_worker.kernels.fused_norm import add_rms_norm_rows  # noqa: PLC0415
    from gpu_worker.kernels.fused_norm_ref import rms_norm_reference  # noqa: PLC0415

    rng = np.random.default_rng(H + 1)
    x, r = (rng.standard_normal((3, H)).astype(np.float32) for _ in range(2))
    w = rng.standard_normal(H).astype(np.float32)
    total, normed = add_rms_norm_rows(cupy.asarray(x), cupy.asarray(r), cupy.asarray(w), 1e-6,
                                      zero_centered=True)
    _bits_equal(cupy.asnumpy(total), x + r, f"sum {H}")
    _bits_equal(cupy.asnumpy(normed), rms_norm_reference(x + r, w, 1e-6, zero_centered=True),
                f"norm of the sum {H}")


_SLCT = r"""
extern "C" __global__ void slct(const float* a, const float* b, const int* c, float* d) {
    int i = threadIdx.x;
    float r;
    asm volatile("slct.f32.s32 %0, %1, %2, %3;" : "=f"(r) : "f"(a[i]), "f"(b[i]), "r"(c[i]));
    d[i] = r;
}
"""


def test_slct_selects_on_the_sign_of_its_int(cupy):
    mod = RawModule(code=_SLCT, options=OPTS)
    a, b = np.arange(4, dtype=np.float32), -np.arange(4, dtype=np.float32) - 10
    c = np.array([0, -1, 5, -7], np.int32)
    d = cupy.zeros(4, np.float32)
    mod.get_function("slct")((1,), (4,), (cupy.asarray(a), cupy.asarray(b), cupy.asarray(c), d))
    _bits_equal(d.get(), np.where(c >= 0, a, b), "slct")


def test_the_attention_grid_stays_small_for_long_context_limits():
    from gpu_worker.kernels.paged_attention import grid_partitions  # noqa: PLC0415

    assert grid_partitions(9, 1, 16) == 9  # every partition its warp
    assert grid_partitions(2049, 1, 16) == 512  # 128k tokens, one row: 8,192 warps
    assert grid_partitions(2049, 16, 16) == 32  # 16 rows
    assert grid_partitions(65, 16, 16) == 32 and grid_partitions(3, 16, 16) == 3
