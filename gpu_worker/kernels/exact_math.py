"""The exact arithmetic of token sampling, written once for NumPy and once as CUDA source.

Both sides must produce the same bits (docs/sampling.md), so this module uses only integer
operations (uint64 wrapping like CUDA's) and correctly rounded float64 operations (+ - * /,
rint, conversions, scaling by powers of two). ``CUDA_SOURCE`` is generated from the same
constants, as raw bit patterns, so the two cannot drift apart.

* :func:`draw64`: a counter-based generator, splitmix64's finaliser applied to
  (seed, position, counter): 64 uniform bits, the same on any machine.
* :func:`exp_nonpos`: ``exp(x)`` for ``x <= 0`` by Cody-Waite range reduction
  ``x = k ln2 + r`` (|r| <= ln2 / 2) and a degree-13 Taylor polynomial in Horner form, every
  multiply and add rounded separately (no FMA). Max relative error vs ``np.exp`` on
  [-28, 0]: 2.2e-16, one unit in the last place (tests/unit/test_sampling_exact.py).
* :func:`masses`: integer masses ``q = floor(exp((z - max z) / T) * 2**40)``.
"""

from __future__ import annotations

import math
import struct
from fractions import Fraction

import numpy as np

MASS_BITS = 40  # the max-logit token weighs exactly 2**40
X_CUT = -28.0  # exp(-28) * 2**40 < 1: below it every mass is 0, so the exp is skipped
INV_LN2 = 1.4426950408889634  # 1 / ln 2, rounded
LN2_HI = 6.93147180369123816490e-01  # ln 2 with 21 trailing zero bits: k * LN2_HI is exact
LN2_LO = 1.90821492927058770002e-10  # ln 2 - LN2_HI
EXP_COEF = tuple(1.0 / math.factorial(j) for j in range(14))  # 1/j!, j = 0..13
MASK64 = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15  # odd multipliers of the (seed, position, counter) combination
POS_MUL = 0xD1B54A32D192ED03
CTR_MUL = 0xDB4F0B9175AE2165


def mix64(z: int) -> int:
    """splitmix64's finaliser (a bijection of 64-bit integers)."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return z ^ (z >> 31)


def draw64(seed: int, position: int, counter: int = 0) -> int:
    """64 uniform bits keyed by (seed, position, counter); distinct positions of one seed
    (and distinct counters) give distinct inputs to the last bijection."""
    h = mix64((seed ^ GOLDEN) & MASK64)
    h = mix64((h + (position + 1) * POS_MUL) & MASK64)
    return mix64((h ^ ((counter * CTR_MUL + GOLDEN) & MASK64)) & MASK64)


def uniform_below(bits: int, bound: int) -> int:
    """``floor(bits * bound / 2**64)``: an integer in [0, bound) (bound < 2**64). Each value
    is hit by floor or ceil of 2**64 / bound of the 2**64 inputs, so a range of w values has
    probability w / bound within 2**-64."""
    return (bits * bound) >> 64


def ceil_times(p: float, total: int) -> int:
    """``ceil(p * total)`` computed exactly (no rounding): the top-p mass bound."""
    return math.ceil(Fraction(p) * total)


def min_mass(min_p: float) -> int:
    """``ceil(min_p * 2**40)``: the min-p mass bound (min_p * 2**40 is exact in float64)."""
    return math.ceil(min_p * float(1 << MASS_BITS))


def exp_nonpos(x: np.ndarray) -> np.ndarray:
    """``exp(x)`` [n] float64 for ``X_CUT <= x <= 0`` (other inputs: garbage, callers mask
    them). Same operations in the same order as ``exp_nonpos`` of ``CUDA_SOURCE``."""
    k = np.rint(x * INV_LN2)
    r = (x - k * LN2_HI) - k * LN2_LO
    p = np.full_like(r, EXP_COEF[13])
    for c in EXP_COEF[12::-1]:
        p = p * r + c
    scale = ((k.astype(np.int64) + 1023) << 52).view(np.float64)  # 2**k, exactly
    return p * scale


def masses(logits: np.ndarray, temperature: float) -> np.ndarray:
    """int64 masses [V] of one row: ``x = (z - m) / T`` (x = 0 where z == m, so a +inf
    logit is the max), ``q = floor(exp(x) * 2**40)`` where ``x >= X_CUT``, else 0 (also for
    -inf and NaN logits). ``m``: the max non-NaN logit; every mass is 0 if it is -inf."""
    z = np.asarray(logits).astype(np.float64)
    finite = z[~np.isnan(z)]
    m = finite.max() if finite.size else -np.inf
    q = np.zeros(z.size, np.int64)
    if m == -np.inf:
        return q
    with np.errstate(invalid="ignore", over="ignore"):  # inf - inf where z == m == inf
        x = np.where(z == m, 0.0, (z - m) / temperature)
    live = x >= X_CUT  # NaN compares false
    e = exp_nonpos(x[live])
    q[live] = (e * float(1 << MASS_BITS)).astype(np.int64)  # truncation = floor (e >= 0)
    return q


def _bits(v: float) -> str:
    return f"__longlong_as_double(0x{struct.unpack('<q', struct.pack('<d', v))[0] & MASK64:016x}LL)"


def _cuda_source() -> str:
    horner = "\n".join(f"    p = __dadd_rn(__dmul_rn(p, r), {_bits(c)});"
                       for c in EXP_COEF[12::-1])
    return rf"""
