"""The NumPy twin of the GDN kernels (gpu_worker/kernels/gdn_reference.py) against the token
loop of gpu_worker/model/gdn.py in float64, its exp, log1p and softplus against NumPy's. The
GPU kernels equal the twin bit for bit (tests/gpu/test_gdn_kernel_cupy.py), so this ties them
to the model's math. Also the token loop's per-row states (the NumPy path of speculative
verification), and the kernels' CUDA source: no barrier that only some threads reach (they
deadlock on a GPU)."""

from __future__ import annotations

import re
import types

import numpy as np
import pytest

from gpu_worker.kernels import gdn_reference as ref
from gpu_worker.kernels.gdn_recurrent import exp_constants, source
from gpu_worker.model.batch import RaggedBatch
from gpu_worker.model.gdn import _token_loop
from gpu_worker.model.ops import Ops
from gpu_worker.states import RecurrentStates

SHAPE = {"Hk": 2, "Hv": 4, "Dk": 12, "Dv": 8, "K": 4}


@pytest.mark.parametrize("dtype, ulps", [(np.float32, 2), (np.float64, 2)])
def test_exp_neg_is_within_two_ulps_of_exp(dtype, ulps):
    u = -np.concatenate([np.linspace(0, 90 if dtype == np.float32 else 700, 200_001),
                         np.geomspace(1e-30, 1.0, 10_001)]).astype(dtype)
    got, want = ref.exp_neg(u), np.exp(u.astype(np.float64))
    normal = u >= exp_constants(dtype)["under"]  # below: 0 by rule
    assert not got[~normal].any()
    err = np.abs(got[normal] - want[normal]) / (np.spacing(want[normal].astype(dtype)))
    assert err.max() <= ulps, (u[normal][err.argmax()], err.max())
    assert ref.exp_neg(np.array([-1e3, -np.inf, np.nan], dtype)).tolist() == [0, 0, 0]
    assert ref.exp_neg(np.zeros(1, dtype))[0] == 1


@pytest.mark.parametrize("dtype, top", [(np.float32, 88.0), (np.float64, 709.0)])
def test_exp_neg_holds_for_positive_arguments_too(dtype, top):
    u = np.linspace(0, top, 100_001).astype(dtype)  # exp(A_log) in the gates kernel
    got, want = ref.exp_neg(u), np.exp(u.astype(np.float64))
    assert (np.abs(got - want) / np.spacing(want.astype(dtype))).max() <= 2


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_log1p01_is_within_three_ulps_of_log1p(dtype):
    tiny = np.finfo(dtype).tiny
    y = np.concatenate([np.linspace(0, 1, 400_001), np.geomspace(tiny, 1, 100_001)]).astype(dtype)
    got, want = ref.log1p01(y), np.log1p(y.astype(np.float64))
    err = np.abs(got - want) / np.spacing(want.astype(dtype))
    assert err.max() <= 3, (y[err.argmax()], err.max())
    assert ref.log1p01(np.array([0, 1], dtype)).tolist() == [0, np.log1p(dtype(1))]


@pytest.mark.parametrize("dtype, under", [(np.float32, -87.0), (np.float64, -708.0)])
def test_softplus_is_within_four_ulps_and_keeps_the_rule_above_20(dtype, under):
    x = np.concatenate([np.linspace(under, 20, 400_001), np.geomspace(1e-30, 1, 10_001),
                        -np.geomspace(1e-30, 1, 10_001)]).astype(dtype)
    got, want = ref.softplus(x), np.logaddexp(0, x.astype(np.float64))
    err = np.abs(got - want) / np.spacing(want.astype(dtype))
    assert err.max() <= 4, (x[err.argmax()], err.max())
    big = np.array([20.5, 1e3, np.inf], dtype)
    np.testing.assert_array_equal(ref.softplus(big), big)  # Ops.softplus: x above 20
    assert ref.softplus(np.array([under - 1, -np.inf], dtype)).tolist() == [0, 0]  # exp_neg's 0


def _states(slots: int, dtype) -> RecurrentStates:
    s = SHAPE
    return RecurrentStates(np, 1, slots, 2 * s["Hk"] * s["Dk"] + s["Hv"] * s["Dv"], s["K"],
                           s["Hv"], s["Dk"], s["Dv"], dtype)


def _cfg():
    s = SHAPE
    return types.SimpleNamespace(linear_num_key_heads=s["Hk"], linear_num_value_heads=s["Hv"],
                                 linear_key_head_dim=s["Dk"], linear_value_head_dim=s["Dv"])


