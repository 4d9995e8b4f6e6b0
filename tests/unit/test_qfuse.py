"""The canonical QFUSE quantizer: NumPy reference and Numba version agree byte for byte."""

import numpy as np
import pytest

from cpu_experts.quant import (
    F16_MAX,
    NonFiniteActivation,
    f16_bits,
    f16_round,
    quantize,
    quantize_ref,
)


def assert_same(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    q_ref, d_ref = quantize_ref(x)
    q, d = quantize(x)
    assert q.dtype == np.int8 and d.dtype == np.float16
    assert q.shape == x.shape and d.shape == (*x.shape[:-1], x.shape[-1] // 32)
    assert q.tobytes() == q_ref.tobytes()
    assert d.tobytes() == d_ref.tobytes()
    return q_ref, d_ref


def block(values: list[float], fill: float = 0.0) -> np.ndarray:
    out = np.full(32, fill, np.float32)
    out[:len(values)] = values
    return out


@pytest.mark.parametrize("scale", [1e-6, 1e-3, 1.0, 37.0, 1e4, 1e7])
def test_random_inputs_match(scale: float) -> None:
    rng = np.random.default_rng(int(scale * 1000) % 2**32)
    x = (rng.standard_normal((9, 512)) * scale).astype(np.float32)
    x[3] *= 1e-3  # rows of very different magnitude
    assert_same(x)
    assert_same(x.astype(np.float64) * 1.0000001)  # float64 input: rounded to float32 first


def test_rule_by_hand() -> None:
    # amax = 127 -> d = 1 exactly -> q = round-half-even(x): ties go to the even neighbour
    x = block([127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 3.49, -126.5, 125.5])
    q, d = assert_same(x[None])
    assert d[0, 0] == 1.0
    assert list(q[0, :10]) == [127, 0, 2, 2, 0, -2, -2, 3, -126, 126]


def test_zero_block_and_mixed_blocks() -> None:
    zero = np.zeros(32, np.float32)
    x = np.concatenate([zero, block([-3.0, 2.0, 1.0]), -zero])
    q, d = assert_same(x[None])
    assert d[0, 0] == 0 and d[0, 2] == 0 and not q[0, :32].any() and not q[0, 64:].any()
    assert d[0, 1] == np.float16(np.float32(3.0) / np.float32(127))


def test_fp16_scale_overflow_clamps_to_65504() -> None:
    x = np.stack([block([1e7, -5e6, 1.0]), block([3e38, -3e38]), block([65504.0 * 127])])
    q, d = assert_same(x)
    assert (d == np.float16(F16_MAX)).all()
    assert q[0, 0] == 127 and q[0, 1] == -76 and q[1, 0] == 127 and q[1, 1] == -127


def test_scale_underflow() -> None:
    # d below 2**-25 rounds to 0 -> all q = 0; a d in the subnormal halves keeps a tiny scale
    x = np.stack([block([1e-9, -5e-10]), block([1e-5, -3e-6, 2e-7]), block([127 * 2.0**-25])])
    q, d = assert_same(x)
    assert d[0, 0] == 0 and not q[0].any()
    assert d[1, 0] == np.float16(np.float32(1e-5) / np.float32(127)) and d[1, 0] > 0
    assert d[1, 0] < 2.0**-14  # subnormal half
    assert d[2, 0] == 0  # exactly half the smallest subnormal: tie -> even (0)


def test_exactly_representable_amax_and_scale_ties() -> None:
    # d = 2**-3 exactly; d = 1 + 2**-11 is a tie between halves 1 and 1 + 2**-10 (even: 1);
    # d = 1 + 3 * 2**-11 is a tie between 1 + 2**-10 and 1 + 2**-9 (even: 1 + 2**-9)
    x = np.stack([block([127 * 0.125, 0.0625, -0.1875, 3.0]),
                  block([np.float32(127 * (1 + 2.0**-11))]),
                  block([np.float32(127 * (1 + 3 * 2.0**-11))])])
    q, d = assert_same(x)
    assert d[0, 0] == 0.125 and list(q[0, :4]) == [127, 0, -2, 24]
    assert d[1, 0] == 1.0 and d[2, 0] == 1 + 2.0**-9


def test_mixed_signs_and_rounding_beyond_127() -> None:
    rng = np.random.default_rng(5)
    x = rng.uniform(-1, 1, (64, 128)).astype(np.float32)
    x[:, ::32] = np.where(rng.random((64, 4)) < 0.5, -1.0, 1.0) * 0.999  # amax at block start
    q, d = assert_same(x)
    assert q.min() == -127 and q.max() == 127


@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
def test_non_finite_raises(bad: float) -> None:
    x = np.ones((3, 64), np.float32)
    x[2, 40] = bad
    for fn in (quantize_ref, quantize):
        with pytest.raises(NonFiniteActivation, match="non-finite"):
            fn(x)
    with pytest.raises(NonFiniteActivation, match="row 2, column 40"):
        quantize(x)


def test_shape_must_be_multiple_of_32() -> None:
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize(np.ones((2, 48), np.float32))


def test_f16_round_matches_numpy_conversion() -> None:
    rng = np.random.default_rng(0)
    bits = rng.integers(0, 0x477FE000, 200_000, dtype=np.uint32)  # [0, just under 65520)
    edges = np.array([0, 1, 0x33000000, 0x33000001, 0x387FC000, 0x387FE000, 0x38800000,
                      0x477FE000 - 1, 0x477FE000, 0x477FEFFF, 0x477FF000], np.uint32)
    d = np.concatenate([bits, edges]).view(np.float32)
    with np.errstate(over="ignore"):
        want = np.minimum(d.astype(np.float16).astype(np.float64), F16_MAX)
    pick = np.r_[0:20000, len(d) - 11:len(d)]
    got = np.array([f16_round(float(v)) for v in d[pick]])
    assert np.array_equal(got, want[pick])
    halves = np.arange(0, 0x7C00, dtype=np.uint16).view(np.float16)
    assert all(f16_bits(float(h)) == i for i, h in enumerate(halves))
