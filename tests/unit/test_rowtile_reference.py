"""The NumPy formula of the row-tile matrix kernel: its float32 FMA is correctly rounded (exact
rational arithmetic decides), its order is the documented one, and it stays within its
stated float64 bound. The kernel itself is compared in tests/gpu/test_rowtile_cupy.py."""

from __future__ import annotations

import shutil
import subprocess
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest

from gpu_worker.kernels import rowtile
from gpu_worker.kernels.rowtile_ref import error_bound, fma32, linear_rows_reference


def _round_f32(q: Fraction) -> np.float32:
    """The float32 nearest to ``q`` (ties to even), decided exactly among the neighbours of
    a float64 guess."""
    g = np.float32(float(q))
    cands = [g, np.nextafter(g, np.float32(np.inf)), np.nextafter(g, np.float32(-np.inf))]
    cands = [c for c in cands if np.isfinite(c)]
    best = min(abs(Fraction(float(c)) - q) for c in cands)
    ties = [c for c in cands if abs(Fraction(float(c)) - q) == best]
    return min(ties, key=lambda c: int(np.array(c).view(np.uint32)) & 1)


def test_fma32_is_correctly_rounded():
    rng = np.random.default_rng(0)
    n = 4000
    a = rng.standard_normal(n).astype(np.float32)
    b = rng.standard_normal(n).astype(np.float32)
    c = -(a * b)  # near-cancellation: the hard cases for double rounding
    c[: n // 2] = (rng.standard_normal(n // 2) * 10.0 ** rng.integers(-8, 8, n // 2)).astype(
        np.float32)
    got = fma32(a, b, c)
    for i in range(n):
        exact = Fraction(float(a[i])) * Fraction(float(b[i])) + Fraction(float(c[i]))
        want = _round_f32(exact)
        assert got[i].tobytes() == np.float32(want).tobytes(), (i, a[i], b[i], c[i], got[i], want)
    # double rounding: a * b + c = 1 + 3 * 2^-24 - 2^-70 rounds in float64 to the float32 tie
    # 1 + 3 * 2^-24 (then to even, 1 + 2^-22); rounded once it is 1 + 2^-23
    a1 = np.array([2.0 ** -12 * (1 + 2.0 ** -23)], np.float32)
    b1 = np.array([2.0 ** -12 * (1 - 2.0 ** -23)], np.float32)
    c1 = np.array([1 + 2.0 ** -23], np.float32)
    naive = (a1.astype(np.float64) * b1 + c1).astype(np.float32)
    assert naive[0] == np.float32(1 + 2.0 ** -22)
    assert fma32(a1, b1, c1)[0] == np.float32(1 + 2.0 ** -23)

def test_reference_follows_the_lane_order_and_its_bound():
    rng = np.random.default_rng(1)
    R, N, K = 3, 5, 300  # K past one 256-wide lane sweep and not a multiple of 8
    x = rng.standard_normal((R, K)).astype(np.float32)
    w = (rng.standard_normal((N, K)) * 0.1).astype(np.float32)
    bias = rng.standard_normal(N).astype(np.float32)
    got = linear_rows_reference(x, w, bias)
    # the order, written out plainly for one output
    xp = np.zeros(512, np.float32)
    wp = np.zeros(512, np.float32)
    xp[:K], wp[:K] = x[2], w[4]
    lanes = []
    for lane in range(32):
        acc = np.float32(0)
        for j in range(2):
            for e in range(8):
                k = 8 * (32 * j + lane) + e
                acc = fma32(np.array([wp[k]]), np.array([xp[k]]), np.array([acc]))[0]
        lanes.append(acc)
    s = np.array(lanes, np.float32)
    for o in (16, 8, 4, 2, 1):
        s[:o] = s[:o] + s[o:2 * o]
    assert got[2, 4].tobytes() == (s[0] + bias[4]).tobytes()
    exact = x.astype(np.float64) @ w.T.astype(np.float64) + bias
    err = np.abs(got - exact)
    assert (err <= error_bound(x, w, bias)).all(), float((err / error_bound(x, w, bias)).max())
    # bf16 bits give the float32 arithmetic of the widened values
    bits = (w.view(np.uint32) >> 16).astype(np.uint16)
    wide = (bits.astype(np.uint32) << 16).view(np.float32)
    assert linear_rows_reference(x, bits).tobytes() == linear_rows_reference(x, wide).tobytes()


# --- The kernel's own source on the CPU: g++ compiles it with a small CUDA stand-in (each
# thread of a block a std::thread, __syncthreads a barrier, a shuffle a per-warp slot and
# barrier, fma_rn the C library's correctly rounded fmaf), so its indexing, staging, register
# ring, tails and butterfly are checked against the reference without a GPU. ---

