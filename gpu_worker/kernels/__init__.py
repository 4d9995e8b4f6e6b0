"""CuPy kernels of the GPU worker (RawModules compiled on first use)."""

from __future__ import annotations

import functools


@functools.cache
def raw_module(code: str, what: str, options: tuple[str, ...] = ("--fmad=false",)):
    """The compiled ``cupy.RawModule`` of ``code`` (once per process); ``what`` names the
    kernels in the error raised where CuPy is missing."""
    try:
        import cupy as cp  # noqa: PLC0415
    except ImportError as exc:
        raise RuntimeError(f"CuPy is not installed: the {what} need it") from exc
    return cp.RawModule(code=code, options=options)
