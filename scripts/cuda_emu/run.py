"""``python -m scripts.cuda_emu.run tests/gpu/test_rowtile_cupy.py [pytest options]``: a GPU
test file on the CPU, its kernels compiled with g++ by the CUDA emulator (scripts/cuda_emu)."""

from __future__ import annotations

import sys

import pytest


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    return int(pytest.main(["-p", "scripts.cuda_emu.plugin", *args]))


if __name__ == "__main__":
    sys.exit(main())