_PRELUDE = r"""
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <math.h>
#include <thread>
#include <vector>
using std::min;
struct U3 { int x = 0, y = 0, z = 0; };
thread_local U3 threadIdx;
U3 blockIdx;
static std::barrier<>* block_bar;
static std::barrier<>* warp_bar[32];
static float warp_slot[32][32];
static void __syncthreads() { block_bar->arrive_and_wait(); }
struct alignas(16) float4 { float x, y, z, w; };
struct alignas(8) float2 { float x, y; };
struct alignas(16) uint4 { unsigned int x, y, z, w; };
static float4 make_float4(float a, float b, float c, float d) { return {a, b, c, d}; }
static uint4 make_uint4(unsigned a, unsigned b, unsigned c, unsigned d) { return {a, b, c, d}; }
template <class T> static T __ldg(const T* p) {  // a misaligned 16-byte load faults on the GPU
    if (reinterpret_cast<uintptr_t>(p) % alignof(T)) { fprintf(stderr, "misaligned\n"); abort(); }
    return *p;
}
static float __uint_as_float(unsigned int u) { float f; std::memcpy(&f, &u, 4); return f; }
static float __shfl_xor_sync(unsigned, float v, int o) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    warp_slot[warp][lane] = v;
    warp_bar[warp]->arrive_and_wait();
    const float r = warp_slot[warp][lane ^ o];
    warp_bar[warp]->arrive_and_wait();
    return r;
}
#define __global__
#define __device__
#define __forceinline__ inline
#define __shared__ static
#define __align__(n) __attribute__((aligned(n)))
#define __launch_bounds__(a, b)
"""

_MAIN = r"""
static char* slurp(const char* path, size_t extra) {  // exact-size heap copy of a file
    FILE* f = fopen(path, "rb"); fseek(f, 0, SEEK_END); long n = ftell(f); fseek(f, 0, SEEK_SET);
    char* p = (char*)malloc(n + extra);
    if (fread(p, 1, n, f) != (size_t)n) abort();
    fclose(f); return p;
}
int main(int argc, char** argv) {  // dir R N K has_bias grid_x grid_y threads w_offset
    char p[4096];
    const int R = atoi(argv[2]), N = atoi(argv[3]), K = atoi(argv[4]), hb = atoi(argv[5]);
    const int gx = atoi(argv[6]), gy = atoi(argv[7]), T = atoi(argv[8]), off = atoi(argv[9]);
    snprintf(p, sizeof p, "%s/x", argv[1]); const float* x = (const float*)slurp(p, 0);
    snprintf(p, sizeof p, "%s/w", argv[1]); const WT* w = (const WT*)slurp(p, 0) + off;
    snprintf(p, sizeof p, "%s/b", argv[1]); const float* b = (const float*)slurp(p, 4);
    std::vector<float> out((size_t)R * N, NAN);
    for (int by = 0; by < gy; ++by) for (int bx = 0; bx < gx; ++bx) {
        blockIdx = U3{bx, by, 0};
        std::barrier<> bar(T); block_bar = &bar;
        std::vector<std::barrier<>*> warps;
        for (int i = 0; i < T / 32; ++i) warps.push_back(warp_bar[i] = new std::barrier<>(32));
        std::vector<std::thread> ts;
        for (int t = 0; t < T; ++t) ts.emplace_back([&, t] {
            threadIdx = U3{t, 0, 0};
            float* o = out.data();
            KERNEL(x, w, b, o, o, o, o, R, N, K, hb, N, N, N); });
        for (auto& th : ts) th.join();
        for (auto* wb : warps) delete wb;
    }
    snprintf(p, sizeof p, "%s/out", argv[1]);
    FILE* f = fopen(p, "wb"); fwrite(out.data(), 4, out.size(), f); fclose(f);
}
"""