def test_reference_equals_the_token_loop_in_float64():
    rng = np.random.default_rng(0)
    parts = [(2, 7, [1, 2, 3]), (0, 4, [5]), (1, 0, list(range(9)))]  # slot, start, tokens
    batch = RaggedBatch.build(parts)
    R, s = batch.num_rows, SHAPE
    C = 2 * s["Hk"] * s["Dk"] + s["Hv"] * s["Dv"]
    mixed = rng.normal(size=(R, C))
    conv_w = rng.normal(size=(C, s["K"])) * 0.5
    beta = rng.uniform(0.1, 0.9, size=(R, s["Hv"]))
    g = -rng.uniform(0.01, 2.0, size=(R, s["Hv"]))
    loop, twin = _states(3, np.float64), _states(3, np.float64)
    for st in (loop, twin):
        st.conv[:] = np.random.default_rng(1).normal(size=st.conv.shape)
        st.rec[:] = np.random.default_rng(2).normal(size=st.rec.shape) * 0.3
    loop.track([2, 1])
    table = loop.segment_table(batch.segments)
    out_loop = _token_loop(Ops(np, np.float64), _cfg(), mixed, conv_w, beta, g, batch, loop, 0)

    track_conv, track_rec = np.empty_like(loop.track_conv[0]), np.empty_like(loop.track_rec[0])
    y = ref.conv_silu(mixed, conv_w, twin.conv[0], table, track_conv)
    out = ref.recurrence(y, np.exp(g), beta, twin.rec[0], table, key_heads=s["Hk"],
                         scale=s["Dk"] ** -0.5, track=track_rec)
    tol = {"rtol": 1e-12, "atol": 1e-12}
    np.testing.assert_allclose(out, out_loop, **tol)
    np.testing.assert_allclose(twin.rec, loop.rec, **tol)
    np.testing.assert_array_equal(twin.conv, loop.conv)
    np.testing.assert_allclose(track_rec, loop.track_rec[0], **tol)
    np.testing.assert_array_equal(track_conv, loop.track_conv[0])
    assert table.tolist() == [[2, 0, 3, 0], [0, 3, 1, -1], [1, 4, 9, 3]]


def test_adopt_takes_the_state_after_the_accepted_rows():
    rng = np.random.default_rng(3)
    s = SHAPE
    C = 2 * s["Hk"] * s["Dk"] + s["Hv"] * s["Dv"]
    mixed, conv_w = rng.normal(size=(5, C)), rng.normal(size=(C, s["K"]))
    beta, g = rng.uniform(0.1, 0.9, size=(5, s["Hv"])), -rng.uniform(0, 1, size=(5, s["Hv"]))
    ops, cfg = Ops(np, np.float64), _cfg()
    verified, plain = _states(1, np.float64), _states(1, np.float64)
    with verified.verifying([0]):
        batch = RaggedBatch.build([(0, 0, range(5))])
        verified.segment_table(batch.segments)
        _token_loop(ops, cfg, mixed, conv_w, beta, g, batch, verified, 0)
        with pytest.raises(ValueError, match="adopt 6 rows of a 5-row segment"):
            verified.adopt(0, 6)
        verified.adopt(0, 2)
    assert verified.track_rec is None
    batch = RaggedBatch.build([(0, 0, range(2))])
    plain.segment_table(batch.segments)
    _token_loop(ops, cfg, mixed[:2], conv_w, beta[:2], g[:2], batch, plain, 0)
    np.testing.assert_array_equal(verified.conv, plain.conv)
    np.testing.assert_array_equal(verified.rec, plain.rec)


# a condition or thread-dependent value in a block header around a barrier
_DIVERGENT = re.compile(r"\b(if|else|while|switch|return|tid|threadIdx|lane|on|j)\b|\?")


def barrier_problems(src: str) -> list[str]:
    """Each __syncthreads() / __syncwarp() of the CUDA ``src`` that some threads of a block
    may not reach: inside a block whose header (the text before its ``{``) is a condition or
    names a thread-dependent value, in an unbraced statement, or after a ``return`` of its
    kernel. Headers are split at ``;`` outside parentheses (a ``for`` header stays whole);
    the line numbers count the source without its comments."""
    src = re.sub(r"//[^\n]*|/\*.*?\*/", "", src, flags=re.S)  # line numbers: without comments
    problems, stack, last, depth, kernel = [], [], 0, 0, 0
    for m in re.finditer(r"[{}();]|__sync(?:threads|warp)\s*\(", src):
        tok = m.group()
        if tok in "()":
            depth += 1 if tok == "(" else -1
            continue
        if tok == ";" and depth:
            continue
        if tok == "{":
            header = src[last:m.start()].strip()
            stack.append(header)
            kernel = m.end() if "__global__" in header else kernel
        elif tok == "}":
            stack.pop()
        elif tok != ";":
            depth += 1  # the call's "(": its ")" comes next
            where = f"{tok.strip()}) at {src.count(chr(10), 0, m.start()) + 1}"
            bad = [h for h in stack if "__global__" not in h and _DIVERGENT.search(h)]
            if bad or src[last:m.start()].strip():
                problems.append(f"{where}: under {bad or src[last:m.start()].strip()!r}")
            if re.search(r"\breturn\b", src[kernel:m.start()]):
                problems.append(f"{where}: after a return")
            continue
        last = m.end()
    return problems


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shape", [{"key_dim": 16}, {"key_dim": 24}, {"key_dim": 128},
                                   {"conv_kernel": 4}])
def test_every_thread_of_a_block_reaches_every_barrier(dtype, shape):
    src = source(dtype, **shape)
    assert barrier_problems(src) == [], src
    if "key_dim" in shape:  # the checker sees a barrier under a condition
        assert src.count("__syncwarp();") == 1
        bad = src.replace("__syncwarp();", "if (on) { __syncwarp(); }")
        assert len(barrier_problems(bad)) == 1
        assert barrier_problems(src.replace("__syncwarp();", "if (on) __syncwarp();"))
        assert barrier_problems(src.replace("bool on", "if (!on) return; bool on"))