__device__ __forceinline__ unsigned long long mix64(unsigned long long z) {{
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}}

__device__ unsigned long long draw64(unsigned long long seed, unsigned long long pos,
                                     unsigned long long counter) {{
    unsigned long long h = mix64(seed ^ 0x{GOLDEN:X}ULL);
    h = mix64(h + (pos + 1ULL) * 0x{POS_MUL:X}ULL);
    return mix64(h ^ (counter * 0x{CTR_MUL:X}ULL + 0x{GOLDEN:X}ULL));
}}

// exp(x) for X_CUT <= x <= 0: the operations of exact_math.exp_nonpos, each rounded.
__device__ double exp_nonpos(double x) {{
    double k = rint(__dmul_rn(x, {_bits(INV_LN2)}));
    double r = __dsub_rn(__dsub_rn(x, __dmul_rn(k, {_bits(LN2_HI)})),
                         __dmul_rn(k, {_bits(LN2_LO)}));
    double p = {_bits(EXP_COEF[13])};
{horner}
    double scale = __longlong_as_double((long long)((int)k + 1023) << 52);
    return __dmul_rn(p, scale);
}}

// The mass of one logit z, given the row's max m and temperature T (exact_math.masses).
__device__ long long mass_of(double z, double m, double T) {{
    double x = (z == m) ? 0.0 : __ddiv_rn(__dsub_rn(z, m), T);
    if (!(x >= {_bits(X_CUT)})) return 0;
    return (long long)__dmul_rn(exp_nonpos(x), {_bits(float(1 << MASS_BITS))});
}}

// ceil(p * total) exactly, 0 < p < 1, 0 < total < 2**63 (exact_math.ceil_times).
__device__ unsigned long long ceil_times(double p, unsigned long long total) {{
    int e;
    double f = frexp(p, &e);  // p = f 2**e, f in [0.5, 1): p = M 2**-s
    unsigned long long M = (unsigned long long)__dmul_rn(f, 9007199254740992.0);
    int s = 53 - e;
    unsigned long long hi = __umul64hi(M, total), lo = M * total, out, rest;
    if (s >= 128) return 1ULL;
    if (s >= 64) {{
        int t = s - 64;
        out = hi >> t;
        rest = lo | (t ? (hi & ((1ULL << t) - 1ULL)) : 0ULL);
    }} else {{
        out = (hi << (64 - s)) | (lo >> s);
        rest = lo & ((1ULL << s) - 1ULL);
    }}
    return out + (rest ? 1ULL : 0ULL);
}}
"""


CUDA_SOURCE = _cuda_source()
