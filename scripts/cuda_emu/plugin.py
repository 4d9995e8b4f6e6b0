"""pytest plugin: CuPy is the CPU emulator's fake (``-p scripts.cuda_emu.plugin``, as
``python -m scripts.cuda_emu.run`` passes it). Tests too large for the CPU are skipped with
the reason in SKIP (``CUDA_EMU_NO_SKIP=1`` runs them anyway)."""

from __future__ import annotations

import os
import sys

import pytest

# test name (or a prefix of it) -> why the emulator skips it
SKIP = {
    "test_gpu_frequencies_match": "300,000 sampled rows (~20 min on the CPU)",
    "test_a_bf16_checkpoint_with_cpu_experts": "the pinned-ring kernels are launched through "
                                                "the driver API, which the emulator lacks",
}


def install() -> None:
    """Make ``import cupy`` give the fake (before anything imports the real one)."""
    from scripts.cuda_emu import fake_cupy  # noqa: PLC0415

    fake_cupy.__name__ = "cupy"
    sys.modules["cupy"] = fake_cupy
    sys.modules["cupy.cuda"] = fake_cupy.cuda


install()


def pytest_collection_modifyitems(config, items) -> None:
    if os.environ.get("CUDA_EMU_NO_SKIP"):
        return
    for item in items:
        for prefix, why in SKIP.items():
            if item.name.startswith(prefix):
                item.add_marker(pytest.mark.skip(reason=f"CUDA emulator: {why}"))
