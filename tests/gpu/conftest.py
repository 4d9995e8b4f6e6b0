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
