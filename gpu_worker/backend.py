"""The array backend of the GPU worker: one ``xp`` module handle, NumPy or CuPy.

Model code never imports numpy or cupy for array math; it receives ``xp`` and calls it.
"""

from __future__ import annotations

from types import ModuleType

import numpy as np


def get_xp(name: str = "numpy") -> ModuleType:
    """Return the array module for ``name`` ("numpy" | "cupy" | "auto")."""
    if name == "numpy":
        return np
    if name in ("cupy", "auto"):
        try:
            import cupy  # noqa: PLC0415

            cupy.cuda.runtime.getDeviceCount()
            return cupy
        except Exception as exc:  # ImportError, CUDARuntimeError: no usable device
            if name == "auto":
                return np
            raise RuntimeError(f"backend 'cupy' requested but unusable: {exc}") from None
    raise ValueError(f"unknown array backend {name!r} (numpy | cupy | auto)")


def to_numpy(array) -> np.ndarray:
    """Copy a backend array to host memory (no copy for NumPy)."""
    if isinstance(array, np.ndarray):
        return array
    return array.get()
