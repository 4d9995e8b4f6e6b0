"""Every test here needs a CUDA device; without one (CI, laptops) they are skipped."""

from __future__ import annotations

import pytest


def _have_cuda() -> bool:
    try:
        import cupy
    except ImportError:
        return False
    try:
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # no driver / no device
        return False


HAVE_CUDA = _have_cuda()


@pytest.fixture(autouse=True)
def _requires_cuda() -> None:
    if not HAVE_CUDA:
        pytest.skip("no CUDA device")


@pytest.fixture(scope="module", params=["qwen3_next", "qwen3_moe"])
def bf16_model(request, tmp_path_factory):
    """A tiny bf16 model of each architecture on CuPy (seed 4), sized for the speculation
    tests' three slots (tests/unit/test_speculation.py)."""
    from gpu_worker.engine import Engine  # noqa: PLC0415
    from scripts.tiny_model import make_tiny_model  # noqa: PLC0415
    from tests.unit.test_speculation import CONTEXT, SLOTS  # noqa: PLC0415

    path = make_tiny_model(tmp_path_factory.mktemp("m"), request.param, seed=4,
                           tokenizer=False)
    return Engine.from_dir(path, dtype="bfloat16", backend="cupy", max_slots=SLOTS,
                           max_len=CONTEXT).model