def _emulate(tmp: Path, x: np.ndarray, w: np.ndarray, bias, nw: int, pf: int,
             woff: int = 0) -> np.ndarray:
    """``linear_rows`` with the kernel's source compiled by g++ (the launch of
    gpu_worker/kernels/rowtile.py: same grid, same variant); ``woff``: w starts that many
    elements into its buffer (not 16-byte aligned: element loads)."""
    R, K = x.shape
    N = w.shape[0]
    bf16 = w.dtype == np.uint16
    rt = rowtile.tile_rows(R)
    vec = K % 8 == 0 and woff * w.itemsize % 16 == 0
    src, name = rowtile.kernel_source(rt, bf16, nw, pf, vec)
    exe = tmp / name
    if not exe.exists():
        (tmp / f"{name}.cpp").write_text(_PRELUDE + src + f"#define KERNEL {name}\n" + _MAIN)
        subprocess.run([_GXX, "-std=c++20", "-O1", "-ffp-contract=off", "-fno-strict-aliasing",
                        "-pthread", "-w", "-o", str(exe), str(tmp / f"{name}.cpp")], check=True)
    run = tmp / "io"
    run.mkdir(exist_ok=True)
    x.tofile(run / "x")
    buf = np.zeros(N * K + woff, w.dtype)
    buf[woff:] = w.ravel()
    buf.tofile(run / "w")
    (np.zeros(0, np.float32) if bias is None else bias).tofile(run / "b")
    grid = (-(-R // rt), -(-N // (rowtile.WARPS * nw)), rowtile.WARPS * 32)
    subprocess.run([str(exe), str(run), str(R), str(N), str(K), str(int(bias is not None)),
                    *map(str, grid), str(woff)], check=True, timeout=120)
    return np.fromfile(run / "out", np.float32).reshape(R, N)


_GXX = shutil.which("g++")


@pytest.mark.skipif(_GXX is None, reason="no g++ for the CPU emulation of the kernel")
@pytest.mark.parametrize("bf16,K,N,R,nw,pf,woff", [
    (True, 2056, 40, 17, 4, 2, 0),   # 16-row tiles (one partial), 5 shared-memory slices, tail
    (False, 1003, 37, 3, 2, 4, 0),   # element loads, K % 8 = 3, 4-row tile with a padded row
    (True, 520, 19, 5, 1, 3, 1),     # unaligned bf16 matrix, other knobs, N not of a block
], ids=["bf16-vec-r16", "f32-elem-r4", "bf16-unaligned-r8"])
def test_the_kernel_source_on_the_cpu_gives_the_reference_bits(tmp_path, bf16, K, N, R, nw, pf,
                                                                woff):
    rng = np.random.default_rng(K + R)
    w = (rng.standard_normal((N, K)) * 0.05).astype(np.float32)
    w[0, :5] = [0.0, -0.0, 1e-38, -3e-39, 7.0]  # zeros, subnormals (kept: IEEE, no flush)
    w[1] *= np.float32(1e-37)  # a row of subnormal weights: flushed to 0 it would give 0
    if bf16:  # truncated to bf16 bits (a subnormal stays one)
        w = (w.view(np.uint32) >> 16).astype(np.uint16)
    x = rng.standard_normal((R, K)).astype(np.float32)
    x[1] = 0.0
    x[2] *= np.float32(1e-39)  # a row of subnormal activations
    bias = rng.standard_normal(N).astype(np.float32)
    for b in (None, bias):
        got = _emulate(tmp_path, x, w, b, nw, pf, woff)
        want = linear_rows_reference(x, w, b)
        diff = got.view(np.uint32) != want.view(np.uint32)
        assert not diff.any(), (int(diff.sum()), np.argwhere(diff)[0].tolist(),
                                got[diff][0], want[diff][0])


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="no nvcc")
def test_the_kernel_compiles_to_ieee_float_ops_even_under_ftz(tmp_path):
    """CuPy compiles every kernel with -ftz=true after the caller's options: the kernel's
    float arithmetic is written in PTX so that no flushing (.ftz) instruction is left."""
    for variant in ((16, True, 4, 2, True), (1, False, 2, 4, False)):
        src, name = rowtile.kernel_source(*variant)
        cu = tmp_path / f"{name}.cu"
        cu.write_text(src)
        subprocess.run(["nvcc", "-arch=sm_90", "--fmad=false", "-ftz=true", "-ptx", "-o",
                        str(tmp_path / "k.ptx"), str(cu)], check=True)
        ptx = (tmp_path / "k.ptx").read_text()
        assert ".ftz" not in ptx and "fma.rn.f32" in ptx and "add.rn.f32" in ptx, name


def test_row_tiles_follow_the_width_of_the_matrix():
    """Up to 4 rows one tile; above, tiles of 4 rows for narrow matrices, else of 8."""
    assert [rowtile.tile_rows(r, 8192) for r in (1, 2, 3, 4)] == [1, 2, 4, 4]
    assert [rowtile.tile_rows(r, 512) for r in (5, 8, 12, 16, 40)] == [4] * 5
    assert [rowtile.tile_rows(r, 2048) for r in (8, 12, 16)] == [4, 8, 8]
    assert [rowtile.tile_rows(r, 151936) for r in (5, 8, 12, 16)] == [8] * 4
    assert rowtile.tile_rows(12) == 12 and rowtile.tile_rows(40) == 16  # no width: smallest
